"""The spec and its handle under what users do: round trips, the fixes messages suggest, specs
moved under a prefix, forgotten calls, bad manual thaws, attaching twice, refused loads, and
undone thaws, each checked against the flags, groups and lrs written out by hand."""

from __future__ import annotations

import ast
import re
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

from isolate.errors import SpecError
from isolate.spec.plan import resolve
from isolate.spec import IsolationSpec, Thaw


def tower() -> nn.Sequential:
    torch.manual_seed(0)
    trunk = nn.Sequential(
        nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    )
    return nn.Sequential(OrderedDict(trunk=trunk, head=nn.Linear(4, 1)))


def test_to_dict_round_trips_a_string_select() -> None:
    spec = IsolationSpec(
        freeze=["trunk"], thaw=[Thaw("trunk", epoch=1), Thaw(["head"], step=3, name="h")]
    )
    assert IsolationSpec.from_dict(spec.to_dict()) == spec
    assert Thaw("trunk", epoch=1) == Thaw(["trunk"], epoch=1) == Thaw(("trunk",), epoch=1)
    assert hash(Thaw("trunk", epoch=1)) == hash(Thaw(["trunk"], epoch=1))
    assert Thaw("trunk", epoch=1) != Thaw("trunk", epoch=2)
    assert Thaw("trunk", epoch=1) != Thaw(["trunk", "head"], epoch=1, name="trunk")


def suggested(message: str) -> tuple[str, list[str]]:
    found = re.search(r"select: (\[.*?\]) for '([^']+)'", message)
    assert found, message
    return found.group(2), ast.literal_eval(found.group(1))


@pytest.mark.parametrize(
    "thaws",
    [
        [Thaw("trunk", epoch=1), Thaw("trunk.3", epoch=2)],
        [Thaw("trunk.3", epoch=1), Thaw("trunk", epoch=2)],
        [Thaw(["trunk", "!trunk.0"], epoch=1), Thaw("trunk.4", epoch=2)],
        [Thaw("trunk.4", epoch=1), Thaw(["trunk", "!trunk.0"], epoch=2)],
        [Thaw("trunk.*.weight", epoch=1), Thaw("trunk.3", step=5)],
        [Thaw("trunk.2", epoch=1), Thaw("trunk.[23].*", epoch=2)],
    ],
    ids=[
        "wide-first",
        "narrow-first",
        "wide-with-exclusion",
        "narrow-then-excluding",
        "glob",
        "partial",
    ],
)
def test_an_overlap_is_refused_with_an_exclusion_that_fixes_it(thaws: list[Thaw]) -> None:
    model = tower()
    spec = IsolationSpec(freeze=["trunk"], thaw=thaws)
    with pytest.raises(SpecError, match=r"both select") as error:
        spec.apply(model)
    name, select = suggested(str(error.value))
    fixed = [
        Thaw(select, epoch=t.epoch, step=t.step, name=t.name) if t.name == name else t
        for t in thaws
    ]
    handle = IsolationSpec(freeze=["trunk"], thaw=fixed).apply(model)
    try:
        groups = [set(handle.plan.group(str(t.name)).params) for t in fixed]
        assert all(groups) and not groups[0] & groups[1]
        alone = [
            set(resolve(IsolationSpec(freeze=["trunk"], thaw=[t]), model).groups[0].params)
            for t in thaws
        ]
        assert groups[0] | groups[1] == alone[0] | alone[1]  # only the overlap moved
    finally:
        handle.restore()


class Outer(nn.Module):
    """A LightningModule's shape: the net under ``net`` and a module of its own beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tower()
        self.criterion = nn.Linear(1, 1)  # parameters outside the prefix


PREFIXED: list[dict[str, Any]] = [
    {"freeze": ["trunk", "!type:BatchNorm1d"]},
    {"freeze": ["trunk", "!type:_BatchNorm"], "thaw": [Thaw("trunk", epoch=1)]},
    {"freeze": ["!head"]},
    {"freeze": ["!head", "!trunk.0"], "thaw": [Thaw(["!head", "!trunk.0"], epoch=1)]},
    {"freeze": ["type:Linear", "!head"], "thaw": [Thaw("trunk/type:Linear", epoch=1)]},
    {"freeze": ["trunk.*.weight"], "protect": {"aux": ["!trunk"]}},
    {"freeze": ["trunk"], "thaw": [Thaw(["trunk", "!trunk/type:BatchNorm1d"], epoch=1)]},
]


@pytest.mark.parametrize("data", PREFIXED, ids=lambda d: repr(d["freeze"]))
def test_prefixed_selects_what_the_spec_selects_on_the_inner_model(data: dict[str, Any]) -> None:
    spec = IsolationSpec(**data)
    inner = tower()
    outer = Outer()
    outer.net.load_state_dict(inner.state_dict())
    direct = spec.apply(inner)
    try:
        moved = spec.prefixed("net").apply(outer)
    except BaseException:
        direct.restore()
        raise
    try:
        assert moved.frozen == tuple(f"net.{n}" for n in direct.frozen)
        assert list(moved.frozen_norms()) == [f"net.{n}" for n in direct.frozen_norms()]
        for g, h in zip(direct.plan.groups, moved.plan.groups, strict=True):
            assert list(h.params) == [f"net.{n}" for n in g.params]
        if direct.plan.protect is not None:
            assert moved.plan.protect is not None
            assert {k: list(v) for k, v in moved.plan.protect.items()} == {
                k: [f"net.{n}" for n in v] for k, v in direct.plan.protect.items()
            }
        assert outer.criterion.weight.requires_grad
    finally:
        moved.restore()
        direct.restore()
