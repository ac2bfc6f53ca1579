"""The branches a spec detaches or clones: each wrapper is named by the branch's path in
the model, so that its errors say which branch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isolate.errors import InplaceModificationError
from isolate.spec import IsolationSpec


class _Doubles(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


def test_a_detached_branch_that_edits_its_input_is_named_by_its_path() -> None:
    model = nn.ModuleDict({"trunk": nn.Linear(2, 2), "aux": nn.Sequential(_Doubles())})
    handle = IsolationSpec(detach=["aux"]).apply(model)
    try:
        with pytest.raises(InplaceModificationError, match=r"^Detached\(aux\): the branch edited "):
            model["aux"](model["trunk"](torch.ones(1, 2)))
    finally:
        handle.restore()
