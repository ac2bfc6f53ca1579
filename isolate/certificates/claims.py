"""What a certificate claims about each key, resolved once from a spec, rows and ties.

An :class:`~isolate.spec.IsolationSpec`'s ``freeze`` selectors are matched against the
checkpoint's key names (no model): a frozen parameter must be bitwise unchanged; a parameter
the spec does not freeze must have moved; a thawed one may have; BatchNorm statistics under
the frozen part must be held when the spec holds them in eval mode (``bn="eval"`` unless
``mode`` says otherwise). Which keys are buffers cannot be read from a state dict, so it is
declared: ``buffers`` globs (by default BatchNorm's running statistics), and every tensor
that is not floating point (autograd cannot train it).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from isolate._selectors import select_names
from isolate.errors import CertificateError
from isolate.spec.data import SpecData

if TYPE_CHECKING:
    from isolate.certificates.checkpoint import TensorMeta

__all__ = [
    "BUFFERS",
    "Claim",
    "LoraDelta",
    "closest",
    "load_spec",
    "spec_claims",
    "with_rows",
    "with_ties",
]

Kind = Literal["frozen", "trainable", "held", "free", "merged", "saved", "rows"]

BUFFERS = ("*.running_mean", "*.running_var", "*.num_batches_tracked")
"""The keys taken for buffers by default: BatchNorm's running statistics and step counter."""

CALLER = "certify()"


@dataclass(frozen=True)
class LoraDelta:
    """One merged weight: ``scale * B @ A`` from the adapter's keys (transposed for
    ``fan_in_fan_out`` layers and embeddings)."""

    a_key: str
    b_key: str
    scale: float
    alpha: float
    rank: int
    transposed: bool


@dataclass(frozen=True)
class Claim:
    """What must hold for one key between the base and the tuned checkpoint.

    ``frozen`` / ``held``: bitwise unchanged (a parameter / a buffer); ``trainable``: changed;
    ``free``: either (reported, not judged); ``rows``: the listed rows changed, every other
    row bitwise unchanged; ``merged``: the base plus a LoRA delta within the dtype's rounding;
    ``saved``: bitwise the adapter's own copy (PEFT's ``modules_to_save``).
    """

    kind: Kind
    source: str
    rows: tuple[int, ...] = ()
    lora: LoraDelta | None = None
    saved: str | None = None


def closest(name: str, names: Collection[str]) -> str:
    """``"; closest: ['a', 'b']"`` for an error message, or ``""``."""
    found = difflib.get_close_matches(name, list(names), n=3, cutoff=0.5)
    return f"; closest: {found}" if found else ""


def load_spec(spec: object) -> SpecData:
    """A spec (an :class:`~isolate.spec.IsolationSpec`) from itself, its dict, or a JSON /
    YAML file of the dict."""
    if isinstance(spec, SpecData):
        return spec
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        if not path.is_file():
            raise CertificateError(f"{CALLER}: spec file {str(path)!r} does not exist")
        spec = _parse(path)
    if isinstance(spec, Mapping):
        return SpecData.from_dict(spec)
    raise CertificateError(
        f"{CALLER}: spec must be an IsolationSpec, its dict, or a JSON/YAML file of it; got "
        f"{type(spec).__name__}"
    )


def _parse(path: Path) -> Any:
    """The data of a JSON or YAML spec file, or the error that says why it cannot be read."""
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            return json.loads(text)
    except UnicodeDecodeError:
        raise CertificateError(
            f"{CALLER}: cannot read the spec {path.name}: not UTF-8 text"
        ) from None
    except (OSError, json.JSONDecodeError) as error:
        raise CertificateError(f"{CALLER}: cannot read the spec {path.name}: {error}") from None
    try:
        import yaml
    except ImportError:
        raise CertificateError(
            f"{CALLER}: reading the YAML spec {path.name} needs PyYAML (pip install "
            f"pyyaml), or give the spec as JSON"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        why = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise CertificateError(f"{CALLER}: cannot read the spec {path.name}: {why}{at}") from None


def _is_float(meta: TensorMeta) -> bool:
    return meta.dtype.is_floating_point or meta.dtype.is_complex


def _held_modules(metas: Mapping[str, TensorMeta], buffers: set[str], frozen: set[str]) -> set[str]:
    """The modules that have parameters, all of them frozen (their buffers are covered)."""
    params: dict[str, list[str]] = {}
    for key, meta in metas.items():
        if key not in buffers and _is_float(meta):
            params.setdefault(key.rpartition(".")[0], []).append(key)
    return {m for m, keys in params.items() if all(k in frozen for k in keys)}


def spec_claims(
    spec: SpecData,
    metas: Mapping[str, TensorMeta],
    *,
    buffers: Sequence[str] = BUFFERS,
    where: str,
) -> dict[str, Claim]:
    """One claim per key of ``metas`` from the spec's ``freeze``, ``thaw`` and ``bn``."""
    names = list(metas)
    what = f"the keys of {where}"
    frozen = set(select_names(names, spec.freeze, CALLER, where=what))
    thawed: dict[str, str] = {}
    for step in spec.thaw:
        for key in select_names(names, step.selectors, CALLER, where=what):
            thawed.setdefault(key, f"thawed by the spec ({step.name} at {step.when})")
    declared = set(select_names(names, buffers, CALLER, where=what, each_must_match=False))
    held = _held_modules(metas, declared, frozen)
    # mode, when given, overrides bn for the frozen part's layers, as the engine applies it
    policy = f"mode={spec.mode!r}" if spec.mode else f"bn={spec.bn!r}"
    claims: dict[str, Claim] = {}
    for key, meta in metas.items():
        if key in declared or not _is_float(meta):
            covered = key in frozen or key.rpartition(".")[0] in held
            if covered and key in declared and spec.policy == "train":
                claims[key] = Claim("free", f"spec {policy}: statistics of frozen layers update")
            elif covered:
                claims[key] = Claim("held", f"buffer of the frozen part (spec {policy})")
            else:
                claims[key] = Claim("free", "buffer outside the frozen part")
        elif key in thawed:
            claims[key] = Claim("free", thawed[key])
        elif key in frozen:
            claims[key] = Claim("frozen", "frozen by the spec")
        else:
            claims[key] = Claim("trainable", "not frozen by the spec")
    return claims


def with_rows(
    claims: dict[str, Claim],
    rows: Mapping[str, Sequence[int]],
    metas: Mapping[str, TensorMeta],
    *,
    where: str,
) -> None:
    """Make each key of ``rows`` a per-row claim: its listed rows train, the others stay."""
    for key, listed in rows.items():
        if key not in metas:
            raise CertificateError(
                f"{CALLER}: rows= names {key!r}, not a key of {where}" + closest(key, metas)
            )
        meta = metas[key]
        if not meta.shape or not _is_float(meta):
            raise CertificateError(
                f"{CALLER}: rows= names {key!r} of {where}, a {meta} tensor; per-row claims need "
                f"a floating-point tensor with rows"
            )
        indices = sorted({int(i) for i in listed})
        bad = [i for i in indices if not 0 <= i < meta.shape[0]]
        if not indices or bad:
            raise CertificateError(
                f"{CALLER}: rows= for {key!r} must list row indices in [0, {meta.shape[0]}); "
                f"got {list(listed)[:8]}"
            )
        claims[key] = Claim("rows", "trainable rows", rows=tuple(indices))


def with_ties(
    ties: Sequence[Sequence[str]], metas: Mapping[str, TensorMeta], *, where: str
) -> list[tuple[str, ...]]:
    """Validated groups of keys declared tied: each names at least two keys of equal meta."""
    groups = []
    for group in ties:
        keys = tuple(group)
        if isinstance(group, str) or len(set(keys)) < 2:
            raise CertificateError(
                f"{CALLER}: a tie is a list of at least two keys, got {group!r}, e.g. "
                f"['embed.weight', 'head.weight']"
            )
        for key in keys:
            if key not in metas:
                raise CertificateError(
                    f"{CALLER}: tie {list(keys)} names {key!r}, not a key of {where}"
                    + closest(key, metas)
                )
        shown = {str(metas[k]) for k in keys}
        if len(shown) > 1:
            raise CertificateError(
                f"{CALLER}: tie {list(keys)} joins tensors of different dtype or shape in "
                f"{where}: {[str(metas[k]) for k in keys]}; tied tensors are one tensor"
            )
        groups.append(keys)
    return groups
