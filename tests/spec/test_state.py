"""Saved isolation state: a round trip resumes without freezing again, and a state of another
spec is refused by name and changes nothing."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from isolate.errors import (
    CheckpointMismatchError,
)
from tests.spec._models import SPEC, Net, assert_same, state_of

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def test_state_round_trip_resumes_without_refreezing() -> None:
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.head.parameters(), lr=0.1))
    handle.step(epoch=1, step=4)
    state = handle.state_dict()
    handle.restore()
    assert state["thawed"] == [{"name": "trunk.3", "epoch": 1, "global_step": 4}]
    assert state["frozen"] == ["trunk.0.weight", "trunk.0.bias", "trunk.1.weight", "trunk.1.bias"]
    fresh = Net()
    opt = torch.optim.SGD(fresh.head.parameters(), lr=0.1)
    resumed = SPEC.apply(fresh, optimizer=opt)
    resumed.load_state_dict(copy.deepcopy(state))
    assert fresh.trunk[3].weight.requires_grad and not fresh.trunk[0].weight.requires_grad
    assert len(opt.param_groups) == 2 and resumed.step(epoch=1, step=5) == []
    resumed.restore()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda s: s["spec"].update(freeze=["trunk.0.weight"]),
            r"\n  freeze: only in the checkpoint \[\], only in this run \['trunk.0.bias'",
        ),
        (
            lambda s: s["spec"]["thaw"][0].update(lr=0.1),
            r"thaw group 'trunk.3': lr 0.1 in the checkpoint, 0.5 in this run",
        ),
        (lambda s: s.update(format=7), r"has format 7, expected 1"),
        (lambda s: s.update(thawed=[{"name": "trunk.3"}]), r"'thawed' must be a list of"),
        (
            lambda s: s.update(thawed=[{"name": "x", "epoch": 0, "global_step": 0}]),
            r"thawed groups \['x'\] that this spec does not have",
        ),
        (lambda s: s.update(frozen=[]), r"lists \[\] as frozen, but its schedule leaves"),
    ],
)
def test_a_foreign_state_is_refused_and_changes_nothing(edit: Any, match: str) -> None:
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.head.parameters(), lr=0.1))
    handle.step(epoch=1, step=4)
    state = handle.state_dict()
    handle.restore()
    edit(state)
    fresh = Net()
    resumed = SPEC.apply(fresh)
    before = state_of(fresh)
    with pytest.raises(CheckpointMismatchError, match=match):
        resumed.load_state_dict(state)
    assert_same(before, state_of(fresh))
    resumed.restore()
