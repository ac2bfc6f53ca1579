"""Thaw schedules over time: every scheduler kind schedules a thawed group (or is refused
before training), the warm-up ramp and align act inside optimizer.step only, plateau phases
follow EarlyStopping's rule, and the default schedule command writes a spec that applies.

Plain loops on a two-layer net: layer 0 frozen and thawed, layer 1 trains from the start.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import yaml
from pytorch_lightning.callbacks import EarlyStopping
from torch import nn
from torch.optim import lr_scheduler as L

from isolate import IsolationSpec, Thaw
from isolate.cli import main
from isolate.errors import CheckpointMismatchError, SpecError
from isolate.interop.schedules import default_schedule
from isolate.spec.clock import Plateau, ramp
from tests._launch import REPO, child_env
from tests.interop._schedule_models import Tower


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))


def train(
    model: nn.Module,
    spec: IsolationSpec,
    opt: torch.optim.Optimizer,
    scheduler: Any,
    steps: int,
    *,
    per_epoch: int = 1,
) -> tuple[list[list[float]], list[list[float]]]:
    """Run ``steps`` optimizer steps; return each group's lr as the step used it (read by a
    post-hook registered before the spec's) and as the scheduler left it after the step."""
    used: list[list[float]] = []
    opt.register_step_post_hook(lambda o, *_: used.append([g["lr"] for g in o.param_groups]))
    handle = spec.apply(model)
    handle.attach(opt, [scheduler] if scheduler is not None else [])
    after: list[list[float]] = []
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(steps):
            handle.step(epoch=step // per_epoch, step=step)
            model(torch.randn(4, 2, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if isinstance(scheduler, L.ReduceLROnPlateau):
                scheduler.step(float(step))  # worse every time: reduces every step
            elif scheduler is not None:
                scheduler.step()
            after.append([gr["lr"] for gr in opt.param_groups])
    finally:
        handle.restore()
    return used, after


SCHEDULERS: dict[str, tuple[Callable[[torch.optim.Optimizer], Any], float]] = {
    # factory, and the thawed group's lr over group 0's once it has joined (base 0.05 over
    # group 0's base: 0.1, or the cycle's start 0.01 / OneCycleLR's 0.1 / 25)
    "LambdaLR": (lambda o: L.LambdaLR(o, lambda s: 0.9**s), 0.5),
    "MultiplicativeLR": (lambda o: L.MultiplicativeLR(o, lambda s: 0.9), 0.5),
    "StepLR": (lambda o: L.StepLR(o, 2, 0.5), 0.5),
    "MultiStepLR": (lambda o: L.MultiStepLR(o, [3, 6], 0.5), 0.5),
    "ConstantLR": (lambda o: L.ConstantLR(o, 0.5, total_iters=6), 0.5),
    "LinearLR": (lambda o: L.LinearLR(o, 0.2, 1.0, total_iters=8), 0.5),
    "ExponentialLR": (lambda o: L.ExponentialLR(o, 0.8), 0.5),
    "PolynomialLR": (lambda o: L.PolynomialLR(o, 20, 2.0), 0.5),
    "CosineAnnealingLR": (lambda o: L.CosineAnnealingLR(o, 20), 0.5),
    "CosineAnnealingLR-eta_min": (lambda o: L.CosineAnnealingLR(o, 20, eta_min=0.01), math.nan),
    "CosineAnnealingWarmRestarts": (lambda o: L.CosineAnnealingWarmRestarts(o, 4), 0.5),
    "CyclicLR": (lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=3), 5.0),
    "OneCycleLR": (lambda o: L.OneCycleLR(o, 0.1, total_steps=20), 12.5),
    "ReduceLROnPlateau": (lambda o: L.ReduceLROnPlateau(o, patience=0, factor=0.5), math.nan),
    "SequentialLR": (
        lambda o: L.SequentialLR(
            o, [L.LinearLR(o, 0.5, total_iters=3), L.ExponentialLR(o, 0.8)], [3]
        ),
        0.5,
    ),
    "ChainedScheduler": (
        lambda o: L.ChainedScheduler([L.ExponentialLR(o, 0.9), L.StepLR(o, 3, 0.5)]),
        0.5,
    ),
}


@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_every_known_scheduler_schedules_a_thawed_group(kind: str) -> None:
    factory, ratio = SCHEDULERS[kind]
    model = net()
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)
    scheduler = factory(opt)
    spec = IsolationSpec(freeze=["0"], thaw=[Thaw("0", step=4, lr=0.05)])
    used, _ = train(model, spec, opt, scheduler, 14)
    assert [len(u) for u in used] == [1] * 4 + [2] * 10
    head = [u[0] for u in used[4:]]
    thawed = [u[1] for u in used[4:]]
    assert len(set(thawed)) > 1  # scheduled: never a constant lr
    if kind == "CosineAnnealingLR-eta_min":  # the cosine factor above the floor is shared
        progress = [(h - 0.01) / (0.1 - 0.01) for h in head]
        assert thawed == pytest.approx([0.01 + (0.05 - 0.01) * p for p in progress])
    elif kind == "ReduceLROnPlateau":  # joins at its lr, then halves with the others
        assert thawed == pytest.approx([0.05 * 0.5**i for i in range(10)])
        assert scheduler.min_lrs == [0]  # restored with the group
    else:
        assert [t / h for t, h in zip(thawed, head, strict=True)] == pytest.approx([ratio] * 10)
    lists = ["base_lrs", "lr_lambdas", "max_lrs", "min_lrs", "_last_lr", "base_momentums"]
    for child in [scheduler, *getattr(scheduler, "_schedulers", [])]:
        for name in lists:
            value = getattr(child, name, None)
            assert value is None or len(value) == 1, (child, name)  # restored with the group


def test_an_unknown_scheduler_is_refused_at_attach_before_anything_changes() -> None:
    class Warmup(L.LRScheduler):  # per-group state isolate cannot know
        def get_lr(self) -> list[float]:
            return [b * min(1.0, (self.last_epoch + 1) / 5) for b in self.base_lrs]

    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = Warmup(opt)
    spec = IsolationSpec(freeze=["0"], thaw=[Thaw("0", epoch=1)])
    handle = spec.apply(model)
    groups = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(SpecError, match=r"thaw group '0': the LR scheduler Warmup cannot schedule"):
        handle.attach(opt, [scheduler])
    assert [list(g["params"]) for g in opt.param_groups] == groups  # not taken out
    handle.restore()
    # Per-group lambdas and parameters that were in no group: no lambda to give them.
    model = net()
    opt = torch.optim.SGD([{"params": [model[1].weight]}, {"params": [model[1].bias]}], lr=0.1)
    scheduler = L.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5])
    handle = IsolationSpec(freeze=["0"], thaw=[Thaw("0", epoch=1, lr=0.1)]).apply(model)
    with pytest.raises(SpecError, match=r"different lambda per param group"):
        handle.attach(opt, [scheduler])
    handle.restore()


def test_warmup_ramps_inside_the_step_and_the_group_keeps_its_lr() -> None:
    model = net()
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
    model = net()
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
    model = net()
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    handle = spec.apply(model, opt)
    for step in range(3):
        handle.step(epoch=0, step=step)
    state, opt_state = handle.state_dict(), opt.state_dict()
    handle.restore()
    model2 = net()
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
    handle = spec.apply(net())
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
    resumed = spec.apply(net())
    resumed.load_state_dict(state)
    assert resumed.observe({"val": 1.0}) == ["0.weight"]
    assert resumed.observe({"loss": 1.0}) == []  # nothing watches until the thaw
    resumed.restore()
    # The latest epoch thaws without a plateau; a missing metric and a state of other
    # monitors are refused.
    latest = spec.apply(net())
    with pytest.raises(
        SpecError, match=r"monitors 'val', which is not among the logged metrics \['loss'\]"
    ):
        latest.observe({"loss": 1.0})
    assert latest.due(epoch=9, step=0) == ["0.bias"]
    bad = dict(state, phases={"fired": [], "plateaus": {}})
    with pytest.raises(CheckpointMismatchError, match="plateau state"):
        latest.load_state_dict(bad)
    latest.restore()


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"epoch": 1, "warmup_ratio": 0.1},
            r"needs exactly one of warmup_steps= or warmup_epochs=",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0, "warmup_steps": 2},
            r"warmup_ratio must be a number in \(0, 1\]",
        ),
        ({"epoch": 1, "warmup_steps": 2}, r"need warmup_ratio="),
        (
            {"epoch": 1, "warmup_ratio": 0.5, "warmup_steps": 2, "warmup_shape": "step"},
            r"warmup_shape must be",
        ),
        ({"epoch": 1, "align": True, "lr": 0.1}, r"align=True follows the lr of the group"),
        ({"monitor": "val", "patience": 0}, r"patience must be an integer >= 1"),
        ({"epoch": 1, "patience": 5}, r"\['patience'\] apply to monitor="),
        ({"monitor": "val", "mode": "up"}, r"mode must be 'min' or 'max'"),
        ({}, r"give exactly one of epoch= or step= \(or monitor="),
    ],
)
def test_bad_thaw_fields_are_refused_by_name(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        Thaw.from_dict({"select": "0", **keys})


def test_default_schedule_thaws_one_block_per_phase_from_the_head_back() -> None:
    schedule = default_schedule(Tower(), patience=2)
    assert schedule["freeze"] == ["model.stem", "model.stage0", "model.stage1", "model.stage2"]
    assert [t["select"] for t in schedule["thaw"]] == [
        "model.stage2",
        "model.stage1",
        "model.stage0",
        "model.stem",
    ]
    assert all(t["monitor"] == "val_loss" and t["patience"] == 2 for t in schedule["thaw"])
    with pytest.raises(SpecError, match=r"has 0 top-level block"):
        default_schedule(nn.Sequential(nn.Linear(2, 2)))


def test_schedule_command_writes_yaml_that_applies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "tests.interop._schedule_models:build_tower", "--by-epoch"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "# Default isolate schedule for tests.interop._schedule_models:build_tower (Tower)"
    )
    spec = IsolationSpec.from_dict(yaml.safe_load(out))
    model = Tower()
    with spec.applied(model) as handle:
        assert [n for n, p in model.named_parameters() if p.requires_grad] == [
            "model.head.weight",
            "model.head.bias",
        ]
        for epoch in range(1, 5):
            handle.step(epoch=epoch, step=0)
        assert all(p.requires_grad for p in model.parameters())
        assert handle.thawed == ("model.stage2", "model.stage1", "model.stage0", "model.stem")


@pytest.mark.slow
def test_schedule_command_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "isolate", "schedule", "tests.interop._schedule_models:build_tower"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    thaw = yaml.safe_load(out)["thaw"]
    assert thaw[0] == {"select": "model.stage2", "monitor": "val_loss", "patience": 3}


def test_align_follows_the_source_group_whatever_changes_it() -> None:
    model = net()
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
