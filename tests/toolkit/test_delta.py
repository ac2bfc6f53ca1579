"""How far a tensor moved, element by element: dense or sparse, of one dtype or two."""

from __future__ import annotations

import torch

from isolate._delta import moved_elements, sparse_abs_difference


def test_sparse_tensors_of_different_dtypes_are_compared_by_value() -> None:
    old = torch.tensor([1, 0, 3]).to_sparse()
    new = torch.tensor([1.0, 0.0, 3.5]).to_sparse()
    assert sparse_abs_difference(old, new).tolist() == [0.0, 0.5]
    assert moved_elements(old, new, atol=0.0) == 1
    assert moved_elements(old, new, atol=0.5) == 0
    complex_new = torch.tensor([1 + 1j, 0, 3]).to_sparse()
    assert sparse_abs_difference(old, complex_new).tolist() == [1.0, 0.0]
