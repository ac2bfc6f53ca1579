"""Five corruptions planted in small checkpoint pairs, for the ``certify`` section: one base
row changed, a tie broken, a drifted buffer (``torch.save`` pairs), a stale shard (a
torch.distributed.checkpoint folder) and a LoRA merged without its scale (safetensors).

Each pair is certified twice: as saved by a run that kept its claims (it must be certified
clean) and with the corruption planted (the certificate must fail on exactly the planted key,
with the expected finding).
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from isolate.certificates import certify
from isolate.certificates.dcp_folder import DcpCheckpoint

__all__ = ["Planted", "plant_all"]

State = dict[str, torch.Tensor]
_SPEC = {"freeze": ["trunk"]}


@dataclass(frozen=True)
class Planted:
    """One corruption: what the clean pair and the corrupted one were certified as."""

    name: str
    expected: list[tuple[str, str]]  # (key, finding) of the one failure the corruption causes
    clean_pair_clean: bool
    failures: list[tuple[str, str]]
    seconds_clean: float
    seconds_corrupted: float

    @property
    def caught(self) -> bool:
        return self.clean_pair_clean and self.failures == self.expected


def _base() -> State:
    g = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": torch.randn(10, 6, generator=g),
        "trunk.0.weight": torch.randn(6, 6, generator=g),
        "trunk.1.running_mean": torch.randn(6, generator=g),
        "head.weight": torch.randn(3, 6, generator=g),
    }
    state["out.weight"] = state["embed.weight"].clone()
    return state


def _trained(state: State) -> State:
    """The run as declared: the trunk untouched, the head and the tied pair moved together."""
    out = {k: v.clone() for k, v in state.items()}
    out["head.weight"] += 0.25
    out["embed.weight"] -= 0.125
    out["out.weight"] = out["embed.weight"].clone()
    return out


def _failures(cert: Any) -> list[tuple[str, str]]:
    return [(v.key, v.finding) for v in cert.failures]


def _both(
    name: str,
    expected: list[tuple[str, str]],
    check: Callable[[bool], Any],
) -> Planted:
    """Certify the clean pair (``check(False)``) and the corrupted one (``check(True)``)."""
    start = time.perf_counter()
    clean = check(False)
    middle = time.perf_counter()
    corrupted = check(True)
    end = time.perf_counter()
    return Planted(name, expected, clean.clean, _failures(corrupted), middle - start, end - middle)


def _in_state_dicts(folder: Path) -> list[Planted]:
    """A base row changed, a tie broken, a drifted buffer: ``torch.save`` pairs."""
    plants: list[tuple[str, str, str, Callable[[State], object]]] = [
        ("base row changed", "trunk.0.weight", "changed",
         lambda t: t["trunk.0.weight"][3].add_(1e-6)),
        ("tie broken", "embed.weight = out.weight", "tie broken",
         lambda t: t["out.weight"].add_(0.5)),
        ("drifted buffer", "trunk.1.running_mean", "changed",
         lambda t: t["trunk.1.running_mean"][2].add_(0.01)),
    ]  # fmt: skip
    out = []
    for name, key, finding, plant in plants:

        def check(corrupt: bool, plant: Callable[[State], object] = plant) -> Any:
            tuned = _trained(_base())
            if corrupt:
                plant(tuned)
            torch.save(_base(), folder / "base.pt")
            torch.save(tuned, folder / "tuned.pt")
            return certify(folder / "base.pt", folder / "tuned.pt", spec=_SPEC)

        out.append(_both(name, [(key, finding)], check))
    return out


def _dcp(state: State, path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    shutil.rmtree(path, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saving without a process group
        save({"model": state}, storage_writer=FileSystemWriter(path, single_file_per_rank=False))


def _stale_shard(folder: Path) -> Planted:
    """The shard holding a trained tensor, left from the base checkpoint."""

    def check(corrupt: bool) -> Any:
        _dcp(_base(), folder / "dcp-base")
        _dcp(_trained(_base()), folder / "dcp-tuned")
        if corrupt:
            with DcpCheckpoint(folder / "dcp-tuned") as reader:
                shard = reader.sources("head.weight")[0].file
            shutil.copy(folder / "dcp-base" / shard, folder / "dcp-tuned" / shard)
        return certify(folder / "dcp-base", folder / "dcp-tuned", spec=_SPEC)

    return _both("stale shard", [("head.weight", "did not move")], check)


def _merge_scale_off(folder: Path) -> Planted:
    """A LoRA merged without its scale lora_alpha / r (= 2)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    base = {"q.weight": torch.randn(16, 8, generator=g).bfloat16()}
    base["k.weight"] = torch.randn(16, 8, generator=g).bfloat16()
    a = (0.3 * torch.randn(4, 8, generator=g)).bfloat16()
    b = (0.3 * torch.randn(16, 4, generator=g)).bfloat16()
    adapter = {"base_model.model.q.lora_A.weight": a, "base_model.model.q.lora_B.weight": b}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q"]}

    def check(corrupt: bool) -> Any:
        scale = 1.0 if corrupt else 2.0
        merged = {**base, "q.weight": base["q.weight"] + (b @ a) * scale}
        save_file(base, str(folder / "lora-base.safetensors"))
        save_file(merged, str(folder / "lora-merged.safetensors"))
        save_file(adapter, str(folder / "adapter_model.safetensors"))
        return certify(
            folder / "lora-base.safetensors",
            folder / "lora-merged.safetensors",
            adapter_config=config,
            adapter=folder / "adapter_model.safetensors",
        )

    return _both("merge scale off by alpha/r", [("q.weight", "merge off")], check)


def plant_all(folder: Path) -> list[Planted]:
    """Each corruption in a small pair written under ``folder``, certified clean and corrupted."""
    return [*_in_state_dicts(folder), _stale_shard(folder), _merge_scale_off(folder)]
