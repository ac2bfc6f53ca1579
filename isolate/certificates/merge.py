"""Whether a merged weight is its base plus ``scale * B @ A`` within the dtype's rounding.

The exact value ``W + scale * B @ A`` is computed in float64 a block of rows at a time, and
each merged element must lie within ``ulps * eps * (|exact| + scale * (|B| @ |A|))`` of it
(``eps`` the dtype's machine epsilon): a merge done in the weight's own dtype rounds the
product (by at most a unit of the sum of its terms' magnitudes, whatever cancels), then the
sum, by at most half a unit of the result. The scale that best explains the merged weight (least
squares) is reported, so a merge done with the wrong ``lora_alpha / r`` is named with the
scale it used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isolate.certificates.compare import row_blocks

__all__ = ["MergeCheck", "check_merge"]


@dataclass(frozen=True)
class MergeCheck:
    """The outcome of :func:`check_merge`."""

    ok: bool
    rows: int
    bad_rows: list[int]
    bad_count: int
    fitted_scale: float | None
    worst: float  # the largest error, in units of the allowed error

    def describe(self, scale: float) -> str:
        fitted = "n/a" if self.fitted_scale is None else f"{self.fitted_scale:.4g}"
        if self.ok:
            return f"base + {scale:.4g} x B@A within rounding (fitted scale {fitted})"
        return (
            f"not base + {scale:.4g} x B@A: {self.bad_count} of {self.rows} rows outside "
            f"the dtype's rounding (rows {self.bad_rows[:5]}, worst {self.worst:.3g}x the "
            f"allowed error); the merged weight fits base + {fitted} x B@A"
        )


def check_merge(
    base: torch.Tensor,
    merged: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    scale: float,
    transposed: bool,
    ulps: float,
) -> MergeCheck:
    """Compare ``merged`` with ``base + scale * B @ A`` (``(B @ A).T`` if ``transposed``)."""
    left = (a.t() if transposed else b).to(torch.float64)  # rows of the delta
    right = (b.t() if transposed else a).to(torch.float64)
    eps = torch.finfo(merged.dtype).eps if merged.dtype.is_floating_point else 0.0
    tiny = torch.finfo(merged.dtype).tiny if merged.dtype.is_floating_point else 0.0
    bad_rows: list[int] = []
    bad_count = 0
    worst = 0.0
    num = den = 0.0
    for start, stop in row_blocks(base):
        delta = left[start:stop] @ right
        terms = left[start:stop].abs() @ right.abs()  # bounds the rounding of the product
        w = base[start:stop].to(torch.float64)
        t = merged[start:stop].to(torch.float64)
        exact = w + scale * delta
        allowed = ulps * eps * (exact.abs() + abs(scale) * terms) + tiny
        error = (t - exact).abs()
        # an exact value is within any bound, the zero bound of an integer weight included;
        # not a complex one's: only its real part is compared
        within = (error == 0) & (not merged.dtype.is_complex)
        ratio = torch.where(within, 0.0, error / allowed).nan_to_num(nan=float("inf"))
        bad = (ratio > 1).reshape(stop - start, -1).any(1)
        bad_count += int(bad.sum())
        bad_rows += [start + int(i) for i in bad.nonzero().flatten()[: max(0, 5 - len(bad_rows))]]
        worst = max(worst, float(ratio.max()) if ratio.numel() else 0.0)
        num += float(((t - w) * delta).sum())
        den += float((delta * delta).sum())
    fitted = num / den if den > 0 else None
    return MergeCheck(bad_count == 0, base.shape[0], bad_rows, bad_count, fitted, worst)
