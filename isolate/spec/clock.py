"""The thaw schedule over time: lr ramps of thawed groups, and phases that end on a plateau.

* :func:`ramp` is the warm-up factor of a :class:`~isolate.spec.Thaw` (``warmup_ratio``,
  ``warmup_steps`` / ``warmup_epochs``, ``warmup_shape``); :class:`Shaper` applies it (and
  ``align``) to a thawed param group inside ``optimizer.step()`` only, through the
  optimizer's step pre- and post-hooks, so schedulers, checkpoints and resumes see the
  unramped lr and whatever scheduler drives the optimizer keeps working.
* :class:`Plateau` is Lightning's ``EarlyStopping`` rule (``patience`` checks without an
  improvement larger than ``min_delta`` in direction ``mode``); :class:`Phases` runs one per
  ``monitor`` thaw, in schedule order, and says which became due. Nothing here ends a run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch.utils.hooks import RemovableHandle

from isolate.errors import CheckpointMismatchError, SpecError
from isolate.spec.thaw import Thaw

__all__ = ["Phases", "Plateau", "Shaper", "ramp", "require_forward"]


def ramp(thaw: Thaw, *, steps: int, epochs: int) -> float:
    """The warm-up factor of ``thaw``'s group, ``steps`` optimizer steps and ``epochs``
    epochs after its thaw: ``warmup_ratio`` at the thaw, 1 once the ramp is over.

    >>> t = Thaw("trunk", epoch=1, warmup_ratio=0.1, warmup_steps=4)
    >>> [round(ramp(t, steps=s, epochs=0), 3) for s in range(6)]
    [0.1, 0.325, 0.55, 0.775, 1.0, 1.0]
    >>> t = Thaw("trunk", epoch=1, warmup_ratio=0.01, warmup_epochs=2, warmup_shape="exponential")
    >>> [round(ramp(t, steps=0, epochs=e), 3) for e in range(3)]
    [0.01, 0.1, 1.0]
    """
    ratio = thaw.warmup_ratio
    if ratio is None:
        return 1.0
    if thaw.warmup_steps is not None:
        progress = steps / thaw.warmup_steps
    else:
        progress = epochs / (thaw.warmup_epochs or 1)
    progress = min(max(progress, 0.0), 1.0)
    if thaw.warmup_shape == "exponential":
        return float(ratio ** (1.0 - progress))
    if thaw.warmup_shape == "cosine":
        progress = (1.0 - math.cos(math.pi * progress)) / 2.0
    return ratio + (1.0 - ratio) * progress


class Shaper:
    """Sets a thawed group's lr for the duration of each ``optimizer.step()``.

    Before the step the group's lr becomes ``ramp(t) * lr``, where ``lr`` is the group's own
    (as the scheduler left it) or, with ``align``, the current lr of the reference group;
    after the step the group's own value is put back exactly. The group is found by its
    first parameter at each step, since ``optimizer.load_state_dict`` (a resume) replaces the
    param-group dicts.

    Args:
        opt: the optimizer.
        group: the thawed param group (a dict in ``opt.param_groups``).
        reference: the index of the group to follow with ``align`` (where the parameters came
            from).
        thaw: the step's declaration.
        now: where training is (read at each step; the handle keeps it current).
        at: where training was at the thaw.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        group: dict[str, Any],
        reference: int,
        thaw: Thaw,
        now: Mapping[str, int],
        at: Mapping[str, int],
    ) -> None:
        self.opt, self.reference, self.thaw = opt, reference, thaw
        self.now, self.at = now, at
        self._param = group["params"][0]
        self._group = group
        self._saved: float | None = None
        self._hooks: list[RemovableHandle] = [
            opt.register_step_pre_hook(self._pre),
            opt.register_step_post_hook(self._post),
        ]

    def group(self) -> dict[str, Any]:
        """The thawed param group as the optimizer holds it now."""
        groups = self.opt.param_groups
        if not any(g is self._group for g in groups):
            self._group = next(g for g in groups if any(p is self._param for p in g["params"]))
        return self._group

    def lr(self) -> float:
        """The lr the group steps with now."""
        now, at = self.now, self.at
        factor = ramp(
            self.thaw,
            steps=now["global_step"] - at["global_step"],
            epochs=now["epoch"] - at["epoch"],
        )
        source = self.opt.param_groups[self.reference] if self.thaw.align else self.group()
        return float(source["lr"]) * factor

    def _pre(self, *_: Any) -> None:
        group = self.group()
        lr = self.lr()
        self._saved, group["lr"] = group["lr"], lr

    def _post(self, *_: Any) -> None:
        if self._saved is not None:
            self.group()["lr"], self._saved = self._saved, None

    def remove(self) -> None:
        """Take the hooks off (the group keeps its own, unramped lr)."""
        self._post()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


class Plateau:
    """Lightning's ``EarlyStopping`` rule for one metric, without stopping anything.

    An improvement is a value below ``best - min_delta`` (``mode="min"``) or above
    ``best + min_delta`` (``"max"``); ``patience`` checks in a row without one make it fire.
    A NaN or infinite value counts as no improvement (``EarlyStopping`` would stop the run).

    >>> p = Plateau("val_loss", patience=2, min_delta=0.1, mode="min")
    >>> [p.update(v) for v in (1.0, 0.8, 0.75, 0.72)]
    [False, False, False, True]
    """

    def __init__(self, monitor: str, *, patience: int, min_delta: float, mode: str) -> None:
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0

    @property
    def fresh(self) -> bool:
        """Whether no check has been taken yet."""
        return self.wait == 0 and self.best == (math.inf if self.mode == "min" else -math.inf)

    def update(self, value: float) -> bool:
        """Take one check's value; whether the metric has now stopped improving."""
        improved = math.isfinite(value) and (  # EarlyStopping's comparison, term for term
            value + self.min_delta < self.best
            if self.mode == "min"
            else value - self.min_delta > self.best
        )
        if improved:
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        return self.wait >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": float(self.best), "wait": int(self.wait)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.wait = float(state["best"]), int(state["wait"])


class Phases:
    """The ``monitor`` thaws of a schedule: each watches its metric once every thaw listed
    before it has thawed, and becomes due when the metric stops improving. A ``carry_best``
    thaw starts from the best of the monitor thaw before it on the same metric and mode."""

    def __init__(self, thaws: Sequence[Thaw]) -> None:
        self.order = [str(t.name) for t in thaws]
        self.plateaus = {
            str(t.name): Plateau(t.monitor, patience=t.patience, min_delta=t.min_delta, mode=t.mode)
            for t in thaws
            if t.monitor is not None
        }
        self.carry: dict[str, str] = {}  # thaw -> the monitor thaw whose best it starts from
        for i, t in enumerate(thaws):
            if t.carry_best:
                same = [u for u in thaws[:i] if u.monitor == t.monitor and u.mode == t.mode]
                self.carry[str(t.name)] = str(same[-1].name)
        self.fired: list[str] = []

    def watching(self, thawed: Sequence[str]) -> str | None:
        """The metric thaw that watches now, if any."""
        for name in self.order:
            if name in thawed:
                continue
            if name in self.fired:
                return None  # the phase before has ended, its thaw is pending
            return name if name in self.plateaus else None
        return None

    def observe(self, metrics: Mapping[str, Any], thawed: Sequence[str], caller: str) -> list[str]:
        """Take one validation's metrics; the names of the thaws that became due.

        Raises:
            SpecError: the watched metric is not among ``metrics`` (as ``EarlyStopping``
                with ``strict=True``).
        """
        name = self.watching(thawed)
        if name is None:
            return []
        plateau = self.plateaus[name]
        if plateau.monitor not in metrics:
            raise SpecError(
                f"{caller}: thaw group {name!r} monitors {plateau.monitor!r}, which is not "
                f"among the logged metrics {sorted(metrics)}; log it in validation_step "
                f"(self.log({plateau.monitor!r}, ...)) or fix monitor="
            )
        value = metrics[plateau.monitor]
        source = self.carry.get(name)
        if source is not None and plateau.fresh:
            plateau.best = self.plateaus[source].best
        if plateau.update(float(value.item() if isinstance(value, torch.Tensor) else value)):
            self.fired.append(name)
            return [name]
        return []

    def due(self, thawed: Sequence[str]) -> list[str]:
        """Fired thaws not yet applied."""
        return [n for n in self.fired if n not in thawed]

    def state_dict(self) -> dict[str, Any]:
        return {
            "fired": list(self.fired),
            "plateaus": {n: p.state_dict() for n, p in self.plateaus.items()},
        }

    def load_state_dict(self, state: object, caller: str) -> None:
        if state is None:  # written before metric thaws existed: nothing was watched
            return
        ok = (
            isinstance(state, Mapping)
            and isinstance(state.get("fired"), list)
            and isinstance(state.get("plateaus"), Mapping)
            and set(state["plateaus"]) == set(self.plateaus)
            and all(n in self.plateaus for n in state["fired"])
        )
        if not ok:
            raise CheckpointMismatchError(
                f"{caller}: the saved plateau state {state!r} does not fit the monitor thaws "
                f"{sorted(self.plateaus)} of this spec"
            )
        checked = cast(Mapping[str, Any], state)
        for name, entry in checked["plateaus"].items():
            self.plateaus[name].load_state_dict(entry)
        self.fired = list(checked["fired"])


def require_forward(position: Mapping[str, int], epoch: int, step: int, caller: str) -> None:
    """Refuse a negative ``epoch`` or ``step``, or one lower than ``position`` (the last
    step's): a thaw is never undone, so a count that goes back (the batch's index in its
    epoch passed as ``step``) would thaw at the wrong time, or never."""
    for what, now, last, fix in (
        ("epoch", epoch, position["epoch"], "the epoch of the training loop, from 0"),
        (
            "step",
            step,
            position["global_step"],
            "the number of optimizer steps taken so far in the whole run (Lightning's "
            "trainer.global_step), not the batch's index in its epoch",
        ),
    ):
        if now < 0:
            raise SpecError(f"{caller}.step(): {what}={now} is negative; pass {fix}")
        if now < last:
            raise SpecError(
                f"{caller}.step(): {what}={now} is lower than {last}, the {what} of "
                f"the last step() call; pass {fix}. Thaws are never undone: to train again "
                f"from the start, restore this handle and apply the spec anew"
            )
