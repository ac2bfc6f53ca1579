"""How far a tensor moved, element by element: dense or sparse, of one dtype or two."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isolate._delta import abs_difference, moved_elements, sparse_abs_difference
from isolate.drift import snapshot
from isolate.errors import DriftError

NAN = float("nan")


def test_sparse_tensors_of_different_dtypes_are_compared_by_value() -> None:
    old = torch.tensor([1, 0, 3]).to_sparse()
    new = torch.tensor([1.0, 0.0, 3.5]).to_sparse()
    assert sparse_abs_difference(old, new).tolist() == [0.0, 0.5]
    assert moved_elements(old, new, atol=0.0) == 1
    assert moved_elements(old, new, atol=0.5) == 0
    complex_new = torch.tensor([1 + 1j, 0, 3]).to_sparse()
    assert sparse_abs_difference(old, complex_new).tolist() == [1.0, 0.0]


def test_integers_are_subtracted_exactly_across_the_whole_int64_range() -> None:
    # 2**62 - (-2**63) wraps in int64; 0 - (-2**63) has no int64 magnitude.
    old = torch.tensor([-(2**63), 0, 5, 2**61 - 1])
    new = torch.tensor([2**62, -(2**63), 5, 2**61 - 2])
    diff = abs_difference(old, new)
    assert diff.dtype == torch.float64
    assert diff.tolist() == [3.0 * 2**62, 2.0**63, 0.0, 1.0]
    assert moved_elements(old, new, atol=0.0) == 3
    assert moved_elements(old, new, atol=2.0**63) == 1


def test_low_precision_floats_are_subtracted_in_float64() -> None:
    # In float16, 65504 - (-65504) overflows to inf.
    old = torch.tensor([-65504.0, 1.0, NAN, 2.0], dtype=torch.float16)
    new = torch.tensor([65504.0, 1.0, NAN, NAN], dtype=torch.float16)
    diff = abs_difference(old, new)
    assert diff.dtype == torch.float64
    assert diff[:3].tolist() == [131008.0, 0.0, 0.0] and diff[3].isnan()
    assert moved_elements(old, new, atol=131008.0) == 1  # only the NaN


def test_sparse_and_dense_count_the_same_elements_as_moved() -> None:
    # A NaN on one side is a move, NaN on both sides is not, on every layout and pairing.
    old = torch.tensor([[1.0, NAN, 0.0, 2.0, NAN]])
    new = torch.tensor([[NAN, NAN, 0.0, 2.5, 0.0]])
    for a in (old, old.to_sparse()):
        for b in (new, new.to_sparse(), new.to_sparse_csr()):
            assert moved_elements(a, b, atol=0.0) == 3, (a.layout, b.layout)
            assert moved_elements(a, b, atol=1.0) == 2, (a.layout, b.layout)


def test_sparse_entries_on_different_index_sets_are_compared_like_dense_ones() -> None:
    old = torch.tensor([NAN, 1.0, 0.0, -(2**63)]).to_sparse()
    new = torch.tensor([NAN, 0.0, 5.0, 2**62]).to_sparse()
    assert sparse_abs_difference(old, new).tolist() == [0.0, 1.0, 5.0, 3.0 * 2**62]
    old_int = torch.tensor([-(2**63), 0, 4]).to_sparse()
    new_int = torch.tensor([2**62, 7, 4]).to_sparse()
    assert sparse_abs_difference(old_int, new_int).tolist() == [3.0 * 2**62, 7.0, 0.0]
    assert moved_elements(old_int, new_int, atol=7.0) == 1
    flags = torch.tensor([True, False, True]).to_sparse()
    assert sparse_abs_difference(flags, torch.tensor([False, True, True]).to_sparse()).tolist() == [
        1.0,
        1.0,
        0.0,
    ]
    hybrid = torch.eye(2).to_sparse(1)  # one sparse dimension, rows stored densely
    assert sparse_abs_difference(hybrid, (2 * torch.eye(2)).to_sparse(1)).tolist() == [
        [1.0, 0.0],
        [0.0, 1.0],
    ]


def test_a_sparse_buffer_gone_nan_is_reported_with_its_moved_entries() -> None:
    model = nn.Module()
    model.register_buffer(
        "coo", torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([NAN, 2.0]), (4,))
    )
    before = snapshot(model)
    model.coo = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([NAN, NAN]), (4,))
    assert before.changed() == {"coo": pytest.approx(NAN, nan_ok=True)}
    with pytest.raises(DriftError, match=r"coo .*max\|Δ\|=nan in 2 of 4 elements"):
        before.assert_unchanged()


def test_a_hybrid_sparse_tensor_is_compared_with_a_dense_or_fully_sparse_one() -> None:
    # sparse_dim 1 < ndim 2: each stored entry is a row; the other side has no such rows.
    hybrid = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([[1.0, 2.0, 3.0]]), (2, 3))
    dense = hybrid.to_dense()
    for other in (dense, dense.to_sparse()):
        assert moved_elements(hybrid, other, 0.0) == 0
        assert float(sparse_abs_difference(hybrid, other).max()) == 0.0
    moved = dense.clone()
    moved[1, 2] = 7.0
    moved[0, 0] = float("nan")
    assert moved_elements(hybrid, moved, 0.0) == 2
    assert moved_elements(moved.to_sparse(1), hybrid, 3.5) == 2  # |7 - 3| = 4 and a NaN
    assert float(sparse_abs_difference(hybrid, moved).nan_to_num().max()) == 4.0
