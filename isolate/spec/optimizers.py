"""Optimizer surgery for a spec: frozen parameters out, thawed groups in, by identity, once.

An optimizer moves a parameter whose ``.grad`` is a zero tensor (weight decay, momentum), so
frozen parameters are taken out of the optimizers; a thawed group joins its optimizer as one
new param group, with the settings of the group its parameters came from (or a given lr).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn

import isolate.spec.lr_schedulers as lr_schedulers
from isolate._text import shown
from isolate.errors import IsolationTypeError, RestoreError, SpecError
from isolate.exposure import steps_without_grad, unwrap_optimizer, zero_grad_risks
from isolate.spec.clock import Shaper
from isolate.spec.plan import Group, Plan

__all__ = [
    "OptimizerLink",
    "Optimizers",
    "Placement",
    "Slot",
    "add_group",
    "as_optimizers",
    "place",
    "take_out",
]

Optimizers: TypeAlias = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
"""One optimizer, several, or none."""


@dataclass(frozen=True)
class Slot:
    """Where one parameter sits: optimizer ``opt``, param group ``group``."""

    opt: int
    group: int
    param: nn.Parameter


@dataclass
class Placement:
    """Which optimizer a thaw group joins, with which param-group settings, and the index of
    the param group its parameters came from (``None``: from no group)."""

    optimizer_idx: int
    options: dict[str, Any]
    source: int | None = None


def as_optimizers(obj: object, caller: str) -> list[torch.optim.Optimizer]:
    """A list of torch optimizers; wrappers with an ``.optimizer`` (Lightning, Fabric) are
    looked through, since they share the wrapped optimizer's param groups."""
    if obj is None:
        return []
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    out = []
    for item in items:
        try:
            out.append(unwrap_optimizer(item, caller))
        except IsolationTypeError:
            raise IsolationTypeError(
                f"{caller}: optimizer must be a torch.optim.Optimizer (or a list of them), got "
                f"{type(item).__name__}"
            ) from None
    return out


def risk(optimizer: torch.optim.Optimizer, group: int, param: torch.Tensor) -> str:
    """Why a zero gradient would move ``param`` in ``group`` (the rule of
    :func:`isolate.exposure.zero_grad_risks`), as text."""
    reasons = zero_grad_risks(optimizer, optimizer.param_groups[group], param)
    return "; ".join(reasons) if reasons else "no weight decay or optimizer state moves it now"


def find(ids: Mapping[int, str], optimizers: Sequence[torch.optim.Optimizer]) -> list[Slot]:
    """Every slot of the optimizers that holds one of the parameters in ``ids``."""
    return [
        Slot(oi, gi, p)
        for oi, opt in enumerate(optimizers)
        for gi, group in enumerate(opt.param_groups)
        for p in group["params"]
        if id(p) in ids
    ]


def place(
    plan: Plan, optimizers: Sequence[torch.optim.Optimizer], thawed: set[str], caller: str
) -> tuple[list[Slot], dict[str, Placement]]:
    """Where the frozen parameters sit, and where each thaw group will go; change nothing.

    ``thawed`` names the groups already thawed (from a checkpoint): their parameters are taken
    out too, and go back as their own param groups, in the order they were thawed.

    Raises:
        SpecError: an optimizer holds state for frozen parameters, ``frozen_in_optimizer`` is
            ``"error"`` and frozen parameters sit in an optimizer, or a thaw group has no
            unambiguous optimizer or settings.
    """
    ours = {id(p): n for n, p in plan.frozen.items()}
    thawed_ids = {id(p) for g in plan.groups if g.name in thawed for p in g.params.values()}
    held = find(ours, optimizers)
    stateful = [ours[id(s.param)] for s in held if optimizers[s.opt].state.get(s.param)]
    if stateful:
        raise SpecError(
            f"{caller}: the optimizer already holds state for frozen parameters "
            f"{shown(stateful)}; apply the spec before the first optimizer step (or build the "
            f"optimizer after applying it)"
        )
    frozen = [s for s in held if id(s.param) not in thawed_ids]
    if frozen and plan.spec.frozen_in_optimizer == "error":
        lines = [
            f"  {ours[id(s.param)]}: optimizer {s.opt}, param group {s.group} "
            f"({risk(optimizers[s.opt], s.group, s.param)})"
            for s in frozen[:8]
        ]
        raise SpecError(
            f"{caller}: {len(frozen)} frozen parameters sit in an optimizer, where a zero "
            f"gradient with weight decay or momentum can still move them:\n"
            + "\n".join(lines)
            + "\nFix: build the optimizer from trainable parameters only "
            "([p for p in model.parameters() if p.requires_grad]), or let the spec take them "
            "out with frozen_in_optimizer='remove'"
        )
    origin: dict[int, set[tuple[int, int]]] = {}
    for s in held:
        origin.setdefault(id(s.param), set()).add((s.opt, s.group))
    placements = {g.name: _target(g, optimizers, origin, caller) for g in plan.groups}
    for oi, opt in enumerate(optimizers):
        frozen_in = [ours[id(s.param)] for s in held if s.opt == oi]
        thawed_in = [n for n, pl in placements.items() if pl.optimizer_idx == oi]
        if steps_without_grad(opt) and (frozen_in or thawed_in):
            raise SpecError(
                f"{caller}: optimizer {oi} ({type(opt).__name__}) steps every parameter it was "
                f"built with along one flat search direction, in one param group: frozen "
                f"parameters cannot be taken out of it ({shown(frozen_in)}) nor thawed groups "
                f"added ({thawed_in}). Build it after apply from the trainable parameters only, "
                f"and leave thaws out of a spec it trains"
            )
    return held, placements


def _receiver(g: Group, count: int, homes: list[int], where: str) -> int:
    """Which of ``count`` optimizers receives group ``g`` once thawed: the one it names, else
    the one its parameters came from (``homes``), else the only one."""
    if g.thaw.optimizer_idx is not None:
        if g.thaw.optimizer_idx >= count:
            raise SpecError(
                f"{where}: optimizer_idx={g.thaw.optimizer_idx} but there are "
                f"{count} optimizer(s); its parameters {shown(g.params)} would be in "
                f"no optimizer once thawed"
            )
        return int(g.thaw.optimizer_idx)
    if len(homes) == 1:
        return homes[0]
    if len(homes) > 1:
        raise SpecError(
            f"{where}: its parameters sit in optimizers {homes}; say which one receives them "
            f"with optimizer_idx="
        )
    if count == 1:
        return 0
    raise SpecError(
        f"{where}: its parameters {shown(g.params)} are in no optimizer and there are "
        f"{count} optimizers, so once thawed they would be in no optimizer "
        f"(never learn); set optimizer_idx= in the thaw step"
        + ("" if count else ", and pass the optimizer")
    )


def _target(
    g: Group,
    optimizers: Sequence[torch.optim.Optimizer],
    origin: dict[int, set[tuple[int, int]]],
    caller: str,
) -> Placement:
    where = f"{caller}: thaw group {g.name!r}"
    slots: set[tuple[int, int]] = set().union(
        *(origin.get(id(p), set()) for p in g.params.values())
    )
    homes = sorted({oi for oi, _ in slots})
    absent = [n for n, p in g.params.items() if id(p) not in origin]
    target = _receiver(g, len(optimizers), homes, where)
    opt = optimizers[target]
    sources = sorted({gi for oi, gi in slots if oi == target})
    options: dict[str, Any] = {}
    if len(sources) != 1 and g.thaw.align and g.thaw.lr is None:
        sources = [0]  # align follows group 0 when the parameters came from no one group
    if len(sources) == 1:
        options = {k: v for k, v in opt.param_groups[sources[0]].items() if k != "params"}
    if g.thaw.lr is None:
        if (absent and not g.thaw.align) or len(sources) != 1:
            detail = (
                f"{shown(absent)} are in no optimizer group"
                if absent
                else f"come from param groups {sources} of optimizer {target}"
            )
            raise SpecError(
                f"{where}: lr is not set and its parameters {detail}, so there are no settings "
                f"to give them once thawed; set lr= in the thaw step, or put them in one param "
                f"group when building the optimizer (the spec takes them out while frozen)"
            )
    else:
        options["lr"] = float(g.thaw.lr)
    if any("initial_lr" in group for group in opt.param_groups) and (
        g.thaw.lr is not None or "initial_lr" not in options
    ):
        # A scheduler's base lr: the source group's own when lr is not set (its lr now may
        # already be scheduled down), else the thaw's lr.
        options["initial_lr"] = options.get("lr", opt.defaults.get("lr"))
    return Placement(target, options, sources[0] if len(sources) == 1 else None)


def take_out(optimizers: Sequence[torch.optim.Optimizer], held: Sequence[Slot]) -> None:
    """Remove the held parameters from their param groups (groups stay, maybe empty)."""
    drop = {id(s.param) for s in held}
    if not drop:
        return
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in drop]


def add_group(
    opt: torch.optim.Optimizer,
    params: Sequence[nn.Parameter],
    options: Mapping[str, Any],
    schedulers: Sequence[Any] = (),
    *,
    source: int | None = None,
) -> dict[str, Any]:
    """Add ``params`` as one new param group and give it its state in the schedulers of ``opt``.

    Every scheduler of ``opt`` schedules the new group like the group ``source`` (the one the
    parameters came from; group 0 when ``None``). The group joins where the schedule is: its
    lr is its base lr (``initial_lr``, else ``lr``) times the reference group's progress
    (:func:`isolate.spec.lr_schedulers.current_lr`). ``base_lrs`` gets the base lr, ``LambdaLR`` /
    ``MultiplicativeLR`` the source's lambda,
    ``CyclicLR`` / ``OneCycleLR`` the source's bounds scaled to the new base lr,
    ``ReduceLROnPlateau`` the source's ``min_lr``. A scheduler it cannot extend is refused
    before the group is added (see :mod:`isolate.spec.lr_schedulers`).

    Returns:
        The new param group.

    Raises:
        SpecError: a parameter is already in the optimizer, or a scheduler of ``opt`` cannot
            take a new group.

    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD([model.weight], lr=0.1)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> _ = add_group(opt, [model.bias], {"lr": 0.2, "initial_lr": 0.2}, [sched])
    >>> sched.base_lrs
    [0.1, 0.2]
    """
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    twice = [i for i, p in enumerate(params) if id(p) in held]
    if twice:
        raise SpecError(
            f"add_group(): {len(twice)} of the parameters are already in the optimizer; a "
            f"parameter must be in one param group only"
        )
    mine = lr_schedulers.of(opt, schedulers)
    for scheduler in mine:
        lr_schedulers.check(scheduler, source, "add_group()")
    opt.add_param_group({"params": list(params), **options})
    group = opt.param_groups[-1]
    base = float(group.get("initial_lr", group["lr"]))
    group["lr"] = lr_schedulers.current_lr(mine, opt, source, base)
    for scheduler in mine:
        lr_schedulers.extend(scheduler, opt, source, base)
    return group


class OptimizerLink:
    """The optimizers an applied spec is attached to, and what it changed in them."""

    def __init__(
        self,
        caller: str,
        warn: Callable[[str], None],
        now: Mapping[str, int],
    ) -> None:
        self.caller = caller
        self.warn = warn
        self.now = now  # where training is: the handle's position, read when a group steps
        self.shapers: dict[str, Shaper] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any] = []
        self.placements: dict[str, Placement] = {}
        self.attached = False
        self._before: list[tuple[torch.optim.Optimizer, list[list[nn.Parameter]]]] = []
        self._added: dict[str, tuple[torch.optim.Optimizer, dict[str, Any]]] = {}

    def attach(
        self,
        plan: Plan,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        thawed: Mapping[str, Mapping[str, int]],
        frozen: Mapping[str, nn.Parameter],
        *,
        warn: bool = True,
    ) -> None:
        """Take the frozen parameters out (saying so when ``warn``); re-add the groups in
        ``thawed`` (name -> where training was at its thaw), in that order.

        Attaching the same optimizers again only adds the schedulers not seen yet (checked
        first); other optimizers are refused, since the first attach already moved parameters.

        Raises:
            SpecError: as :func:`place`, a scheduler that cannot take a thawed group, or
                optimizers other than those attached already.
        """
        if self.attached:
            self._reattach(plan, optimizers, schedulers)
            return
        held, placements = place(plan, optimizers, set(thawed), self.caller)
        self._check_schedulers(plan, optimizers, placements, schedulers)
        self.attached = True
        self._before = [(o, [list(g["params"]) for g in o.param_groups]) for o in optimizers]
        self.optimizers, self.schedulers = list(optimizers), list(schedulers)
        self.placements = placements
        frozen_ids = {id(p) for p in frozen.values()}
        exposed = [s for s in held if id(s.param) in frozen_ids]
        take_out(optimizers, held)
        if exposed and warn:
            self._warn_removed(plan, exposed)
        for name, at in thawed.items():
            self.join(plan.group(name), None, None, at)

    def _check_schedulers(
        self,
        plan: Plan,
        optimizers: Sequence[torch.optim.Optimizer],
        placements: Mapping[str, Placement],
        schedulers: Sequence[Any],
    ) -> None:
        for i, scheduler in enumerate(schedulers if plan.groups else ()):
            if not any(lr_schedulers.of(o, [scheduler]) for o in optimizers):
                raise SpecError(
                    f"{self.caller}.attach(): schedulers[{i}] is {scheduler!r}, which drives "
                    f"none of the attached optimizers "
                    f"{[type(o).__name__ for o in optimizers]}, so a thawed group would never "
                    f"join its schedule; pass each LR scheduler itself (a Lightning config's "
                    f"'scheduler', not the config), built on an optimizer given to attach()"
                )
        for g in plan.groups:  # refuse before anything changes, not at the thaw
            where = f"{self.caller}: thaw group {g.name!r}"
            for scheduler in lr_schedulers.of(
                optimizers[placements[g.name].optimizer_idx], schedulers
            ):
                lr_schedulers.check(scheduler, placements[g.name].source, where)

    def _reattach(
        self, plan: Plan, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]
    ) -> None:
        if [id(o) for o in optimizers] != [id(o) for o in self.optimizers]:
            raise SpecError(
                f"{self.caller}.attach(): already attached to {len(self.optimizers)} "
                f"optimizer(s) {[type(o).__name__ for o in self.optimizers]}, and given "
                f"{[type(o).__name__ for o in optimizers]}; the first attach took the frozen "
                f"parameters out and planned the thawed groups. Attach once, with every "
                f"optimizer and its schedulers, or restore() and apply the spec again"
            )
        new = [s for s in schedulers if all(s is not t for t in self.schedulers)]
        self._check_schedulers(plan, self.optimizers, self.placements, new)
        self.schedulers += new

    def _warn_removed(self, plan: Plan, exposed: Sequence[Slot]) -> None:
        by_group: dict[tuple[int, int], list[str]] = {}
        first: dict[tuple[int, int], torch.Tensor] = {}
        for s in exposed:
            by_group.setdefault((s.opt, s.group), []).append(plan.names.name(s.param))
            first.setdefault((s.opt, s.group), s.param)
        lines = [
            f"  optimizer {oi}, param group {gi} "
            f"({risk(self.optimizers[oi], gi, first[(oi, gi)])}): {shown(names)}"
            for (oi, gi), names in by_group.items()
        ]
        self.warn(
            f"{self.caller}: took {len(exposed)} frozen parameters out of the optimizers, where "
            f"a zero gradient with weight decay or momentum could move them; a thaw step adds "
            f"them back as a new param group:\n"
            + "\n".join(lines)
            + "\nTo silence this, build the optimizer from trainable parameters only."
        )

    def join(
        self, g: Group, optimizer: object, lr: float | None, at: Mapping[str, int]
    ) -> dict[str, Any] | None:
        """Add thaw group ``g``, thawed at position ``at``, to its optimizer (or
        ``optimizer``: an index or the object)."""
        if not self.optimizers:
            return None
        index = self.placements[g.name].optimizer_idx
        if optimizer is not None:
            try:
                inner: object = unwrap_optimizer(optimizer, self.caller)
            except IsolationTypeError:
                inner = optimizer  # an index, or not an optimizer: refused below
            found = [i for i, o in enumerate(self.optimizers) if o is inner]
            index = optimizer if isinstance(optimizer, int) else (found[0] if found else -1)
            if not 0 <= index < len(self.optimizers):
                raise SpecError(
                    f"{self.caller}: thaw({g.name!r}, optimizer={optimizer!r}): not one of the "
                    f"{len(self.optimizers)} attached optimizers (an index or the object)"
                )
        placement = self.placements[g.name]
        options = dict(placement.options)
        if lr is not None:
            options["lr"] = float(lr)
            if "initial_lr" in options:
                options["initial_lr"] = float(lr)
        opt = self.optimizers[index]
        source = placement.source if index == placement.optimizer_idx else None
        if lr is None and g.thaw.lr is None and source is not None:
            now = opt.param_groups[source]
            if "initial_lr" not in now:
                # No base lr to scale by the schedule's progress (ReduceLROnPlateau keeps
                # none, or the lr was changed by hand): the source's lr now, not at attach.
                options["lr"] = now["lr"]
        group = add_group(opt, list(g.params.values()), options, self.schedulers, source=source)
        self._added[g.name] = (opt, group)
        if g.thaw.warmup_ratio is not None or g.thaw.align:
            reference = source if source is not None else 0
            self.shapers[g.name] = Shaper(opt, group, reference, g.thaw, self.now, dict(at))
        return group

    def unjoin(self, name: str) -> None:
        """Take the param group added for ``name`` out again."""
        shaper = self.shapers.pop(name, None)
        if shaper is not None:
            shaper.remove()
        added = self._added.pop(name, None)
        if added is not None:
            opt, group = added
            self._forget(opt, [i for i, g in enumerate(opt.param_groups) if g is group])
            opt.param_groups[:] = [g for g in opt.param_groups if g is not group]

    def _forget(self, opt: torch.optim.Optimizer, indices: Sequence[int]) -> None:
        """Take param groups ``indices`` of ``opt`` out of its schedulers' per-group state."""
        n = len(opt.param_groups)
        for index in sorted(indices, reverse=True):
            for scheduler in lr_schedulers.of(opt, self.schedulers):
                lr_schedulers.drop(scheduler, index, n)
            n -= 1

    def release(self) -> None:
        """Take the lr shapers' hooks off the optimizers (groups stay as they are)."""
        for shaper in self.shapers.values():
            shaper.remove()
        self.shapers.clear()

    def check_restore(self) -> None:
        """Raise what :meth:`restore` would; change nothing.

        Raises:
            RestoreError: an optimizer has fewer param groups than at :meth:`attach` (its
                groups can no longer be matched to what they held).
        """
        for i, (opt, groups) in enumerate(self._before):
            if len(opt.param_groups) < len(groups):
                raise RestoreError(
                    f"{self.caller}: optimizer {i} has {len(opt.param_groups)} param groups, "
                    f"fewer than the {len(groups)} it had when attached, so the parameters "
                    f"taken out of them cannot be put back; restore(optimizers=False) "
                    f"restores the rest and leaves the optimizers as they are"
                )

    def restore(self) -> None:
        """Put every param group back as it was at :meth:`attach` (:meth:`check_restore`
        first)."""
        self.check_restore()
        self.release()
        for opt, groups in self._before:
            self._forget(opt, range(len(groups), len(opt.param_groups)))
            del opt.param_groups[len(groups) :]
            for group, params in zip(opt.param_groups, groups, strict=True):
                group["params"] = params
        self._before.clear()
        self._added.clear()
        self.attached = False
