"""check_merge on its own: the bound's edge, a NaN, weights read in several blocks of rows,
the fitted scale of a small delta, and the description when no scale can be fitted."""

from __future__ import annotations

import pytest
import torch

from isolate.certificates import compare
from isolate.certificates.merge import check_merge

R = 2


def test_an_error_of_exactly_the_allowed_size_passes_and_one_half_again_fails() -> None:
    zero, a, b = torch.zeros(4, 3), torch.zeros(R, 3), torch.zeros(4, R)
    tiny = torch.finfo(torch.float32).tiny  # the whole allowed error where everything is 0
    merged = zero.clone()
    merged[1, 0], merged[3, 2] = tiny, 1.5 * tiny
    check = check_merge(zero, merged, a, b, scale=1.0, transposed=False, ulps=2)
    assert (check.ok, check.bad_rows, check.bad_count, check.worst) == (False, [3], 1, 1.5)


def test_a_nan_in_the_merged_weight_is_outside_any_bound() -> None:
    g = torch.Generator().manual_seed(0)
    w, a, b = (
        torch.randn(4, 3, generator=g),
        torch.randn(R, 3, generator=g),
        torch.randn(4, R, generator=g),
    )
    merged = w + 2.0 * (b @ a)
    merged[2, 1] = float("nan")
    check = check_merge(w, merged, a, b, scale=2.0, transposed=False, ulps=2)
    assert (check.ok, check.bad_rows, check.bad_count, check.worst) == (False, [2], 1, float("inf"))


def test_a_weight_read_in_blocks_of_rows_is_judged_as_a_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compare, "_BLOCK", 2 * 4 * 4)  # two rows of 4 float32 per block
    g = torch.Generator().manual_seed(1)
    w, a, b = (
        torch.randn(12, 4, generator=g),
        torch.randn(R, 4, generator=g),
        torch.randn(12, R, generator=g),
    )
    delta = b @ a
    merged = w + delta
    merged[:7] = w[:7] + 2.0 * delta[:7]  # the first 7 rows merged at twice the scale
    check = check_merge(w, merged, a, b, scale=1.0, transposed=False, ulps=2)
    d = b.double() @ a.double()  # as check_merge computes it
    fitted = float(((merged.double() - w.double()) * d).sum() / (d * d).sum())
    assert (check.ok, check.rows, check.bad_count, check.bad_rows) == (
        False,
        12,
        7,
        [0, 1, 2, 3, 4],
    )
    assert check.fitted_scale == pytest.approx(fitted, rel=1e-12) and 1.2 < fitted < 1.9
    assert check.worst > 1


def test_the_scale_of_a_small_delta_is_still_fitted() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 5, generator=g, dtype=torch.float64)
    a = 0.01 * torch.randn(R, 5, generator=g, dtype=torch.float64)
    b = 0.01 * torch.randn(6, R, generator=g, dtype=torch.float64)
    check = check_merge(w, w + 3.0 * (b @ a), a, b, scale=3.0, transposed=False, ulps=2)
    assert check.ok and check.fitted_scale == pytest.approx(3.0, rel=1e-9)


def test_with_a_zero_delta_no_scale_is_fitted_and_the_description_says_so() -> None:
    w, a, b = torch.randn(3, 4), torch.zeros(R, 4), torch.ones(3, R)  # A still at zero
    check = check_merge(w, w.clone(), a, b, scale=2.0, transposed=False, ulps=2)
    assert check.ok and check.fitted_scale is None
    assert check.describe(2.0) == "base + 2 x B@A within rounding (fitted scale n/a)"


def test_an_integer_weight_must_be_merged_exactly() -> None:
    w = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    a, b = torch.ones(R, 4, dtype=torch.int32), torch.ones(3, R, dtype=torch.int32)
    merged = w + 2 * (b @ a)
    exact = check_merge(w, merged, a, b, scale=2.0, transposed=False, ulps=2)
    assert (exact.ok, exact.bad_rows, exact.fitted_scale, exact.worst) == (True, [], 2.0, 0.0)
    merged[1, 3] += 1  # an integer has no rounding to hide a unit in
    off = check_merge(w, merged, a, b, scale=2.0, transposed=False, ulps=2)
    assert (off.ok, off.bad_rows, off.bad_count) == (False, [1], 1)


def test_a_complex_weight_is_never_certified_merged_from_its_real_part() -> None:
    w = torch.randn(3, 4, dtype=torch.complex64)
    a, b = torch.zeros(R, 4, dtype=torch.complex64), torch.ones(3, R, dtype=torch.complex64)
    merged = w + 1j  # the real part exact, the imaginary part moved
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        check = check_merge(w, merged, a, b, scale=1.0, transposed=False, ulps=2)
    assert not check.ok and check.bad_rows == [0, 1, 2]
