"""The callback's saved state: kept before the spec is applied, and the one-call check a
resume makes before the strategy loads the weights (what it passes on, that it runs once)."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
from torch import nn

from isolate import IsolationSpec
from isolate.errors import CheckpointMismatchError
from isolate.lightning import IsolationCallback
from isolate.lightning.checkpoint import SavedState
from isolate.spec.handle import IsolationHandle

KEY = "IsolationCallback"


def test_before_any_fit_the_state_is_empty() -> None:
    assert SavedState("cb").state(None) == {}
    assert IsolationCallback(freeze=["trunk"]).state_dict() == {}


def test_a_state_loaded_before_the_spec_is_applied_is_kept_as_a_copy() -> None:
    saved, state = SavedState("cb"), {"thawed": [{"name": "trunk"}]}
    saved.load(None, state)
    kept = saved.state(None)
    assert kept == state
    state["thawed"] = []
    assert saved.state(None) == {"thawed": [{"name": "trunk"}]}  # not the caller's dict
    kept["extra"] = 1
    assert "extra" not in saved.state(None)  # nor one handed out


class _Strategy:
    """A strategy whose own ``load_model_state_dict`` records every argument it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def load_model_state_dict(self, checkpoint: Any, *args: Any, **kwargs: Any) -> str:
        self.calls.append((checkpoint, args, kwargs))
        return "loaded"


@pytest.fixture
def handle() -> Iterator[IsolationHandle]:
    applied = IsolationSpec(freeze=["0"]).apply(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    yield applied
    applied.restore()


def test_the_check_passes_every_argument_on_and_runs_once(handle: IsolationHandle) -> None:
    strategy = _Strategy()
    trainer: Any = types.SimpleNamespace(strategy=strategy)
    SavedState("cb").check_before_weights(trainer, KEY, handle)
    checkpoint = {"callbacks": {KEY: handle.state_dict()}}
    assert strategy.load_model_state_dict(checkpoint, "positional", strict=False) == "loaded"
    assert strategy.calls == [(checkpoint, ("positional",), {"strict": False})]
    assert "load_model_state_dict" not in strategy.__dict__  # once
    # A later load (another fit, without this callback's state) is not checked any more.
    strategy.load_model_state_dict({"callbacks": {}})
    assert strategy.calls[-1] == ({"callbacks": {}}, (), {})


def test_a_check_left_by_an_earlier_fit_does_not_break_the_next_load(
    handle: IsolationHandle,
) -> None:
    strategy = _Strategy()
    trainer: Any = types.SimpleNamespace(strategy=strategy)
    saved = SavedState("cb")
    saved.check_before_weights(trainer, KEY, handle)  # a fit that stopped before loading
    saved.check_before_weights(trainer, KEY, handle)  # the next fit
    checkpoint = {"callbacks": {KEY: handle.state_dict()}}
    assert strategy.load_model_state_dict(checkpoint) == "loaded"
    assert strategy.calls == [(checkpoint, (), {})]
    assert "load_model_state_dict" not in strategy.__dict__
    saved.check_before_weights(trainer, KEY, handle)
    with pytest.raises(CheckpointMismatchError, match=r"holds no IsolationCallback state"):
        strategy.load_model_state_dict({"callbacks": {}})
    assert len(strategy.calls) == 1  # refused before the weights load
