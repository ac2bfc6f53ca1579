"""LR schedulers and a thawed group: every scheduler kind torch ships schedules a group that
joins mid-training, and one whose per-group state isolate cannot know is refused at attach,
before anything changes.

Plain loops on a two-layer net: layer 0 frozen and thawed, layer 1 trains from the start.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as L

from isolate import IsolationSpec, Thaw
from isolate.errors import SpecError
from isolate.spec.lr_schedulers import KNOWN, check, current_lr, extend, of
from isolate.spec.optimizers import add_group
from tests.spec._models import train, two_layers

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
    model = two_layers()
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

    model = two_layers()
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
    model = two_layers()
    opt = torch.optim.SGD([{"params": [model[1].weight]}, {"params": [model[1].bias]}], lr=0.1)
    scheduler = L.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5])
    handle = IsolationSpec(freeze=["0"], thaw=[Thaw("0", epoch=1, lr=0.1)]).apply(model)
    with pytest.raises(SpecError, match=r"different lambda per param group"):
        handle.attach(opt, [scheduler])
    handle.restore()


def test_a_group_added_to_a_sequential_scheduler_follows_its_source_group() -> None:
    model, extra = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)
    opt.add_param_group({"params": [model.bias], "lr": 0.1})
    halving = L.LambdaLR(opt, [lambda epoch: 1.0, lambda epoch: 0.5**epoch])
    flat = L.LambdaLR(opt, [lambda epoch: 1.0, lambda epoch: 1.0])
    scheduler = L.SequentialLR(opt, [halving, flat], milestones=[5])
    opt.add_param_group({"params": [extra.weight], "lr": 0.2, "initial_lr": 0.2})
    extend(scheduler, opt, 1, 0.2)  # the new group follows group 1, not group 0
    assert scheduler.get_last_lr() == [0.1, 0.1, 0.2]
    opt.step()
    scheduler.step()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05, 0.1]


def test_a_thawed_group_gets_the_floor_of_its_source_group_under_a_plateau_scheduler() -> None:
    # Per-group floors (a list): torch cannot fill in a floor for a group it was not told of.
    model = two_layers()
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    scheduler = L.ReduceLROnPlateau(opt, patience=0, factor=0.5, min_lr=[0.02])
    spec = IsolationSpec(freeze=["0"], thaw=[Thaw("0", step=2, lr=0.08)])
    used, after = train(model, spec, opt, scheduler, 6)
    assert [u[0] for u in used] == pytest.approx([0.1, 0.1, 0.05, 0.025, 0.02, 0.02])
    assert [u[1] for u in used[2:]] == pytest.approx([0.08, 0.04, 0.02, 0.02])
    assert after[-1] == pytest.approx([0.02, 0.02])
    assert scheduler.min_lrs == [0.02]  # restored with the group


def test_a_scheduler_that_never_knew_the_source_group_is_left_as_it_is() -> None:
    # A group added to the optimizer behind the scheduler's back: the scheduler has no entry
    # to copy for a group that comes from it, and no list of the optimizer's length to extend.
    model, extra = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)
    scheduler = L.StepLR(opt, step_size=1, gamma=0.5)
    opt.add_param_group({"params": [model.bias], "lr": 0.1})
    opt.add_param_group({"params": [extra.weight], "lr": 0.2, "initial_lr": 0.2})
    extend(scheduler, opt, 1, 0.2)
    assert scheduler.base_lrs == [0.1]
    assert scheduler.get_last_lr() == [0.1]


class Held:
    """Holds an optimizer in ``.optimizer``, as accelerate's ``AcceleratedOptimizer`` does;
    counts the reads, so that a chain that loops is seen followed once around."""

    def __init__(self, optimizer: object = None) -> None:
        self.held, self.reads = optimizer, 0

    @property
    def optimizer(self) -> object:
        self.reads += 1
        assert self.reads <= 1, "followed twice"
        return self.held


def test_the_schedulers_of_an_optimizer_are_found_through_wrappers_and_loops_end() -> None:
    opt, other = (torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1) for _ in "ab")
    plain = L.StepLR(opt, 1)
    wrapped = L.StepLR(opt, 1)
    wrapped.optimizer = Held(Held(opt))  # type: ignore[assignment]
    elsewhere = L.StepLR(other, 1)
    a, b = Held(), Held()
    a.held, b.held = b, a  # a loop of wrappers that never reaches an optimizer
    looping = L.StepLR(opt, 1)
    looping.optimizer = a  # type: ignore[assignment]
    assert of(opt, [plain, wrapped, elsewhere, looping, object()]) == [plain, wrapped]
    assert (a.reads, b.reads) == (1, 1)


def test_an_unknown_scheduler_is_refused_with_the_list_of_known_ones() -> None:
    class Mine(L.LRScheduler):
        def get_lr(self) -> list[float]:
            return list(self.base_lrs)

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    known = ", ".join(k.__name__ for k in KNOWN)
    assert known.startswith("LambdaLR, MultiplicativeLR, StepLR, ")
    with pytest.raises(SpecError) as caught:
        check(Mine(opt), None, "fit()")
    assert str(caught.value) == (
        "fit(): the LR scheduler Mine cannot schedule a thawed param group: isolate does not "
        "know its per-group state, and a group it does not know would keep a constant lr or "
        f"break its next step. Fix: use one of {known} (a LambdaLR expresses any shape), or "
        "keep these parameters in the optimizer from the start instead of thawing them"
    )
    # Inside a scheduler that holds others, each is checked, and named in the caller's name.
    inner = L.SequentialLR(opt, [Mine(opt), L.ExponentialLR(opt, 0.9)], milestones=[2])
    with pytest.raises(SpecError, match=r"^fit\(\): the LR scheduler Mine cannot"):
        check(inner, None, "fit()")


def test_per_group_lambdas_inside_a_chain_follow_the_source_group() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    chain = L.ChainedScheduler([L.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5**s])])
    check(chain, 1, "fit()")  # the group came from group 1: it takes its lambda
    with pytest.raises(SpecError, match=r"^fit\(\): LambdaLR has a different lambda"):
        check(chain, None, "fit()")


def test_a_reference_group_whose_base_lr_is_zero_gives_its_bounds_unscaled() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([model.weight], lr=0.0)
    cyclic = L.CyclicLR(opt, 0.0, 0.1, step_size_up=2, cycle_momentum=False)
    opt.add_param_group({"params": [model.bias], "lr": 0.05, "initial_lr": 0.05})
    extend(cyclic, opt, 0, 0.05)
    assert cyclic.base_lrs == [0.0, 0.05]
    assert cyclic.max_lrs == [0.1, 0.1]
    # OneCycleLR warming up from zero (div_factor=inf): the peak is the reference's.
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)
    one = L.OneCycleLR(opt, 0.1, total_steps=10, div_factor=math.inf, cycle_momentum=False)
    opt.add_param_group({"params": [model.bias], "lr": 0.05, "initial_lr": 0.05})
    extend(one, opt, None, 0.05)
    added = opt.param_groups[1]
    assert (added["initial_lr"], added["max_lr"], added["min_lr"]) == (0.05, 0.1, 0.0)


def test_a_group_added_without_initial_lr_gets_one_cycles_entries() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)
    one = L.OneCycleLR(opt, 0.1, total_steps=10, cycle_momentum=False)  # starts at 0.1 / 25
    group = add_group(opt, [model.bias], {"lr": 0.2}, [one])
    assert group["initial_lr"] == 0.2
    assert group["max_lr"] == pytest.approx(0.1 * 0.2 / 0.004)
    assert group["lr"] == pytest.approx(0.2)
    opt.step()
    one.step()
    assert group["lr"] / opt.param_groups[0]["lr"] == pytest.approx(0.2 / 0.004)


def test_a_group_joins_where_its_source_group_is_in_the_schedule() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    halving = L.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5**s])
    for _ in range(2):
        opt.step()
        halving.step()
    assert current_lr([halving], opt, 1, 0.2) == pytest.approx(0.05)  # a quarter, as group 1
    assert current_lr([halving], opt, None, 0.2) == pytest.approx(0.2)  # as group 0


@pytest.mark.parametrize(
    "factory",
    [lambda o: L.LinearLR(o, 0.5, total_iters=4), lambda o: L.CosineAnnealingLR(o, 2, eta_min=0)],
    ids=["LinearLR", "CosineAnnealingLR-eta_min=0"],
)
def test_without_a_floor_the_progress_is_a_plain_ratio_at_any_lr(
    factory: Callable[[torch.optim.Optimizer], Any],
) -> None:
    # lrs above 1 so that no floor of 1 would be dropped as too high
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=2.0)
    scheduler = factory(opt)
    opt.step()
    scheduler.step()
    progress = opt.param_groups[0]["lr"] / 2.0
    assert 0 < progress < 1
    assert current_lr([scheduler], opt, None, 4.0) == pytest.approx(4.0 * progress)


def test_a_floor_is_measured_above_only_for_one_scheduler_below_both_base_lrs() -> None:
    def after_a_step(*factories: Callable[[torch.optim.Optimizer], Any]) -> tuple[Any, ...]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        schedulers = [f(opt) for f in factories]
        opt.step()
        for scheduler in schedulers:
            scheduler.step()
        return opt, schedulers, opt.param_groups[0]["lr"] / 0.1

    def cosine(eta_min: float) -> Callable[[torch.optim.Optimizer], Any]:
        return lambda o: L.CosineAnnealingLR(o, 4, eta_min=eta_min)

    opt, schedulers, progress = after_a_step(cosine(0.01))
    floored = 0.01 + (0.04 - 0.01) * (0.1 * progress - 0.01) / (0.1 - 0.01)
    assert current_lr(schedulers, opt, None, 0.04) == pytest.approx(floored)
    # Two schedulers: whose floor would it be? None: the plain ratio.
    opt, schedulers, progress = after_a_step(cosine(0.01), lambda o: L.StepLR(o, 1, 0.5))
    assert current_lr(schedulers, opt, None, 0.04) == pytest.approx(0.04 * progress)
    # A floor at or above the new group's base lr: the plain ratio.
    opt, schedulers, progress = after_a_step(cosine(0.05))
    assert current_lr(schedulers, opt, None, 0.02) == pytest.approx(0.02 * progress)
    opt, schedulers, progress = after_a_step(cosine(0.02))
    assert current_lr(schedulers, opt, None, 0.02) == pytest.approx(0.02 * progress)
    opt, schedulers, progress = after_a_step(cosine(0.1))  # the floor is the reference's lr
    assert current_lr(schedulers, opt, None, 0.04) == pytest.approx(0.04)
