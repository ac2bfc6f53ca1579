"""The thaw schedule over time: the warm-up ramp and align act inside optimizer.step only,
resume from where they were, and plateau phases follow EarlyStopping's rule.

Plain loops on a two-layer net: layer 0 frozen and thawed, layer 1 trains from the start.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from pytorch_lightning.callbacks import EarlyStopping
from torch import nn
from torch.optim import lr_scheduler as L

from isolate import IsolationSpec, Thaw
from isolate.errors import CheckpointMismatchError, SpecError
from isolate.spec.clock import Phases, Plateau, ramp
from tests.spec._models import train, two_layers


def test_warmup_ramps_inside_the_step_and_the_group_keeps_its_lr() -> None:
    model = two_layers()
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    thaw = Thaw("0", step=2, lr=0.2, warmup_ratio=0.25, warmup_steps=3)
    used, after = train(model, IsolationSpec(freeze=["0"], thaw=[thaw]), opt, None, 7)
    assert [u[1] for u in used[2:]] == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2])
    assert [a[1] for a in after[2:]] == [0.2] * 5  # schedulers and checkpoints see 0.2
    assert not opt._optimizer_step_pre_hooks  # restore took the hooks off


@pytest.mark.parametrize("shape", ["linear", "cosine", "exponential"])
def test_ramp_shapes(shape: str) -> None:
    thaw = Thaw("0", epoch=0, warmup_ratio=0.1, warmup_epochs=4, warmup_shape=shape)  # type: ignore[arg-type]
    got = [ramp(thaw, steps=0, epochs=e) for e in range(6)]
    p = [0, 0.25, 0.5, 0.75, 1, 1]
    want = {
        "linear": [0.1 + 0.9 * x for x in p],
        "cosine": [0.1 + 0.9 * (1 - math.cos(math.pi * x)) / 2 for x in p],
        "exponential": [0.1 ** (1 - x) for x in p],
    }[shape]
    assert got == pytest.approx(want)


def test_align_follows_the_scheduled_source_group_after_an_epoch_ramp() -> None:
    """BackboneFinetuning's should_align: the thawed group steps at ramp * group 0's lr, and
    at group 0's lr once the ramp is over, whatever the scheduler does to group 0."""
    model = two_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # one group, all params
    scheduler = L.StepLR(opt, 3, 0.5)
    thaw = Thaw("0", epoch=1, warmup_ratio=0.25, warmup_epochs=2, align=True)
    with pytest.warns(UserWarning, match="took 2 frozen parameters out"):
        used, _ = train(
            model, IsolationSpec(freeze=["0"], thaw=[thaw]), opt, scheduler, 12, per_epoch=2
        )
    factors = [0.25, 0.25, 0.625, 0.625] + [1.0] * 6  # epochs 1, 2, then aligned
    assert [u[1] for u in used[2:]] == pytest.approx(
        [f * u[0] for f, u in zip(factors, used[2:], strict=True)]
    )


def test_ramp_resumes_from_the_saved_position() -> None:
    spec = IsolationSpec(
        freeze=["0"], thaw=[Thaw("0", step=1, lr=0.2, warmup_ratio=0.5, warmup_steps=4)]
    )
    model = two_layers()
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    handle = spec.apply(model, opt)
    for step in range(3):
        handle.step(epoch=0, step=step)
    state, opt_state = handle.state_dict(), opt.state_dict()
    handle.restore()
    model2 = two_layers()
    opt2 = torch.optim.SGD(model2[1].parameters(), lr=0.1)
    used: list[float] = []
    opt2.register_step_post_hook(lambda o, *_: used.append(o.param_groups[-1]["lr"]))
    resumed = spec.apply(model2, opt2)
    resumed.load_state_dict(state)
    opt2.load_state_dict(opt_state)
    for step in range(3, 7):
        resumed.step(epoch=0, step=step)
        model2(torch.ones(1, 2)).sum().backward()
        opt2.step()
    resumed.restore()
    assert used == pytest.approx([0.15, 0.175, 0.2, 0.2])  # 0.2 * (0.5 + 0.5 * (step - 1) / 4)


def test_plateau_decides_as_lightning_early_stopping() -> None:
    rng = random.Random(0)
    for trial in range(200):
        mode = rng.choice(["min", "max"])
        patience, min_delta = rng.randint(1, 4), rng.choice([0.0, 0.25, 0.5])
        ours = Plateau("m", patience=patience, min_delta=min_delta, mode=mode)
        theirs = EarlyStopping("m", patience=patience, min_delta=min_delta, mode=mode)
        for _ in range(12):
            value = rng.randint(0, 16) / 8  # exact in float32: ties happen
            stop, _ = theirs._evaluate_stopping_criteria(torch.tensor(value))
            fired = ours.update(value)
            assert fired == stop, (trial, mode, patience, min_delta)
            if stop:
                break


def test_monitor_thaws_are_phases_with_saved_state() -> None:
    spec = IsolationSpec(
        freeze=["0"],
        thaw=[
            Thaw("0.weight", monitor="val", patience=2),
            Thaw("0.bias", monitor="val", patience=1, mode="max", epoch=9),
        ],
    )
    model = two_layers()
    with pytest.warns(UserWarning, match="took 2 frozen parameters out"):
        handle = spec.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert handle.observe({"val": 1.0}) == []
    assert handle.observe({"val": 1.0}) == []
    state = handle.state_dict()  # mid-plateau: one check without improvement
    assert handle.observe({"val": 1.0}) == ["0.weight"]
    assert handle.due(epoch=3, step=0) == ["0.weight"]
    assert handle.observe({"val": 5.0}) == []  # 0.bias waits for 0.weight's thaw
    handle.step(epoch=3, step=0)
    assert handle.thawed == ("0.weight",)
    assert handle.observe({"val": 2.0}) == []  # fresh: its own best
    assert handle.observe({"val": 2.0}) == ["0.bias"]
    handle.restore()
    # Resumed mid-plateau: the wait count is kept, so one more flat check fires.
    resumed = spec.apply(two_layers())
    resumed.load_state_dict(state)
    assert resumed.observe({"val": 1.0}) == ["0.weight"]
    assert resumed.observe({"loss": 1.0}) == []  # nothing watches until the thaw
    resumed.restore()
    # The latest epoch thaws without a plateau; a missing metric and a state of other
    # monitors are refused.
    latest = spec.apply(two_layers())
    with pytest.raises(
        SpecError, match=r"monitors 'val', which is not among the logged metrics \['loss'\]"
    ):
        latest.observe({"loss": 1.0})
    assert latest.due(epoch=9, step=0) == ["0.bias"]
    bad = dict(state, phases={"fired": [], "plateaus": {}})
    with pytest.raises(CheckpointMismatchError, match="plateau state"):
        latest.load_state_dict(bad)
    latest.restore()


def test_align_follows_the_source_group_whatever_changes_it() -> None:
    model = two_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    used: list[list[float]] = []
    opt.register_step_post_hook(lambda o, *_: used.append([g["lr"] for g in o.param_groups]))
    spec = IsolationSpec(freeze=["0"], thaw=[Thaw("0", step=1, align=True)])
    with pytest.warns(UserWarning, match="took 2 frozen parameters out"):
        handle = spec.apply(model, opt)
    for step in range(4):
        handle.step(epoch=0, step=step)
        if step == 2:
            opt.param_groups[0]["lr"] = 0.3  # by hand: a user's code, an lr finder
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    handle.restore()
    assert used == [[0.1], [0.1, 0.1], [0.3, 0.3], [0.3, 0.3]]


def test_carry_best_starts_from_the_last_thaw_on_the_same_metric_and_mode() -> None:
    thaws = [
        Thaw("a", monitor="val", patience=1),
        Thaw("b", monitor="val", patience=1, mode="max"),  # same metric, other mode
        Thaw("c", monitor="acc", patience=1),  # same mode, other metric
        Thaw("d", monitor="val", patience=1, carry_best=True),
    ]
    phases = Phases(thaws)
    assert phases.carry == {"d": "a"}
    assert phases.observe({"val": 0.2}, [], "C") == []
    assert phases.observe({"val": 0.2}, [], "C") == ["a"]
    assert phases.observe({"val": 0.9}, ["a"], "C") == []
    assert phases.observe({"val": 0.9}, ["a"], "C") == ["b"]
    assert phases.observe({"acc": 0.9}, ["a", "b"], "C") == []
    assert phases.observe({"acc": 0.9}, ["a", "b"], "C") == ["c"]
    # a's best (0.2) carried: 0.3 is no improvement, and patience 1 fires at once.
    assert phases.observe({"val": 0.3}, ["a", "b", "c"], "C") == ["d"]


def test_a_warmup_group_of_one_parameter_keeps_its_lr_when_the_handle_lets_go() -> None:
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1))
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    thaw = Thaw("0", step=1, lr=0.2, warmup_ratio=0.5, warmup_steps=2)
    handle = IsolationSpec(freeze=["0"], thaw=[thaw]).apply(model, optimizer=opt)
    assert handle.step(epoch=0, step=1) == ["0"]
    assert opt.param_groups[1]["params"] == [model[0].weight]
    handle.restore(optimizers=False)  # before any optimizer step: the group stays, unramped
    assert opt.param_groups[1]["lr"] == 0.2
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
