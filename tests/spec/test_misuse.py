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

from isolate.errors import CheckpointMismatchError, SpecError
from isolate.spec import IsolationSpec, Thaw
from isolate.spec.plan import resolve


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


# --------------------------------------------------------------------------------------------
# The handle under forgotten calls, bad manual thaws, a second attach, refused loads.


def net() -> nn.Sequential:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    return nn.Sequential(OrderedDict(trunk=trunk, mid=nn.Linear(3, 3), head=nn.Linear(3, 1)))


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(2, 2)).sum().backward()
    opt.step()


def state_of(model: nn.Module, *opts: torch.optim.Optimizer, scheds: Any = ()) -> dict[str, Any]:
    """Everything a handle may touch, by value and identity."""
    return {
        "flags": {n: p.requires_grad for n, p in model.named_parameters()},
        "groups": [[[id(p) for p in g["params"]] for g in o.param_groups] for o in opts],
        "settings": [
            [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in opts
        ],
        "scheds": [{k: list(v) for k, v in vars(s).items() if isinstance(v, list)} for s in scheds],
        "values": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def assert_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in ("flags", "groups", "settings", "scheds"):
        assert before[key] == after[key], key
    for name, value in before["values"].items():
        assert torch.equal(value, after["values"][name]), name


def test_a_thaw_without_an_attached_optimizer_is_refused() -> None:
    model = net()
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", epoch=1, lr=0.1)])
    handle = spec.apply(model)
    try:
        assert handle.step(epoch=0, step=0) == []
        before = state_of(model)
        with pytest.raises(SpecError, match=r"^IsolationSpec\.thaw\('trunk'\): no optimizer is"):
            handle.step(epoch=1, step=3)
        with pytest.raises(SpecError, match=r"no optimizer is attached"):
            handle.thaw("trunk")
        assert_state(before, state_of(model))
        assert handle.thawed == ()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        handle.attach(opt)
        assert handle.step(epoch=1, step=3) == ["trunk"]
        assert [len(g["params"]) for g in opt.param_groups] == [4, 4]
    finally:
        handle.restore()


def test_verify_names_thawed_parameters_that_no_attached_optimizer_holds() -> None:
    model = net()
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", epoch=1, lr=0.1)])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    handle = spec.apply(model, opt)
    handle.step(epoch=1, step=0)
    saved = handle.state_dict()
    handle.restore()
    model = net()
    handle = spec.apply(model)
    try:
        handle.load_state_dict(saved)  # a resume that forgot attach
        loss = model(torch.ones(2, 2)).sum()
        with pytest.raises(SpecError, match=r"thawed parameters are in none of the 0 attached"):
            handle.verify({}, total=loss)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        handle.attach(opt)  # the thawed group joins as its own param group
        assert [len(g["params"]) for g in opt.param_groups] == [4, 4]
        handle.verify({}, total=loss)
        opt.param_groups[-1]["params"].pop()  # trunk.1.bias leaves every optimizer
        with pytest.raises(
            SpecError, match=r"none of the 1 attached optimizers.*'trunk\.1\.bias'\]"
        ):
            handle.verify(checks=["optimizers"])
    finally:
        handle.restore()


def test_an_optimizer_step_before_the_schedule_ever_ran_is_refused() -> None:
    model = net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", step=2, lr=0.1)])
    handle = spec.apply(model, opt)
    try:
        before = state_of(model, opt)
        with pytest.raises(
            SpecError, match=r"^IsolationSpec: SGD\.step\(\) with thaw groups \['trunk'\] pending"
        ):
            train(model, opt)
        assert_state(before, state_of(model, opt))  # refused before the step moved anything
        for step in range(4):
            handle.step(epoch=0, step=step)
            train(model, opt)
        assert handle.thawed == ("trunk",)
    finally:
        handle.restore()
    # Nothing pending, nothing to drive: training without step() is fine then.
    model = net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with IsolationSpec(freeze=["trunk"]).applied(model, opt):
        train(model, opt)
    train(model, opt)  # restored: the guard is gone


def test_a_step_count_that_goes_back_is_refused_before_anything_changes() -> None:
    # A plain loop that passes the batch's index in its epoch: 4 batches an epoch never reach
    # step 5, so the thaw would silently never happen.
    model = net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    handle = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", step=5)]).apply(model, opt)
    try:
        for batch in range(4):
            handle.step(epoch=0, step=batch)
            train(model, opt)
        before, position = state_of(model, opt), dict(handle.position)
        with pytest.raises(
            SpecError,
            match=r"^IsolationSpec\.step\(\): step=0 is lower than 3, the step of the last "
            r"step\(\) call; pass the number of optimizer steps taken so far in the whole run "
            r"\(Lightning's trainer\.global_step\), not the batch's index in its epoch\.",
        ):
            handle.step(epoch=1, step=0)
        with pytest.raises(
            SpecError,
            match=r"step\(\): epoch=0 is lower than 1, the epoch of the last step\(\) call; "
            r"pass the epoch of the training loop, from 0\. Thaws are never undone",
        ):
            handle.step(epoch=1, step=4)  # fine: the count goes on
            handle.step(epoch=0, step=4)
        with pytest.raises(SpecError, match=r"step\(\): step=-1 is negative; pass the number"):
            handle.loop.begin_step(epoch=1, step=-1)  # the loop drives step() the same way
        assert_state(before, state_of(model, opt))  # nothing thawed, nothing moved
        assert handle.position == {**position, "epoch": 1, "global_step": 4}
        assert handle.thawed == ()
        handle.step(epoch=1, step=4)  # a repeated step (gradient accumulation) is fine
        assert handle.step(epoch=1, step=5) == ["trunk"]
    finally:
        handle.restore()
    fresh = IsolationSpec(freeze=["trunk"]).apply(net())
    with pytest.raises(SpecError, match=r"^IsolationSpec\.step\(\): epoch=-1 is negative"):
        fresh.step(epoch=-1, step=0)
    assert fresh.position == {"epoch": 0, "global_step": 0}


@pytest.mark.parametrize("lr", [-0.01, 0.0, float("nan"), float("inf"), True, "0.1"])
def test_a_manual_thaw_with_a_bad_lr_is_refused(lr: Any) -> None:
    model = net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    handle = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", epoch=3)]).apply(model, opt)
    try:
        before = state_of(model, opt)
        with pytest.raises(
            SpecError, match=r"^IsolationSpec\.thaw\('trunk'\): lr must be a finite"
        ):
            handle.thaw("trunk", lr=lr)
        assert_state(before, state_of(model, opt))
        assert handle.thaw("trunk", lr=0.5)["lr"] == 0.5
    finally:
        handle.restore()


@pytest.mark.parametrize("lr", [0.05, None], ids=["lr", "source-settings"])
def test_a_second_attach_of_the_same_optimizer_only_adds_its_schedulers(lr: float | None) -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    original = [[id(p) for p in g["params"]] for g in opt.param_groups]
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", epoch=1, lr=lr)])
    with pytest.warns(UserWarning, match="took 4 frozen parameters out"):
        handle = spec.apply(model, optimizer=opt)
    try:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        handle.attach(opt, [sched])  # the schedulers, added once the optimizer is attached
        handle.attach(opt, [sched])
        assert [len(g["params"]) for g in opt.param_groups] == [4]
        handle.step(epoch=0, step=0)
        train(model, opt)
        sched.step()
        handle.step(epoch=1, step=1)
        assert [len(g["params"]) for g in opt.param_groups] == [4, 4]
        base = 0.05 if lr is not None else 0.1
        assert sched.base_lrs == [0.1, base]  # the scheduler knows the thawed group
        assert opt.param_groups[1]["lr"] == pytest.approx(base * 0.5)  # where the schedule is
        other = torch.optim.SGD(model.parameters(), lr=0.1)
        before = state_of(model, opt, scheds=[sched])
        with pytest.raises(SpecError, match=r"attach\(\): already attached to 1 optimizer"):
            handle.attach([opt, other])
        assert_state(before, state_of(model, opt, scheds=[sched]))
    finally:
        handle.restore()
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == original
    assert sched.base_lrs == [0.1]


def resumable() -> tuple[IsolationSpec, dict[str, Any]]:
    """A spec with two timed thaws and a monitor thaw, and a state saved after all three."""
    spec = IsolationSpec(
        freeze=["trunk", "mid"],
        thaw=[
            Thaw("trunk.1", epoch=1, lr=0.01),
            Thaw("mid", monitor="val_loss", patience=1),
            Thaw("trunk.0", epoch=3),
        ],
    )
    model = net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    handle = spec.apply(model, opt)
    for epoch, loss in enumerate([1.0, 0.5, 0.7, 0.9]):
        handle.step(epoch=epoch, step=epoch)
        handle.observe({"val_loss": loss})
    handle.step(epoch=4, step=4)
    saved = handle.state_dict()
    handle.restore()
    assert [t["name"] for t in saved["thawed"]] == ["trunk.1", "trunk.0", "mid"]
    return spec, saved


def test_a_refused_load_leaves_the_handle_exactly_as_it_was() -> None:
    spec, saved = resumable()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
    with pytest.warns(UserWarning, match="took 6 frozen parameters out"):
        handle = spec.apply(model)
        handle.attach(opt, [sched])
    try:
        handle.step(epoch=1, step=1)  # thaws trunk.1 before the load
        handle.observe({"val_loss": 2.0})
        assert handle.thawed == ("trunk.1",)
        before = state_of(model, opt, scheds=[sched])
        state = handle.state_dict()
        # Consistent in form, but what it lists as frozen is not what its thaws leave.
        bad = {**saved, "frozen": ["trunk.0.weight"]}
        with pytest.raises(CheckpointMismatchError, match=r"it is inconsistent"):
            handle.load_state_dict(bad)
        assert_state(before, state_of(model, opt, scheds=[sched]))
        assert handle.state_dict() == state  # thaws, phases, plateau, layout
        assert handle.thawed == ("trunk.1",) and handle.watching == "mid"
        handle.load_state_dict(saved)  # the real one still loads
        assert handle.thawed == ("trunk.1", "trunk.0", "mid")
        assert [len(g["params"]) for g in opt.param_groups] == [2, 2, 2, 2]
    finally:
        handle.restore()


def test_a_state_saved_before_a_thaw_the_handle_made_is_refused_by_what_it_thawed() -> None:
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.1", epoch=2, lr=0.01)])
    model = net()
    opt = torch.optim.SGD([*model.mid.parameters(), *model.head.parameters()], lr=0.1)
    handle = spec.apply(model, opt)
    try:
        earlier = handle.state_dict()
        handle.step(epoch=2, step=2)
        assert handle.thawed == ("trunk.1",)
        before, state = state_of(model, opt), handle.state_dict()
        with pytest.raises(
            CheckpointMismatchError,
            match=r"this handle has thawed \['trunk.1'\], which the state had not thawed .*"
            r"apply the spec to the model and optimizer the checkpoint is loaded into",
        ):
            handle.load_state_dict(earlier)
        assert_state(before, state_of(model, opt))
        assert handle.state_dict() == state
    finally:
        handle.restore()
    again = net()
    fresh = spec.apply(
        again, torch.optim.SGD([*again.mid.parameters(), *again.head.parameters()], lr=0.1)
    )
    fresh.load_state_dict(earlier)  # into a handle that has not thawed more, it loads
    assert fresh.thawed == ()
    fresh.restore()


def test_a_thaw_that_cannot_join_leaves_no_group_behind() -> None:
    model = net()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", epoch=1, lr=0.1)])
    handle = spec.apply(model, opt)
    try:
        before = state_of(model, opt)
        with pytest.raises(SpecError, match=r"not one of the 1 attached optimizers"):
            handle.thaw("trunk", optimizer=3)
        assert_state(before, state_of(model, opt))
        assert handle.thawed == () and handle.frozen == tuple(
            n for n, _ in model.named_parameters() if n.startswith("trunk")
        )
    finally:
        handle.restore()


@pytest.mark.parametrize("lr", [None, 0.2], ids=["source-settings", "lr"])
def test_a_thawed_group_follows_its_source_groups_lambda(lr: float | None) -> None:
    """Two groups with different lambdas: the trunk (group 0) decays, the head (group 1,
    the last) does not. The thawed trunk must follow group 0's lambda."""
    model = net()
    opt = torch.optim.SGD(
        [
            {"params": [*model.trunk.parameters(), *model.mid.parameters()], "lr": 0.1},
            {"params": list(model.head.parameters()), "lr": 0.3},
        ],
        lr=0.1,
    )
    decay, constant = (lambda t: 0.5**t), (lambda t: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [decay, constant])
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", step=2, lr=lr)])
    with pytest.warns(UserWarning, match="took 4 frozen parameters out"):
        handle = spec.apply(model, opt)
        handle.attach(opt, [sched])
    used: list[list[float]] = []
    opt.register_step_post_hook(lambda o, *_: used.append([g["lr"] for g in o.param_groups]))
    try:
        for step in range(5):
            handle.step(epoch=0, step=step)
            train(model, opt)
            sched.step()
        base = 0.1 if lr is None else lr
        expected = [[0.1 * 0.5**t, 0.3] + ([base * 0.5**t] if t >= 2 else []) for t in range(5)]
        assert [len(row) for row in used] == [len(row) for row in expected]
        for row, want in zip(used, expected, strict=True):
            assert row == pytest.approx(want, rel=1e-12)
    finally:
        handle.restore()
