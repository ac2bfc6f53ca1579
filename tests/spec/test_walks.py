"""A spec item travels strictly downward: the call chain (isolate's modules, in order) from the
verb to the flag flip or to ``add_param_group`` is short, and each module on it imports the
next, never the other way round. Traced with ``sys.setprofile`` on a toy model."""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn

from isolate.spec import IsolationHandle, IsolationSpec
from tests.test_layers import ISOLATE, graph

SPEC = {"freeze": ["0", "1"], "thaw": [{"select": "1", "epoch": 1, "lr": 0.01}]}


def chain_at(target: tuple[str, str], call: Callable[[], Any]) -> list[str]:
    """isolate's modules on the stack, outermost first (repeats folded), when the function
    ``target`` (module, name) is first entered during ``call``."""
    found: list[list[str]] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        here = (frame.f_globals.get("__name__", ""), frame.f_code.co_name)
        if event != "call" or here != target or found:
            return
        stack: list[str] = []
        caller: FrameType | None = frame
        while caller is not None:
            stack.insert(0, caller.f_globals.get("__name__", ""))
            caller = caller.f_back
        modules = [m for m in stack if m.startswith("isolate")]
        found.append([m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m])

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert found, f"{target} was never called"
    return found[0]


def upward(chain: list[str]) -> list[str]:
    """The steps of ``chain`` that are not an import of the caller's (or that the callee
    imports back)."""
    edges = graph(ISOLATE)
    steps = itertools.pairwise(chain)
    return [f"{a} -> {b}" for a, b in steps if b not in edges[a] or a in edges[b]]


def applied() -> tuple[nn.Module, torch.optim.Optimizer, IsolationHandle]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frozen parameters taken out of the optimizer
        return model, opt, IsolationSpec.from_dict(SPEC).apply(model, optimizer=opt)


def test_a_freeze_selector_is_resolved_once_then_flipped_going_down() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = IsolationSpec.from_dict(SPEC)
    handles: list[IsolationHandle] = []

    def apply() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handles.append(spec.apply(model, optimizer=opt))

    resolve = chain_at(("isolate._selectors", "select"), apply)
    handles.pop().restore()
    flip = chain_at(("isolate._flags", "write_flags"), apply)
    handles.pop().restore()
    assert resolve == ["isolate.spec.isolation", "isolate.spec.plan", "isolate._selectors"]
    assert flip == [
        "isolate.spec.isolation",
        "isolate.spec.handle",
        "isolate.freezing",
        "isolate._flags",
    ]
    assert upward(resolve) == upward(flip) == []


def test_a_thaw_goes_down_to_the_flag_flip_and_to_add_param_group() -> None:
    _, opt, handle = applied()
    flip = chain_at(("isolate._flags", "write_flags"), lambda: handle.step(epoch=1, step=5))
    handle.restore()
    _, opt, handle = applied()
    joined = chain_at(
        ("torch.optim.optimizer", "add_param_group"), lambda: handle.step(epoch=1, step=5)
    )
    assert handle.thawed == ("1",) and [len(g["params"]) for g in opt.param_groups] == [2, 2]
    handle.restore()
    assert flip == [
        "isolate.spec.handle",
        "isolate.spec.thawing",
        "isolate.freezing",
        "isolate._flags",
    ]
    assert joined == ["isolate.spec.handle", "isolate.spec.thawing", "isolate.spec.optimizers"]
    assert upward(flip) == upward(joined) == []


def test_an_upward_step_is_reported() -> None:
    assert upward(["isolate.freezing", "isolate.spec.handle"]) == [
        "isolate.freezing -> isolate.spec.handle"
    ]
