"""The plan: each selector of a spec is resolved once, when the spec is applied."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from isolate.errors import WrappingError
from isolate.spec import IsolationSpec
from tests.spec._models import SPEC, Net

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def test_each_selector_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import isolate.freezing
    import isolate.spec.plan

    calls: list[tuple[str, ...]] = []
    real = isolate.spec.plan.select

    def counting(model: nn.Module, selectors: Any, caller: str, **options: Any) -> Any:
        calls.append(tuple(selectors))
        return real(model, selectors, caller, **options)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("freezing resolved a selector again")

    monkeypatch.setattr(isolate.spec.plan, "select", counting)
    monkeypatch.setattr(isolate.freezing, "select", refuse)
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.head.parameters(), lr=0.1))
    handle.step(epoch=1, step=1)
    handle.load_state_dict(handle.state_dict())
    handle.restore()
    assert calls == [("trunk",), ("trunk.3",)]


def test_a_branch_registered_under_two_names_is_refused_before_wrapping() -> None:
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": shared, "b": shared})
    with pytest.raises(WrappingError) as raised:
        IsolationSpec(detach=["a"]).apply(model)
    assert str(raised.value).startswith(
        "IsolationSpec(detach): 'a' is registered under 2 names ['a', 'b']; only one of them "
        "can be replaced"
    )
    assert model["a"] is shared and model["b"] is shared
