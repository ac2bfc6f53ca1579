"""Saved isolation state: a round trip resumes without freezing again, and a state of another
spec is refused by name and changes nothing."""

from __future__ import annotations

import copy
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import pytest
import torch

from isolate.errors import CheckpointMismatchError, IsolationTypeError
from isolate.spec import IsolationSpec, Thaw
from isolate.spec.state import check_state, plain, saved_state
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


TWO = IsolationSpec(
    freeze=["trunk"],
    detach=["aux"],
    thaw=[Thaw("trunk.0", epoch=1, lr=0.5), Thaw("trunk.3", epoch=2, lr=0.5)],
)
FIX = (
    "Fix: resume with the spec of the run that wrote it, or load only its weights "
    "(model.load_state_dict(torch.load(path, weights_only=True)['state_dict'])) to start a new "
    "run under the new spec"
)


def _refused(edit: Callable[[dict[str, Any]], object]) -> str:
    """The message of check_state refusing TWO's saved state after ``edit``."""
    handle = TWO.apply(Net())
    record, state, groups = handle.plan.record(), handle.state_dict(), handle.plan.group_names
    handle.restore()
    edit(state)
    with pytest.raises(CheckpointMismatchError) as raised:
        check_state(record, state, groups, "C")
    return str(raised.value)


def _spec(edit: Callable[[dict[str, Any]], object]) -> Callable[[dict[str, Any]], object]:
    return lambda state: edit(state["spec"])


def _thaw(i: int, **fields: Any) -> Callable[[dict[str, Any]], object]:
    return lambda state: state["spec"]["thaw"][i].update(fields)


@pytest.mark.parametrize(
    ("edit", "lines"),
    [
        (
            _spec(lambda s: s.update(detach=["x"])),
            ["detach: only in the checkpoint ['x'], only in this run ['aux']"],
        ),
        (
            _spec(lambda s: s.pop("detach")),
            ["detach: only in the checkpoint [], only in this run ['aux']"],
        ),
        (_spec(lambda s: s["freeze"].reverse()), ["freeze: same names in another order"]),
        (
            _spec(lambda s: s.update(bn="train", clone=["y"])),
            [
                "bn: checkpoint 'train', this run 'eval'",
                "clone: only in the checkpoint ['y'], only in this run []",
            ],
        ),
        (
            _thaw(0, name="old"),
            ["thaw: groups only in the checkpoint ['old'], only in this run ['trunk.0']"],
        ),
        (
            _spec(lambda s: s["thaw"].append({"name": "new"})),
            ["thaw: groups only in the checkpoint ['new'], only in this run []"],
        ),
        (
            _spec(lambda s: s.update(thaw=[{**s["thaw"][1], "lr": 0.1}])),
            [
                "thaw: groups only in the checkpoint [], only in this run ['trunk.0']",
                "thaw group 'trunk.3': lr 0.1 in the checkpoint, 0.5 in this run",
            ],
        ),
        (
            _thaw(0, params=["trunk.0.weight", "x"]),
            [
                "thaw group 'trunk.0': params only in the checkpoint ['x'], only in this run "
                "['trunk.0.bias']"
            ],
        ),
        (
            _thaw(0, params=None),
            [
                "thaw group 'trunk.0': params None in the checkpoint, ['trunk.0.weight', "
                "'trunk.0.bias'] in this run"
            ],
        ),
        (
            _thaw(0, epoch=3, lr=0.1),
            [
                "thaw group 'trunk.0': epoch 3 in the checkpoint, 1 in this run; lr 0.1 in the "
                "checkpoint, 0.5 in this run"
            ],
        ),
        (_spec(lambda s: s["thaw"].reverse()), ["thaw: the same groups in another order"]),
    ],
)
def test_every_difference_of_the_saved_spec_is_named_on_its_own_line(
    edit: Callable[[dict[str, Any]], object], lines: list[str]
) -> None:
    message = _refused(edit)
    assert message == "\n".join(
        [
            "C: the checkpoint was written under a different isolation spec:",
            *(f"  {line}" for line in lines),
            FIX,
        ]
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s.update(spec=None),
            "C: the saved isolation state is malformed: it lacks ['spec']",
        ),
        (
            lambda s: s.update(thawed=[{"name": "trunk.0", "epoch": 1, "global_step": 3}] * 2),
            "C: the saved isolation state thaws ['trunk.0'] more than once; it is inconsistent",
        ),
    ],
)
def test_a_malformed_state_is_refused_with_what_is_wrong(
    edit: Callable[[dict[str, Any]], object], message: str
) -> None:
    assert _refused(edit) == message


def test_a_state_that_is_not_a_mapping_is_refused_by_its_type() -> None:
    with pytest.raises(CheckpointMismatchError) as raised:
        check_state({}, [1], [], "C")
    assert str(raised.value) == "C: the saved isolation state has format 'list', expected 1"


class Level(IntEnum):
    LOW = 1


class Name(str):
    pass


def test_plain_rebuilds_subclasses_as_builtins_and_names_the_caller_of_what_it_cannot() -> None:
    saved = plain({"level": Level.LOW, "name": Name("a"), "flags": (True, 2.5)}, "C")
    assert saved == {"level": 1, "name": "a", "flags": [True, 2.5]}
    assert [type(v) for v in (saved["level"], saved["name"])] == [int, str]
    for value in ({object(): 1}, [object()]):
        with pytest.raises(IsolationTypeError, match=r"^C: cannot save object <object object"):
            plain(value, "C")
    handle = TWO.apply(Net())
    try:
        with pytest.raises(IsolationTypeError, match=r"^C: cannot save object <object object"):
            saved_state(handle.plan, [], {}, object(), [], "C")
    finally:
        handle.restore()
