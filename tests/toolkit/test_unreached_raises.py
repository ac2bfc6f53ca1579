"""The raise sites of the core that no other test reached (found with coverage; see the
README's development section): each gets its typed error and a message that names the
culprit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import isolate
from isolate.errors import IsolationTypeError


class _WithMask(list):  # type: ignore[type-arg]
    """A list subclass whose constructor copies a tensor over from outside its items."""

    source: torch.Tensor | None = None

    def __init__(self, items: list[torch.Tensor]) -> None:
        super().__init__(items)
        self.mask = _WithMask.source


def test_a_rebuilt_container_that_keeps_the_original_tensors_is_refused() -> None:
    _WithMask.source = torch.ones(2, requires_grad=True) * 1
    x = torch.ones(2, requires_grad=True) * 1
    batch = _WithMask([x])
    try:
        with pytest.raises(
            IsolationTypeError,
            match=r"^stop_gradient\(\): .*_WithMask rebuilt from its items still holds the "
            r"original tensors at \['\.mask'\], which are not reached; register ",
        ):
            isolate.stop_gradient(batch)
    finally:
        _WithMask.source = None


def test_gradient_report_refuses_group_names_that_are_not_strings() -> None:
    model = nn.Linear(2, 1)
    loss = model(torch.ones(1, 2)).sum()
    with pytest.raises(
        IsolationTypeError, match=r"^gradient_report\(\): group names must be strings, got 1$"
    ):
        isolate.gradient_report({"main": loss}, model, groups={1: "weight"})  # type: ignore[dict-item]
