"""The bit-level comparisons behind the verdicts: equal bits or not (a negative zero, a NaN),
which rows differ and by how much, read a block of rows at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolate.certificates import certify, compare
from isolate.certificates.compare import as_bits, diff_rows, is_constant, row_blocks, rows_in
from isolate.spec import IsolationSpec


@pytest.mark.parametrize(
    ("dtype", "bits", "shape"),
    [
        (torch.bool, torch.uint8, (3,)),
        (torch.float8_e4m3fn, torch.uint8, (3,)),
        (torch.float16, torch.int16, (3,)),
        (torch.bfloat16, torch.int16, (3,)),
        (torch.float32, torch.int32, (3,)),
        (torch.float64, torch.int64, (3,)),
        (torch.complex64, torch.int64, (3,)),
        (torch.complex128, torch.int64, (3, 2)),  # two float64 words per element
    ],
)
def test_the_bits_of_a_tensor_are_integers_of_its_width(
    dtype: torch.dtype, bits: torch.dtype, shape: tuple[int, ...]
) -> None:
    t = torch.zeros(3, dtype=dtype)
    seen = as_bits(t)
    assert seen.dtype == bits and tuple(seen.shape) == shape
    assert seen.data_ptr() == t.data_ptr()  # a view, no copy


def test_a_negative_zero_differs_in_its_bits_in_every_width() -> None:
    for dtype in (torch.float8_e4m3fn, torch.float16, torch.float32, torch.complex128):
        a = torch.zeros(2, 1).to(dtype)
        b = torch.tensor([[0.0], [-0.0]]).to(dtype)
        diff = diff_rows(a, b)
        assert diff.changed.tolist() == [False, True], dtype
        assert (diff.count, diff.elements, diff.max_abs) == (1, 1, 0.0), dtype
        assert not is_constant(b) and is_constant(a), dtype


def test_the_rows_come_in_blocks_of_about_the_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "_BLOCK", 40)  # two and a half rows of 4 float32
    assert list(row_blocks(torch.zeros(5, 4))) == [(0, 2), (2, 4), (4, 5)]
    assert list(row_blocks(torch.zeros(3, 2, 2, dtype=torch.float64))) == [(0, 1), (1, 2), (2, 3)]
    assert list(row_blocks(torch.zeros(3, 20))) == [(0, 1), (1, 2), (2, 3)]  # a row over a block
    assert list(row_blocks(torch.zeros(50))) == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50)]
    assert list(row_blocks(torch.zeros(50, dtype=torch.uint8))) == [(0, 40), (40, 50)]  # 1 byte
    assert list(row_blocks(torch.tensor(1.0))) == [(0, 1)]  # a scalar is one row
    assert list(row_blocks(torch.zeros(0, 4))) == []
    assert list(row_blocks(torch.zeros(4, 0))) == [(0, 4)]


def test_the_rows_that_differ_are_counted_across_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "_BLOCK", 2 * 2 * 4)  # two rows of 2 float32 per block
    a = torch.zeros(7, 2)
    b = a.clone()
    b[1, 0], b[4] = 3.0, torch.tensor([-0.5, 0.25])
    diff = diff_rows(a, b)
    assert diff.changed.tolist() == [False, True, False, False, True, False, False]
    assert (diff.rows, diff.count, diff.elements, diff.max_abs) == (7, 2, 3, 3.0)
    assert diff.first() == [1, 4] and diff.first(1) == [1]
    b[1, 0] = 0.125  # the largest gap in a later block now
    assert diff_rows(a, b).max_abs == 0.5
    same = diff_rows(a, a.clone())
    assert (same.count, same.elements, same.max_abs) == (0, 0, None)
    assert same.describe() == "no row differs"


def test_a_float8_change_is_measured_in_float64() -> None:
    # float8 promotes with no other dtype: the two sides are widened before they subtract.
    a = torch.tensor([[1.0], [2.0]]).to(torch.float8_e4m3fn)
    b = torch.tensor([[1.0], [-2.0]]).to(torch.float8_e4m3fn)
    diff = diff_rows(a, b)
    assert (diff.count, diff.elements, diff.max_abs) == (1, 1, 4.0)


def test_a_nan_against_a_number_is_an_infinite_change() -> None:
    a = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    b = torch.tensor([[1.0, 5.0], [2.0, 3.5]])
    diff = diff_rows(a, b)
    assert (diff.count, diff.elements, diff.max_abs) == (2, 2, float("inf"))
    assert diff_rows(a, a.clone()).count == 0  # the same NaN bits: no change


def test_a_complex_change_is_measured_by_its_modulus() -> None:
    a = torch.tensor([[1 + 1j], [0j]], dtype=torch.complex64)
    b = torch.tensor([[4 + 5j], [0j]], dtype=torch.complex64)
    diff = diff_rows(a, b)
    assert (diff.count, diff.elements, diff.max_abs) == (1, 1, 5.0)


def test_a_complex128_change_is_counted_by_element_not_by_word() -> None:
    # complex128 has no integer of its width: its bits are two int64 words per element.
    a = torch.tensor([[1 + 1j, 2], [3j, 4]], dtype=torch.complex128)
    b = a.clone()
    b[0, 0] = 1 + 2j  # one word differs
    b[1, 1] = 4 + 3j
    b[1, 0] = 1 + 1j  # both words differ
    diff = diff_rows(a, b)
    assert diff.changed.tolist() == [True, True]
    assert (diff.count, diff.elements, diff.max_abs) == (2, 3, 3.0)


def test_a_complex128_tensor_is_constant_when_both_words_of_every_element_are() -> None:
    assert is_constant(torch.full((2, 3), 1 + 2j, dtype=torch.complex128))
    assert is_constant(torch.tensor(1 + 2j, dtype=torch.complex128))  # one element, two words
    assert not is_constant(torch.tensor([1 + 2j, 2 + 2j], dtype=torch.complex128))
    assert not is_constant(torch.tensor([1 + 2j, 1 + 1j], dtype=torch.complex128))


def test_an_integer_change_is_counted_but_not_measured() -> None:
    a = torch.arange(6).reshape(3, 2)
    b = a.clone()
    b[2, 1] = 100
    diff = diff_rows(a, b)
    assert (diff.count, diff.elements, diff.max_abs) == (1, 1, None)
    assert diff.describe() == "1 of 3 rows differ (rows [2]), 1 element"


def test_a_scalar_is_compared_as_one_row() -> None:
    diff = diff_rows(torch.tensor(1.0), torch.tensor(1.5))
    assert (diff.rows, diff.count, diff.elements, diff.max_abs) == (1, 1, 1, 0.5)
    assert diff.changed.tolist() == [True]


def test_a_difference_is_described_with_its_first_rows_and_its_largest_gap() -> None:
    a = torch.zeros(8, 2)
    b = a.clone()
    b[1:8, 0] = torch.arange(1.0, 8.0)
    b[3, 1] = 0.5
    diff = diff_rows(a, b)
    assert diff.describe() == (
        "7 of 8 rows differ (rows [1, 2, 3, 4, 5, ...]), 8 elements, max |diff| 7"
    )
    assert diff.describe("in w") == (
        "7 of 8 rows differ (rows [1, 2, 3, 4, 5, ...]), 8 elements, max |diff| 7 in w"
    )
    b[6:8] = 0.0
    assert diff_rows(a, b).describe() == (
        "5 of 8 rows differ (rows [1, 2, 3, 4, 5]), 6 elements, max |diff| 5"
    )
    b[2:8] = 0.0
    b[1, 0] = 1 / 3
    assert diff_rows(a, b).describe() == (
        "1 of 8 rows differ (rows [1]), 1 element, max |diff| 0.3333"
    )


def test_a_constant_tensor_holds_the_bits_of_its_first_element_in_every_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compare, "_BLOCK", 8)  # one row of 2 float32 per block
    t = torch.full((4, 2), 0.5)
    assert is_constant(t)
    t[3, 1] = 0.25  # only the last block differs
    assert not is_constant(t)
    t = torch.full((4, 2), 0.5)
    t[0, 0] = 0.25  # only the first element differs
    assert not is_constant(t)
    assert is_constant(torch.full((2, 3), float("nan")))  # the same NaN bits throughout
    assert not is_constant(torch.tensor([1.0, 2.0]))


def test_the_files_that_hold_some_rows_are_named_once_in_source_order() -> None:
    sources = [("a", 0, 2), ("b", 2, 3), ("c", 5, 1), ("a", 6, 2)]
    assert rows_in([0], sources) == ["a"]
    assert rows_in([1, 2], sources) == ["a", "b"]
    assert rows_in([4, 5], sources) == ["b", "c"]
    assert rows_in([7, 0], sources) == ["a"]
    assert rows_in([6, 3], sources) == ["b", "a"]
    assert rows_in([8], sources) == [] and rows_in([], sources) == []


def test_a_frozen_float8_or_complex128_tensor_that_changed_fails_with_its_rows(
    tmp_path: Path,
) -> None:
    base = {
        "w8": torch.tensor([[1.0], [2.0]]).to(torch.float8_e4m3fn),
        "wc": torch.tensor([[1 + 1j], [2]], dtype=torch.complex128),
    }
    tuned = {
        "w8": torch.tensor([[1.0], [-2.0]]).to(torch.float8_e4m3fn),
        "wc": torch.tensor([[1 + 1j], [2 + 3j]], dtype=torch.complex128),
    }
    torch.save(base, tmp_path / "base.pt")
    torch.save(tuned, tmp_path / "tuned.pt")
    cert = certify(
        tmp_path / "base.pt", tmp_path / "tuned.pt", spec=IsolationSpec(freeze=["w8", "wc"])
    )
    assert not cert.clean
    found = {k: (cert.verdict(k).finding, cert.verdict(k).detail) for k in ("w8", "wc")}
    assert found == {
        "w8": ("changed", "1 of 2 rows differ (rows [1]), 1 element, max |diff| 4"),
        "wc": ("changed", "1 of 2 rows differ (rows [1]), 1 element, max |diff| 3"),
    }
