"""LR schedulers told about a param group that joins mid-training, or refused before training.

A torch scheduler keeps per-group state: ``base_lrs`` for all of them, and also
``LambdaLR.lr_lambdas``, ``CyclicLR.max_lrs``, ``ReduceLROnPlateau.min_lrs`` or
``OneCycleLR``'s ``initial_lr`` / ``max_lr`` / ``min_lr`` in each param group. A group that
joins without its entries is either skipped (a silent constant lr) or breaks the next
``scheduler.step()``. :func:`check` refuses, before anything changes, a scheduler whose state
this module does not know how to extend; :func:`extend` adds the new group's entries, taken
from the group the parameters came from (the *reference* group) and scaled to the new group's
base lr.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import lr_scheduler as lrs

from isolate.errors import IsolationTypeError, SpecError

__all__ = ["KNOWN", "as_schedulers", "check", "current_lr", "drop", "extend", "of"]

KNOWN: tuple[type[Any], ...] = (
    lrs.LambdaLR,
    lrs.MultiplicativeLR,
    lrs.StepLR,
    lrs.MultiStepLR,
    lrs.ConstantLR,
    lrs.LinearLR,
    lrs.ExponentialLR,
    lrs.PolynomialLR,
    lrs.CosineAnnealingLR,
    lrs.CosineAnnealingWarmRestarts,
    lrs.CyclicLR,
    lrs.OneCycleLR,
    lrs.ReduceLROnPlateau,
    lrs.SequentialLR,
    lrs.ChainedScheduler,
)
"""The scheduler classes whose per-group state a thawed group gets (exact classes: a subclass
may keep state of its own)."""

_MOMENTUM_KEYS = ("max_momentum", "base_momentum")


def as_schedulers(obj: object, caller: str) -> list[Any]:
    """A list of LR schedulers: ``None`` is none, a lone scheduler (anything that holds an
    ``.optimizer``) is one.

    Raises:
        IsolationTypeError: ``obj`` is neither a list or tuple nor a scheduler.
    """
    if obj is None:
        return []
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if hasattr(obj, "optimizer"):
        return [obj]
    raise IsolationTypeError(
        f"{caller}: schedulers must be an LR scheduler or a list of them, got "
        f"{type(obj).__name__}; pass each scheduler itself (a Lightning config's 'scheduler', "
        f"not the config)"
    )


def of(opt: torch.optim.Optimizer, schedulers: Sequence[Any]) -> list[Any]:
    """The schedulers among ``schedulers`` that drive ``opt``: built on it, or on a wrapper
    that holds it in ``.optimizer`` and shares its param groups (accelerate's
    ``AcceleratedOptimizer``, which transformers' ``Trainer`` builds its scheduler on).

    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> class Wrapper(torch.optim.Optimizer):  # no super().__init__, as accelerate's
    ...     def __init__(self, optimizer):
    ...         self.optimizer = optimizer
    ...         self.param_groups = optimizer.param_groups
    >>> sched = lrs.StepLR(Wrapper(opt), step_size=1)
    >>> of(opt, [sched]) == [sched]
    True
    """
    return [s for s in schedulers if _drives(getattr(s, "optimizer", None), opt)]


def _drives(held: object, opt: torch.optim.Optimizer) -> bool:
    seen: set[int] = set()
    while held is not None and id(held) not in seen:
        if held is opt:
            return True
        seen.add(id(held))
        held = getattr(held, "optimizer", None)
    return False


def _children(scheduler: Any) -> list[Any]:
    return list(getattr(scheduler, "_schedulers", []))


def check(scheduler: Any, source: int | None, caller: str) -> None:
    """Refuse a scheduler that cannot schedule a new group, naming it and the fix.

    Args:
        scheduler: a scheduler of the optimizer the group joins.
        source: the index of the param group the thawed parameters came from, or ``None``.
        caller: who asks, for the message.

    Raises:
        SpecError: an unknown scheduler class, or per-group lambdas that differ while the
            parameters came from no group (so there is no lambda to give them).

    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> check(lrs.StepLR(opt, step_size=1), None, "doc")
    >>> class Mine(lrs.LRScheduler):
    ...     def get_lr(self):
    ...         return self.base_lrs
    >>> check(Mine(opt), None, "doc")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    isolate.errors.SpecError: doc: the LR scheduler Mine cannot schedule a thawed param group...
    """
    kind = type(scheduler)
    if kind not in KNOWN:
        known = ", ".join(k.__name__ for k in KNOWN)
        raise SpecError(
            f"{caller}: the LR scheduler {kind.__name__} cannot schedule a thawed param group: "
            f"isolate does not know its per-group state, and a group it does not know would "
            f"keep a constant lr or break its next step. Fix: use one of {known} (a LambdaLR "
            f"expresses any shape), or keep these parameters in the optimizer from the start "
            f"instead of thawing them"
        )
    for child in _children(scheduler):
        check(child, source, caller)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if source is None and isinstance(lambdas, list) and len({id(f) for f in lambdas}) > 1:
        raise SpecError(
            f"{caller}: {kind.__name__} has a different lambda per param group, and the "
            f"thawed parameters came from no group, so there is no lambda to give them. Fix: "
            f"build the optimizer with them (in the group whose lambda they should follow; "
            f"the spec takes them out while frozen), or use a single lr_lambda"
        )


def extend(scheduler: Any, opt: torch.optim.Optimizer, source: int | None, base_lr: float) -> None:
    """Add the entries of ``opt``'s last param group (just added) to ``scheduler``.

    The new group follows the reference group (``source``, or group 0): the same lambda, the
    same cycle and momentum bounds scaled by ``base_lr / base_lr_of_reference``, the same
    ``min_lr`` floor.

    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD([model.weight], lr=0.1)
    >>> sched = lrs.LambdaLR(opt, lambda epoch: 0.5**epoch)
    >>> opt.add_param_group({"params": [model.bias], "lr": 0.2, "initial_lr": 0.2})
    >>> extend(sched, opt, None, 0.2)
    >>> opt.step(); sched.step()
    >>> [g["lr"] for g in opt.param_groups]
    [0.05, 0.1]
    """
    group = opt.param_groups[-1]
    n = len(opt.param_groups) - 1  # groups the scheduler knew
    ref = source if source is not None else 0
    for child in _children(scheduler):
        extend(child, opt, source, base_lr)
    _append(scheduler, "_last_lr", n, group["lr"])
    if isinstance(scheduler, lrs.ReduceLROnPlateau):
        _append(scheduler, "min_lrs", n, scheduler.min_lrs[ref])
        return
    ref_base = _at(getattr(scheduler, "base_lrs", None), ref, base_lr)
    scale = base_lr / ref_base if ref_base else 1.0
    _append(scheduler, "base_lrs", n, base_lr)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if isinstance(lambdas, list) and len(lambdas) == n:
        lambdas.append(lambdas[ref])
    if isinstance(scheduler, lrs.CyclicLR):
        _append(scheduler, "max_lrs", n, scheduler.max_lrs[ref] * scale)
        for key in ("base_momentums", "max_momentums"):
            values = getattr(scheduler, key, None)
            if isinstance(values, list):
                _append(scheduler, key, n, values[ref])
    if isinstance(scheduler, lrs.OneCycleLR):
        ref_group = opt.param_groups[ref]
        scale = base_lr / ref_group["initial_lr"] if ref_group["initial_lr"] else 1.0
        group["initial_lr"] = base_lr
        group["max_lr"] = ref_group["max_lr"] * scale
        group["min_lr"] = ref_group["min_lr"] * scale
    if isinstance(scheduler, (lrs.CyclicLR, lrs.OneCycleLR)):
        for key in _MOMENTUM_KEYS:
            if key in opt.param_groups[ref]:
                group.setdefault(key, opt.param_groups[ref][key])


def current_lr(
    schedulers: Sequence[Any], opt: torch.optim.Optimizer, source: int | None, base_lr: float
) -> float:
    """The lr the schedulers give a group of base lr ``base_lr`` now: the reference group's
    progress (its lr over its base lr) applied to ``base_lr``, so a group that joins mid-way
    through a warm-up or a decay is where the schedule is, not at its base (a chainable
    scheduler such as ``LinearLR`` would otherwise carry it past its base lr). With an
    ``eta_min`` (cosine schedules) the progress is measured above it.

    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD([model.weight], lr=0.1)
    >>> sched = lrs.LinearLR(opt, start_factor=0.5, total_iters=4)
    >>> round(current_lr([sched], opt, None, 0.02), 6)
    0.01
    """
    ref = opt.param_groups[source if source is not None else 0]
    base = ref.get("initial_lr")
    if not schedulers or not base:
        return base_lr
    floor = float(getattr(schedulers[0], "eta_min", 0.0) or 0.0)
    if len(schedulers) > 1 or floor >= min(base, base_lr):
        floor = 0.0
    return floor + (base_lr - floor) * (float(ref["lr"]) - floor) / (float(base) - floor)


_PER_GROUP = (
    "base_lrs",
    "lr_lambdas",
    "max_lrs",
    "min_lrs",
    "_last_lr",
    "base_momentums",
    "max_momentums",
)


def drop(scheduler: Any, index: int, n: int) -> None:
    """Take entry ``index`` out of the per-group lists that have ``n`` entries (the group is
    leaving the optimizer: an undone thaw, or ``restore``)."""
    for child in _children(scheduler):
        drop(child, index, n)
    for name in _PER_GROUP:
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and len(values) == n:
            del values[index]


def _at(values: object, index: int, default: float) -> float:
    if isinstance(values, list) and index < len(values):
        return float(values[index])
    return default


def _append(scheduler: Any, attribute: str, n: int, value: Any) -> None:
    values = getattr(scheduler, attribute, None)
    if isinstance(values, list) and len(values) == n:
        values.append(value)
