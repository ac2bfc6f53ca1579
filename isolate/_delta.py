"""How far a tensor moved, element by element: exact for integers, NaN-aware for floats, by
stored entry for sparse layouts (the arithmetic behind :mod:`isolate.drift`)."""

from __future__ import annotations

import torch

from isolate.fingerprints import local_tensor

__all__ = ["abs_difference", "moved_elements", "sparse_abs_difference", "to_coo"]


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
    """The stored entries of ``new - old`` for sparse tensors, as float64 magnitudes (nonzero
    wherever the two differ)."""
    a, b = _widen(to_coo(old)), _widen(to_coo(new))
    if a.dtype != b.dtype:
        a, b = a.to(torch.complex128), b.to(torch.complex128)
    values = (b - a).coalesce().values()
    return values.to(torch.complex128 if values.is_complex() else torch.float64).abs()


def moved_elements(old: torch.Tensor, new: torch.Tensor, atol: float) -> int:
    old, new = local_tensor(old), local_tensor(new).to(old.device)
    if old.layout != torch.strided or new.layout != torch.strided:
        return int((sparse_abs_difference(old, new) > atol).sum())
    return int((~(abs_difference(old, new) <= atol)).sum())
