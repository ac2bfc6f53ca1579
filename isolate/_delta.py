"""How far a tensor moved, element by element: exact for integers, NaN-aware for floats, by
stored entry for sparse layouts (the arithmetic behind :mod:`isolate.drift`)."""

from __future__ import annotations

import math

import torch

from isolate.fingerprints import local_tensor

__all__ = ["abs_difference", "max_abs_diff", "moved_elements", "sparse_abs_difference", "to_coo"]


def to_coo(t: torch.Tensor) -> torch.Tensor:
    t = local_tensor(t)
    if t.layout != torch.sparse_coo:
        t = t.to_sparse()  # CSR/CSC/BSR/BSC and dense alike
    return t.coalesce()


def _widen(t: torch.Tensor) -> torch.Tensor:
    if not (t.is_floating_point() or t.is_complex()):
        return t.to(torch.int64)  # float64 would round 2**61 - 1 and 2**61 - 2 alike
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def abs_difference(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """|new - old| per element in float64, zero exactly where the two are equal (NaN in both
    places counts as equal). Integers are subtracted as integers."""
    a, b = _widen(old), _widen(new)
    if a.dtype == b.dtype == torch.int64:
        d = b - a  # wraps modulo 2**64 when |b - a| >= 2**63
        size = d.to(torch.float64).abs()
        return torch.where((d < 0) != (b < a), 2.0**64 - size, size)
    if a.dtype != b.dtype:
        a, b = a.to(torch.complex128), b.to(torch.complex128)
    diff = (b - a).abs()
    both_nan = a.isnan() & b.isnan()
    return diff.masked_fill(both_nan, 0.0) if bool(both_nan.any()) else diff


def sparse_abs_difference(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """|new - old| at every entry stored on either side, as :func:`abs_difference` has it
    (float64, integers exact, NaN in both places equal)."""
    a, b = _widen(to_coo(old)), _widen(to_coo(new))
    if a.dense_dim() != b.dense_dim():  # a hybrid tensor against another layout
        a, b = (t.to_dense().to_sparse().coalesce() if t.dense_dim() else t for t in (a, b))
    # Both sides on the union of their patterns, so the entries line up for abs_difference.
    union = (_pattern(a) + _pattern(b)).coalesce()
    return abs_difference(a.sparse_mask(union).values(), b.sparse_mask(union).values())


def _pattern(t: torch.Tensor) -> torch.Tensor:
    ones = torch.ones_like(t.values(), dtype=torch.int8)
    return torch.sparse_coo_tensor(
        t.indices(), ones, t.shape, is_coalesced=True, check_invariants=False
    )


def moved_elements(old: torch.Tensor, new: torch.Tensor, atol: float) -> int:
    old, new = local_tensor(old), local_tensor(new).to(old.device)
    sparse = old.layout != torch.strided or new.layout != torch.strided
    diff = sparse_abs_difference(old, new) if sparse else abs_difference(old, new)
    return int((~(diff <= atol)).sum())  # NaN on one side only is a move


def max_abs_diff(old: torch.Tensor, new: torch.Tensor) -> float:
    """Max |new - old| over elements; NaN in both places counts as equal, ``inf`` on shape change.

    Integer and bool tensors are subtracted as integers (exactly: ``num_batches_tracked``
    steps by 1.0, and a change of 1 in ``2**61`` is a change) and reported as a float.
    Sparse tensors (any layout) compare their stored entries; an entry present on one side
    only counts against zero.

    >>> max_abs_diff(torch.tensor([2**61 - 1]), torch.tensor([2**61 - 2]))
    1.0
    """
    old, new = local_tensor(old), local_tensor(new)
    if old.shape != new.shape:
        return math.inf
    if old.layout != torch.strided or new.layout != torch.strided:
        a, b = to_coo(old), to_coo(new.to(old.device))
        if a.indices().shape == b.indices().shape and torch.equal(a.indices(), b.indices()):
            return max_abs_diff(a.values(), b.values())
        moved = sparse_abs_difference(a, b)
        return float(moved.max()) if moved.numel() else 0.0
    if old.numel() == 0:
        return 0.0
    new = new.to(old.device)
    if torch.equal(old, new):
        return 0.0
    return float(abs_difference(old, new).max())
