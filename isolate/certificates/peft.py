"""Claims from a PEFT LoRA adapter config (``adapter_config.json``), with no model.

A model merged from a LoRA adapter keeps every base tensor bitwise, except each targeted
weight, which becomes ``W + scale * B @ A`` (``scale = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``; ``alpha_pattern`` overrides ``lora_alpha`` per
module); the modules in ``modules_to_save`` are replaced by the adapter's trained copies, and
the rows in ``trainable_token_indices`` are trained. With the adapter's weights, the targets
are read from its keys and the merge is checked value by value; with the config alone, a
targeted weight is only required to have moved.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isolate._selectors import select_names
from isolate.certificates.checkpoint import Checkpoint, TensorMeta
from isolate.certificates.claims import BUFFERS, CALLER, Claim, LoraDelta, closest, with_rows
from isolate.errors import CertificateError

__all__ = ["LoraConfig", "LoraDelta", "adapter_claims"]

PREFIX = "base_model.model."  # PEFT's prefix for the wrapped model's keys
_PAIRS = (
    (".lora_A.weight", ".lora_B.weight", False),
    (".lora_embedding_A", ".lora_embedding_B", True),
)


@dataclass(frozen=True)
class LoraConfig:
    """The fields of a PEFT LoRA ``adapter_config.json`` that decide what a merge changes."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None = None
    modules_to_save: tuple[str, ...] = ()
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    trainable_token_indices: Sequence[int] | Mapping[str, Sequence[int]] | None = None
    bias: str = "none"
    raw: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, config: object) -> LoraConfig:
        """From a path to ``adapter_config.json`` (or its folder), or its dict."""
        if isinstance(config, LoraConfig):
            return config
        if isinstance(config, (str, Path)):
            path = Path(config)
            path = path / "adapter_config.json" if path.is_dir() else path
            try:
                config = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise CertificateError(
                    f"{CALLER}: cannot read the adapter config {path.name}: {error}"
                ) from None
        if not isinstance(config, Mapping):
            raise CertificateError(
                f"{CALLER}: adapter_config must be a path or a dict, got {type(config).__name__}"
            )
        kind = str(config.get("peft_type", "LORA")).upper()
        if kind != "LORA" or config.get("use_dora"):
            raise CertificateError(
                f"{CALLER}: adapter_config is {'DoRA' if config.get('use_dora') else kind}; "
                f"certify checks LoRA merges only"
            )
        r, alpha = config.get("r"), config.get("lora_alpha")
        if not (isinstance(r, int) and r > 0 and isinstance(alpha, (int, float))):
            raise CertificateError(
                f"{CALLER}: adapter_config needs r > 0 and lora_alpha, got r={r!r}, "
                f"lora_alpha={alpha!r}"
            )
        targets = config.get("target_modules")
        return cls(
            r=r,
            lora_alpha=float(alpha),
            target_modules=targets
            if isinstance(targets, str) or targets is None
            else tuple(targets),
            modules_to_save=tuple(config.get("modules_to_save") or ()),
            use_rslora=bool(config.get("use_rslora", False)),
            fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
            alpha_pattern=dict(config.get("alpha_pattern") or {}),
            trainable_token_indices=config.get("trainable_token_indices"),
            bias=str(config.get("bias", "none")),
            raw=dict(config),
        )

    def alpha(self, module: str) -> float:
        """``lora_alpha``, or the ``alpha_pattern`` entry that matches ``module`` (PEFT's rule:
        the pattern matches the module name's end at a dot)."""
        for pattern, value in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                return float(value)
        return self.lora_alpha

    def scale(self, module: str, rank: int) -> float:
        return self.alpha(module) / (math.sqrt(rank) if self.use_rslora else rank)

    def targets(self, module: str) -> bool:
        """Whether ``target_modules`` names ``module`` (a regex on the whole name, or names
        matched at the end of the module name)."""
        if self.target_modules is None:
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)


def _shown(targets: tuple[str, ...] | str | None) -> str:
    return repr(list(targets) if isinstance(targets, tuple) else targets)


def _module_keys(names: Sequence[str], module: str, what: str, where: str) -> list[str]:
    """The keys under the modules whose names end in ``module`` (``lm_head`` names
    ``model.lm_head``), as PEFT matches ``modules_to_save``; none is an error."""
    found = [k for k in names if f".{module}." in f".{k}"]
    if not found:
        raise CertificateError(
            f"{CALLER}: {what} names {module!r}, not a module of {where}" + closest(module, names)
        )
    return found


def _deltas(
    config: LoraConfig, metas: Mapping[str, TensorMeta], adapter: Checkpoint
) -> dict[str, LoraDelta]:
    """The merged weight of each A/B pair of the adapter, checked to fit its base weight."""
    out: dict[str, LoraDelta] = {}
    for a_key, a_meta in adapter.metas.items():
        for a_end, b_end, embedding in _PAIRS:
            if not a_key.endswith(a_end):
                continue
            module = a_key[: -len(a_end)]
            b_key = module + b_end
            module = module.removeprefix(PREFIX)
            weight = module + ".weight"
            if weight not in metas or b_key not in adapter.metas:
                missing = weight if weight not in metas else b_key
                raise CertificateError(
                    f"{CALLER}: adapter key {a_key!r} has no {missing!r} to go with it"
                    + closest(missing, metas if missing == weight else adapter.metas)
                )
            b_meta, w_meta = adapter.metas[b_key], metas[weight]
            transposed = embedding or config.fan_in_fan_out
            rank = a_meta.shape[0] if a_meta.shape else 0
            if len(a_meta.shape) != 2 or len(b_meta.shape) != 2:
                raise CertificateError(
                    f"{CALLER}: adapter {a_key!r} is {a_meta}: only 2-D LoRA factors (linear, "
                    f"embedding) can be checked, not convolutions"
                )
            fits = (b_meta.shape[0], a_meta.shape[1])
            fits = fits[::-1] if transposed else fits
            if fits != w_meta.shape or b_meta.shape[1] != rank:
                raise CertificateError(
                    f"{CALLER}: adapter {a_key!r} {a_meta} and {b_key!r} {b_meta} do not fit "
                    f"the base weight {weight!r} {w_meta}; is this the adapter of this base?"
                )
            scale = config.scale(module, rank)
            out[weight] = LoraDelta(a_key, b_key, scale, config.alpha(module), rank, transposed)
    return out


def adapter_claims(
    config: LoraConfig,
    metas: Mapping[str, TensorMeta],
    adapter: Checkpoint | None,
    *,
    buffers: Sequence[str] = BUFFERS,
    where: str,
) -> dict[str, Claim]:
    """One claim per key of the base ``metas`` for a model merged from this adapter."""
    names = list(metas)
    declared = set(select_names(names, buffers, CALLER, each_must_match=False))
    claims = {
        k: Claim(
            "held"
            if k in declared or not (m.dtype.is_floating_point or m.dtype.is_complex)
            else "frozen",
            "not in the adapter",
        )
        for k, m in metas.items()
    }
    claims.update(
        _merged(config, metas, adapter)
        if adapter is not None
        else _targeted(config, metas, where=where)
    )
    saved_keys = [
        k for m in config.modules_to_save for k in _module_keys(names, m, "modules_to_save", where)
    ]
    for key in saved_keys:
        if key in declared:
            continue
        saved = PREFIX + key
        if adapter is not None and saved in adapter.metas:
            copy = adapter.metas[saved]
            if copy.shape != metas[key].shape:  # a dtype may differ: the copy is cast
                raise CertificateError(
                    f"{CALLER}: adapter key {saved!r} {copy} does not fit the base weight "
                    f"{key!r} {metas[key]} it is saved for (modules_to_save); is this the "
                    f"adapter of this base?"
                )
            claims[key] = Claim("saved", "modules_to_save", saved=saved)
        else:
            claims[key] = Claim("trainable", "modules_to_save (adapter weights not given)")
    if config.bias != "none":
        for key in select_names(names, ["*.bias"], CALLER, each_must_match=False):
            claims[key] = Claim("free", f"adapter config bias={config.bias!r}")
    tokens = config.trainable_token_indices
    if tokens is not None:
        by_module = tokens if isinstance(tokens, Mapping) else {"embed_tokens": tokens}
        rows = {}
        for module, indices in by_module.items():
            keys = _module_keys(names, module, "trainable_token_indices", where)
            rows.update({k: indices for k in keys if k.endswith(".weight")})
        with_rows(claims, rows, metas, where=where)
    return claims


def _merged(
    config: LoraConfig, metas: Mapping[str, TensorMeta], adapter: Checkpoint
) -> dict[str, Claim]:
    """The claims of the base weights the adapter's LoRA factors merge into."""
    deltas = _deltas(config, metas, adapter)
    if not deltas:
        raise CertificateError(
            f"{CALLER}: the adapter {adapter.path.name} holds no LoRA factors (keys ending "
            f"'.lora_A.weight'); its keys start {list(adapter.metas)[:3]}"
        )
    claims = {}
    for key, delta in deltas.items():
        rank = f"sqrt({delta.rank})" if config.use_rslora else str(delta.rank)
        claims[key] = Claim("merged", f"LoRA merge, scale {delta.alpha:g}/{rank}", lora=delta)
    return claims


def _targeted(
    config: LoraConfig, metas: Mapping[str, TensorMeta], *, where: str
) -> dict[str, Claim]:
    """The claims of the weights ``target_modules`` names, when no adapter weights are given."""
    modules = sorted({k.rpartition(".")[0] for k in metas})
    targeted = [m + ".weight" for m in modules if config.targets(m) and m + ".weight" in metas]
    if not targeted:
        raise CertificateError(
            f"{CALLER}: target_modules {_shown(config.target_modules)} names no module of "
            f"{where} "
            f"that has a weight; give the adapter's weights (adapter=) so its keys decide"
        )
    return {
        key: Claim("trainable", "LoRA target, merged (adapter weights not given)")
        for key in targeted
    }
