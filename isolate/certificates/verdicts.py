"""The verdict on one key, given its claim and both tensors (already fingerprinted)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from isolate.certificates.certificate import Verdict
from isolate.certificates.checkpoint import Checkpoint, Source
from isolate.certificates.claims import Claim
from isolate.certificates.compare import as_bits, diff_rows, rows_in
from isolate.certificates.merge import check_merge
from isolate.fingerprints import fingerprint

__all__ = ["Pair", "judge"]


@dataclass
class Pair:
    """One key of both checkpoints: its fingerprints, and its tensors when a verdict needs
    their values (read on first use)."""

    key: str
    claim: Claim
    base_reader: Checkpoint
    tuned_reader: Checkpoint
    base_print: int
    tuned_print: int
    adapter: Checkpoint | None
    ulps: float

    @cached_property
    def base(self) -> torch.Tensor:
        return self.base_reader.read(self.key)

    @cached_property
    def tuned(self) -> torch.Tensor:
        return self.tuned_reader.read(self.key)

    @property
    def sources(self) -> list[Source]:
        """Where the tuned checkpoint stores the parts of the tensor."""
        return self.tuned_reader.sources(self.key)

    @property
    def folder(self) -> bool:
        """Whether the tuned checkpoint is a folder of shard files."""
        return self.tuned_reader.path.is_dir()

    @property
    def moved(self) -> bool:
        return self.base_print != self.tuned_print

    def verdict(self, ok: bool | None, finding: str, detail: str = "") -> Verdict:
        return Verdict(
            key=self.key,
            claim=self.claim.kind,
            ok=ok,
            finding=finding,
            detail=detail,
            source=self.claim.source,
            meta=str(self.base_reader.metas[self.key]),
            base=f"{self.base_print:032x}",
            tuned=f"{self.tuned_print:032x}",
        )

    def files_of(self, rows: list[int]) -> str:
        """``"in ['__1_0.distcp']"``: the shard files of a folder checkpoint that hold ``rows``."""
        if not self.folder or not self.tuned_reader.metas[self.key].shape:
            return ""
        spans = [(s.file, s.offsets[0], s.sizes[0]) for s in self.sources]
        return f"in {rows_in(rows, spans)}"


def _unchanged(pair: Pair) -> Verdict:
    if not pair.moved:
        return pair.verdict(True, "bitwise unchanged")
    diff = diff_rows(pair.base, pair.tuned)
    return pair.verdict(False, "changed", diff.describe(pair.files_of(diff.first(1000))))


def _box(t: torch.Tensor, source: Source) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(source.offsets, source.sizes, strict=True)):
        t = t.narrow(dim, start, size)
    return t


def _changed(pair: Pair) -> Verdict:
    if not pair.moved:
        files = sorted({s.file for s in pair.sources})
        where = f" (stored in {files})" if pair.folder else ""
        return pair.verdict(False, "did not move", f"declared trainable, bitwise unchanged{where}")
    if len(pair.sources) > 1:
        stale = [
            s
            for s in pair.sources
            if torch.equal(as_bits(_box(pair.base, s)), as_bits(_box(pair.tuned, s)))
        ]
        if stale:
            parts = ", ".join(f"{s.file} at {list(s.offsets)}" for s in stale)
            return pair.verdict(
                False,
                "part did not move",
                f"{len(stale)} of {len(pair.sources)} stored parts are bitwise the base's "
                f"while the others moved: a stale shard? ({parts})",
            )
    return pair.verdict(True, "moved")


def _free(pair: Pair) -> Verdict:
    return pair.verdict(None, "moved" if pair.moved else "bitwise unchanged")


def _rows(pair: Pair) -> Verdict:
    diff = diff_rows(pair.base, pair.tuned)
    trainable = torch.zeros(diff.rows, dtype=torch.bool)
    trainable[list(pair.claim.rows)] = True
    leaked = (diff.changed & ~trainable).nonzero().flatten().tolist()
    still = (trainable & ~diff.changed).nonzero().flatten().tolist()
    if not leaked and not still:
        return pair.verdict(True, f"{len(pair.claim.rows)} rows moved, the others unchanged")
    parts = []
    if leaked:
        where = pair.files_of(leaked)
        parts.append(
            f"{len(leaked)} frozen rows changed (rows {leaked[:5]})" + f" {where}" * bool(where)
        )
    if still:
        parts.append(f"{len(still)} trainable rows did not move (rows {still[:5]})")
    return pair.verdict(False, "rows broken", "; ".join(parts))


def _merged(pair: Pair) -> Verdict:
    delta, adapter = pair.claim.lora, pair.adapter
    assert delta is not None and adapter is not None  # set together by adapter_claims
    a, b = adapter.read(delta.a_key), adapter.read(delta.b_key)
    if not bool(as_bits(b).any()) and b.is_floating_point():
        return pair.verdict(
            False, "adapter never trained", f"{delta.b_key} is all zeros (LoRA starts B at 0)"
        )
    check = check_merge(
        pair.base, pair.tuned, a, b, scale=delta.scale, transposed=delta.transposed, ulps=pair.ulps
    )
    return pair.verdict(
        check.ok, "merged" if check.ok else "merge off", check.describe(delta.scale)
    )


def _saved(pair: Pair) -> Verdict:
    adapter, key = pair.adapter, pair.claim.saved
    assert adapter is not None and key is not None  # set together by adapter_claims
    copy = adapter.read(key)
    cast = "" if copy.dtype == pair.tuned.dtype else f" (cast from {copy.dtype})"
    if fingerprint(copy.to(pair.tuned.dtype)) == pair.tuned_print:
        return pair.verdict(True, "the adapter's copy", f"bitwise{cast}")
    diff = diff_rows(copy.to(pair.tuned.dtype), pair.tuned)
    detail = f"differs from {key} in {adapter.path.name}{cast}: {diff.describe()}"
    if not pair.moved:
        detail += "; it is the base's: the trained copy was dropped at merge"
    return pair.verdict(False, "not the adapter's copy", detail)


JUDGES: dict[str, Callable[[Pair], Verdict]] = {
    "frozen": _unchanged,
    "held": _unchanged,
    "trainable": _changed,
    "free": _free,
    "rows": _rows,
    "merged": _merged,
    "saved": _saved,
}


def judge(pair: Pair) -> Verdict:
    """The verdict on ``pair`` under its claim."""
    return JUDGES[pair.claim.kind](pair)
