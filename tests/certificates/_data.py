"""Small checkpoint pairs for the certify tests: a base state dict, a run that trained it as
declared, and writers for each format (safetensors, torch.save, torch.distributed.checkpoint).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

FORMATS = ("safetensors", "torch", "dcp")
SPEC = {"freeze": ["trunk"], "bn": "eval"}


def base_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A trunk (Linear + BatchNorm), a head, and an output layer tied to the embedding."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "embed.weight": torch.randn(10, 6, generator=g),
        "trunk.0.weight": torch.randn(6, 6, generator=g),
        "trunk.0.bias": torch.randn(6, generator=g),
        "trunk.1.weight": torch.ones(6),
        "trunk.1.bias": torch.zeros(6),
        "trunk.1.running_mean": torch.randn(6, generator=g),
        "trunk.1.running_var": torch.rand(6, generator=g) + 0.5,
        "trunk.1.num_batches_tracked": torch.tensor(7),
        "head.weight": torch.randn(3, 6, generator=g),
        "head.bias": torch.zeros(3),
    }
    state["out.weight"] = state["embed.weight"].clone()
    return state


def trained(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The run as declared by SPEC: the trunk and its statistics untouched, the head and the
    tied embedding/output moved (together)."""
    out = {k: v.clone() for k, v in state.items()}
    out["head.weight"] += 0.25
    out["head.bias"] += 0.5
    out["embed.weight"] -= 0.125
    out["out.weight"] = out["embed.weight"].clone()
    return out


def save(fmt: str, state: dict[str, torch.Tensor], path: Path) -> Path:
    """Write ``state`` in format ``fmt`` to ``path`` (a file, or a folder for ``dcp``)."""
    state = {k: v.clone().contiguous() for k, v in state.items()}  # no shared storage
    if fmt == "safetensors":
        save_file(state, str(path))
    elif fmt == "torch":
        torch.save(state, path)
    elif fmt == "dcp":
        save_dcp({"model": state, "step": 3}, path)
    else:
        raise ValueError(fmt)
    return path


def save_dcp(state: dict[str, object], path: Path) -> Path:
    """A distributed checkpoint from this one process, one shard file per tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is unavailable ... single process"
        dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=False))
    return path


def pair(
    tmp: Path, fmt: str, tuned: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None = None
) -> tuple[Path, Path]:
    """Write the base and the tuned state in ``fmt``; return their paths."""
    suffix = {"safetensors": ".safetensors", "torch": ".pt", "dcp": ""}[fmt]
    first = save(fmt, base_state() if base is None else base, tmp / f"base{suffix}")
    return first, save(fmt, tuned, tmp / f"tuned{suffix}")


# --------------------------------------------------------------------------------------------
# LoRA: a base in bf16, an adapter, and the model merged from both as PEFT merges it

R, ALPHA = 4, 8.0
TARGET = "model.layers.0.q_proj"


def lora_base() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed_tokens.weight": torch.randn(12, 8, generator=g).bfloat16(),
        f"{TARGET}.weight": torch.randn(16, 8, generator=g).bfloat16(),
        "model.layers.0.k_proj.weight": torch.randn(16, 8, generator=g).bfloat16(),
        "lm_head.weight": torch.randn(12, 8, generator=g).bfloat16(),
    }


def lora_adapter(*, head: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    out = {
        f"base_model.model.{TARGET}.lora_A.weight": (
            0.3 * torch.randn(R, 8, generator=g)
        ).bfloat16(),
        f"base_model.model.{TARGET}.lora_B.weight": (
            0.3 * torch.randn(16, R, generator=g)
        ).bfloat16(),
    }
    if head:  # modules_to_save: the adapter carries its own trained head
        out["base_model.model.lm_head.weight"] = torch.randn(12, 8, generator=g).bfloat16()
    return out


def lora_config(**extra: object) -> dict[str, object]:
    return {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj"], **extra}


def merged(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], *, scale: float = ALPHA / R
) -> dict[str, torch.Tensor]:
    """``W + scale * B @ A`` in the weight's dtype, and the adapter's modules_to_save."""
    out = {k: v.clone() for k, v in base.items()}
    a = adapter[f"base_model.model.{TARGET}.lora_A.weight"]
    b = adapter[f"base_model.model.{TARGET}.lora_B.weight"]
    out[f"{TARGET}.weight"] = out[f"{TARGET}.weight"] + (b @ a) * scale
    if "base_model.model.lm_head.weight" in adapter:
        out["lm_head.weight"] = adapter["base_model.model.lm_head.weight"].clone()
    return out


def write_lora(
    tmp: Path, tuned: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], **config: object
) -> dict[str, Path]:
    paths = {
        "base": tmp / "base.safetensors",
        "tuned": tmp / "merged.safetensors",
        "adapter": tmp / "adapter_model.safetensors",
        "config": tmp / "adapter_config.json",
    }
    save_file(lora_base(), str(paths["base"]))
    save_file({k: v.contiguous() for k, v in tuned.items()}, str(paths["tuned"]))
    save_file(adapter, str(paths["adapter"]))
    paths["config"].write_text(json.dumps(lora_config(**config)))
    return paths
