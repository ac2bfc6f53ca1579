"""``certify()``: check every input, then make one streaming pass, then write the certificate."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from isolate._selectors import select_names
from isolate.certificates.certificate import Certificate, FileRecord, Verdict, versions
from isolate.certificates.checkpoint import WINDOW, Checkpoint
from isolate.certificates.claims import (
    BUFFERS,
    CALLER,
    Claim,
    load_spec,
    spec_claims,
    with_rows,
    with_ties,
)
from isolate.certificates.engine import Pass, run
from isolate.certificates.filehash import FileHash
from isolate.certificates.opening import open_checkpoint
from isolate.certificates.peft import LoraConfig, adapter_claims
from isolate.errors import CertificateError
from isolate.spec.data import SpecData

__all__ = ["certify"]


def _claims(
    base: Checkpoint,
    spec: SpecData | None,
    config: LoraConfig | None,
    adapter: Checkpoint | None,
    rows: Mapping[str, Sequence[int]] | None,
    buffers: Sequence[str],
) -> dict[str, Claim]:
    where = base.path.name
    if spec is not None and config is not None:
        raise CertificateError(
            f"{CALLER}: give spec= or adapter_config=, not both: a spec describes a training "
            f"run, an adapter config a merge"
        )
    if spec is not None:
        claims = spec_claims(spec, base.metas, buffers=buffers, where=where)
    elif config is not None:
        claims = adapter_claims(config, base.metas, adapter, buffers=buffers, where=where)
    else:
        claims = {k: Claim("free", "no claim") for k in base.metas}
    with_rows(claims, rows or {}, base.metas, where=where)
    return claims


def _check_pairs(base: Checkpoint, tuned: Checkpoint, ignored: frozenset[str]) -> None:
    """Every key in both files has one dtype and shape (else the comparison means nothing)."""
    for key, meta in base.metas.items():
        other = tuned.metas.get(key)
        if key in ignored or other is None or other == meta:
            continue
        what = "dtype" if other.dtype != meta.dtype else "shape"
        raise CertificateError(
            f"{base.where(key)} is {meta} but {tuned.where(key)} is {other}: the {what} "
            f"differs, so bits cannot be compared; compare checkpoints of one {what}, or "
            f"leave the key out with ignore="
        )


def _check_ignored(
    ignored: frozenset[str],
    names: Sequence[str],
    ignore: Sequence[str],
    rows: Mapping[str, Sequence[int]] | None,
    ties: Sequence[tuple[str, ...]],
    where: str,
) -> None:
    """Refuse an ``ignore=`` that leaves every key out, or a key that rows= or ties= name: a
    claim left out is never checked, and the certificate would pass it."""
    if names and ignored.issuperset(names):
        raise CertificateError(
            f"{CALLER}: ignore={list(ignore)} leaves out all {where}, so the certificate "
            f"would pass whatever the files hold; leave out fewer keys"
        )
    for option, keys in (("rows=", list(rows or {})), ("ties=", [k for t in ties for k in t])):
        for key in keys:
            if key in ignored:
                raise CertificateError(
                    f"{CALLER}: {option} names {key!r}, which ignore= leaves out, so that claim "
                    f"would never be checked; drop it from {option} or from ignore="
                )


def _check_ulps(ulps: object) -> None:
    """Refuse a merge tolerance that is not a finite number >= 0: a negative bound makes every
    error's ratio negative, an infinite one any error small, so every merge would pass."""
    if not isinstance(ulps, (int, float)) or isinstance(ulps, bool) or not 0 <= ulps < math.inf:
        raise CertificateError(
            f"{CALLER}: ulps must be a finite number >= 0 (the merge tolerance in units of the "
            f"dtype's rounding), got {ulps!r}"
        )


def _record(reader: Checkpoint) -> FileRecord:
    hashes = reader.file_hashes()
    return FileRecord(str(reader.path), reader.format, hashes, reader.group, tuple(reader.skipped))


def certify(
    base: str | Path,
    tuned: str | Path,
    *,
    spec: SpecData | Mapping[str, Any] | str | Path | None = None,
    adapter_config: LoraConfig | Mapping[str, Any] | str | Path | None = None,
    adapter: str | Path | None = None,
    rows: Mapping[str, Sequence[int]] | None = None,
    ties: Sequence[Sequence[str]] = (),
    detect_ties: bool = True,
    buffers: Sequence[str] = BUFFERS,
    ignore: Sequence[str] = (),
    key: str | None = "auto",
    prefix: str | None = None,
    ulps: float = 2.0,
    file_hash: FileHash = "xxh3",
    window: int = WINDOW,
) -> Certificate:
    """Certify what a run froze, trained, merged and tied, from two checkpoints alone.

    Reads ``base`` and ``tuned`` (safetensors files, ``torch.save`` files loaded
    weights-only, or torch.distributed.checkpoint folders) one tensor at a time, and checks
    each key against its claim: frozen tensors bitwise unchanged (per row where only rows
    train), trainable tensors moved, buffers held as the spec says, merged weights equal to
    base + LoRA delta within the dtype's rounding, tied tensors still tied, and no key
    missing, unexpected or renamed.

    Args:
        base: the checkpoint before (the base model, the first checkpoint of a run).
        tuned: the checkpoint after (fine-tuned, merged, or the last checkpoint).
        spec: an :class:`~isolate.spec.IsolationSpec`, its dict, or a JSON/YAML file of it.
            ``freeze`` selectors are matched against key names (``type:`` selectors need
            the model and are refused).
        adapter_config: a PEFT LoRA config (``adapter_config.json``, its folder or its dict),
            for a ``tuned`` model merged from that adapter. Not with ``spec``.
        adapter: the adapter's weights (``adapter_model.safetensors``): the merge is then
            checked value by value, and ``modules_to_save`` against the adapter's copies.
        rows: key -> the rows that train (``trainable_token_indices``): those rows must
            move, every other row stay bitwise.
        ties: groups of keys that must stay equal (``[["embed.weight", "head.weight"]]``).
        detect_ties: also treat keys bitwise equal in ``base`` as tied (tensors holding one
            value throughout, such as zero biases, are left out).
        buffers: globs of the keys that are buffers (not trained by a loss).
        ignore: selectors of keys to leave out (in both files).
        key: where the weights sit in each file: ``"auto"`` (a Lightning checkpoint's
            ``"state_dict"``, a distributed checkpoint's ``"model"``), a group name, or
            ``None`` for the top level.
        prefix: prefix the spec's selectors with this module name (a LightningModule that
            holds the spec's model as ``self.net``: ``prefix="net"``).
        ulps: the merge tolerance, in units of the dtype's rounding.
        file_hash: ``"xxh3"`` (XXH3-128, as ``xxhsum -H2``), ``"sha256"`` or ``"none"``.
        window: bytes read from one memory mapping before it is released.

    Returns:
        A :class:`~isolate.certificates.certificate.Certificate`; ``.clean`` says whether every
        claim holds.

    Raises:
        CertificateError: nothing to certify, a selector or row that names no key, a dtype
            or shape that differs between the files, an adapter that does not fit its base,
            an ``ignore`` that leaves out every key or a key that ``rows`` or ``ties`` name,
            a spec file that does not parse, ``ulps`` negative or not finite.
        CheckpointReadError: a file that is truncated, not weights-only, or not a checkpoint.
        SelectorError: a spec selector that matches no key, or a ``type:`` selector.

    >>> import tempfile, torch
    >>> folder = tempfile.TemporaryDirectory()
    >>> before = {"trunk.weight": torch.randn(4, 4), "head.weight": torch.randn(2, 4)}
    >>> after = {**before, "head.weight": before["head.weight"] + 0.1}
    >>> torch.save(before, f"{folder.name}/first.pt")
    >>> torch.save(after, f"{folder.name}/last.pt")
    >>> cert = certify(f"{folder.name}/first.pt", f"{folder.name}/last.pt",
    ...                spec={"freeze": ["trunk"]})
    >>> cert.clean, cert.summary()
    (True, ['trunk: 1 frozen, bitwise unchanged', 'head: 1 trainable, moved'])
    >>> folder.cleanup()
    """
    parsed_spec, config = _requested(spec, prefix, adapter_config, adapter, rows, ties)
    _check_ulps(ulps)
    with ExitStack() as stack:
        readers = [stack.enter_context(open_checkpoint(p, key=key)) for p in (base, tuned)]
        for reader in readers:
            reader.window = window
            reader.file_hash = file_hash
        lora = None if adapter is None else stack.enter_context(open_checkpoint(adapter, key=None))
        if lora is not None:
            lora.file_hash = file_hash
        first, second = readers
        names = list({**first.metas, **second.metas})
        where = f"the keys of {first.path.name} and {second.path.name}"
        ignored = frozenset(select_names(names, ignore, CALLER, where=where))
        claims = _claims(first, parsed_spec, config, lora, rows, buffers)
        declared = with_ties(ties, first.metas, where=first.path.name)
        _check_ignored(ignored, names, ignore, rows, declared, where)
        _check_pairs(first, second, ignored)
        job = Pass(first, second, claims, lora, declared, detect_ties, ulps, ignored)
        verdicts: list[Verdict] = run(job)
        with ThreadPoolExecutor(2) as pool:  # files not hashed during the pass: both at once
            records = list(pool.map(_record, readers))
        return Certificate(
            base=records[0],
            tuned=records[1],
            claims={
                "spec": None if parsed_spec is None else parsed_spec.to_dict(),
                "adapter_config": None if config is None else dict(config.raw),
                "rows": {k: list(v) for k, v in (rows or {}).items()},
                "ties": [list(t) for t in declared],
                "detect_ties": detect_ties,
                "buffers": list(buffers),
                "ignore": list(ignore),
                "key": key,
                "prefix": prefix,
            },
            tolerances=_tolerances(ulps),
            verdicts=tuple(verdicts),
            versions=versions(),
            adapter=None if lora is None else _record(lora),
            notes=tuple(_unreferenced(second)),
        )


def _requested(
    spec: SpecData | Mapping[str, Any] | str | Path | None,
    prefix: str | None,
    adapter_config: LoraConfig | Mapping[str, Any] | str | Path | None,
    adapter: str | Path | None,
    rows: Mapping[str, Sequence[int]] | None,
    ties: Sequence[Sequence[str]],
) -> tuple[SpecData | None, LoraConfig | None]:
    """The spec (prefixed) and the adapter config :func:`certify` checks against, or the error
    that says which claim is missing."""
    parsed_spec = None if spec is None else load_spec(spec)
    if parsed_spec is not None and prefix:
        parsed_spec = parsed_spec.prefixed(prefix)
    config = None if adapter_config is None else LoraConfig.load(adapter_config)
    if adapter is not None and config is None:
        raise CertificateError(
            f"{CALLER}: adapter= needs adapter_config= (its r, lora_alpha and target_modules "
            f"give the merge's scale)"
        )
    if parsed_spec is None and config is None and not rows and not ties:
        raise CertificateError(
            f"{CALLER}: nothing to certify: give spec=, adapter_config=, rows= or ties= (a "
            f"certificate without claims would pass whatever the files hold)"
        )
    return parsed_spec, config


def _tolerances(ulps: float) -> dict[str, Any]:
    return {
        "frozen": "bitwise (XXH3-128 fingerprints of dtype, shape and bytes)",
        "merge_ulps": ulps,
        "merge_rule": "|merged - (W + s*B@A)| <= ulps*eps(dtype)*(|W + s*B@A| + s*|B|@|A|)",
    }


def _unreferenced(reader: Checkpoint) -> list[str]:
    return [
        f"{name} in {reader.path.name} is not referenced by its index (left by another save?)"
        for name in reader.unreferenced()
    ]
