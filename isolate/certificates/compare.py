"""Bit-level comparisons of two tensors, a block of rows at a time: which rows differ, by how
much, and whether a tensor holds one value throughout.

They run only where fingerprints already disagree (or where a claim is about rows), and read
both tensors in blocks of about ``_BLOCK`` bytes, so that their temporaries stay small.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["RowDiff", "as_bits", "diff_rows", "is_constant", "row_blocks", "rows_in"]

_BLOCK = 8 << 20
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its width (a view, no copy): equal bits, equal ints."""
    if t.dtype.itemsize == 16:  # complex128: two float64 words per element
        t = torch.view_as_real(t)
    return t.view(_INTS[t.dtype.itemsize])  # every other width is 1, 2, 4 or 8 bytes


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1) if t.dim() == 0 else t


def row_blocks(t: torch.Tensor) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` ranges of rows (dimension 0) of about ``_BLOCK`` bytes each."""
    rows = _rows(t)
    per_row = max(1, rows[0].numel() * t.dtype.itemsize) if rows.shape[0] else 1
    step = max(1, _BLOCK // per_row)
    for start in range(0, rows.shape[0], step):
        yield start, min(start + step, rows.shape[0])


@dataclass(frozen=True)
class RowDiff:
    """Which rows of two equally shaped tensors differ in any bit."""

    rows: int
    changed: torch.Tensor  # bool per row
    elements: int
    max_abs: float | None  # None for integer dtypes

    @property
    def count(self) -> int:
        return int(self.changed.sum())

    def first(self, limit: int = 5) -> list[int]:
        return [int(i) for i in self.changed.nonzero().flatten()[:limit]]

    def describe(self, where: str = "") -> str:
        """``"2 of 64 rows differ (rows [3, 9]), 5 elements, max |diff| 0.25"``."""
        if not self.count:
            return "no row differs"
        shown = self.first()
        more = ", ..." if self.count > len(shown) else ""
        text = f"{self.count} of {self.rows} rows differ (rows {str(shown)[:-1]}{more}]), "
        text += f"{self.elements} element{'s' * (self.elements != 1)}"
        if self.max_abs is not None:
            text += f", max |diff| {self.max_abs:.4g}"
        return text + (f" {where}" if where else "")


def diff_rows(a: torch.Tensor, b: torch.Tensor) -> RowDiff:
    """Which rows of ``a`` and ``b`` (same dtype and shape) differ, and by how much."""
    ra, rb = _rows(a), _rows(b)
    changed = torch.zeros(ra.shape[0], dtype=torch.bool)
    elements = 0
    max_abs: float | None = None
    floating = a.is_floating_point() or a.is_complex()
    for start, stop in row_blocks(a):
        x, y = ra[start:stop], rb[start:stop]
        ne = as_bits(x) != as_bits(y)
        if ne.dim() > x.dim():  # complex128: an element differs where either of its words does
            ne = ne.any(-1)
        ne = ne.reshape(stop - start, -1)
        changed[start:stop] = ne.any(1)
        count = int(ne.sum())
        elements += count
        if count and floating:
            # Both sides widened: float8 types promote with no other dtype.
            wide = torch.complex128 if a.is_complex() else torch.float64
            gap = (x.to(wide) - y.to(wide)).abs()
            top = float(gap[ne.reshape(gap.shape)].nan_to_num(nan=float("inf")).max())
            max_abs = top if max_abs is None else max(max_abs, top)
    return RowDiff(ra.shape[0], changed, elements, max_abs)


def is_constant(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` has the bits of its first (an initial bias, a norm)."""
    if t.numel() <= 1:
        return True
    bits = as_bits(t)
    first = bits[(0,) * t.dim()]  # both words of a complex128
    rows = _rows(bits)
    return all(bool((rows[s:e] == first).all()) for s, e in row_blocks(t))


def rows_in(rows: Sequence[int], sources: Sequence[tuple[str, int, int]]) -> list[str]:
    """The files among ``sources`` (``(file, first row, row count)``) that hold ``rows``."""
    files = []
    for file, start, count in sources:
        if any(start <= r < start + count for r in rows) and file not in files:
            files.append(file)
    return files
