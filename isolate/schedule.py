"""The thaw schedule over time: lr ramps of thawed groups, and phases that end on a plateau.

* :func:`ramp` is the warm-up factor of a :class:`~isolate.spec.Thaw` (``warmup_ratio``,
  ``warmup_steps`` / ``warmup_epochs``, ``warmup_shape``); :class:`Shaper` applies it (and
  ``align``) to a thawed param group inside ``optimizer.step()`` only, through the
  optimizer's step pre- and post-hooks, so schedulers, checkpoints and resumes see the
  unramped lr and whatever scheduler drives the optimizer keeps working.
* :class:`Plateau` is Lightning's ``EarlyStopping`` rule (``patience`` checks without an
  improvement larger than ``min_delta`` in direction ``mode``); :class:`Phases` runs one per
  ``monitor`` thaw, in schedule order, and says which became due. Nothing here ends a run.
* :func:`default_schedule` writes a starting schedule from a model's structure (one phase
  per top-level block, from the head backwards); ``python -m isolate.schedule
  package.module:build_model`` prints it as YAML.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from isolate.errors import CheckpointMismatchError, SpecError
from isolate.spec import Thaw

__all__ = ["Phases", "Plateau", "Shaper", "default_schedule", "main", "ramp", "to_yaml"]

Clock = Callable[[], tuple[Mapping[str, int], Mapping[str, int]]]
"""Returns (where training is now, where it was at the thaw): ``{"epoch", "global_step"}``."""


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
        clock: where training is, and where it was at the thaw.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        group: dict[str, Any],
        reference: int,
        thaw: Thaw,
        clock: Clock,
    ) -> None:
        self.opt, self.reference, self.thaw, self.clock = opt, reference, thaw, clock
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
        now, at = self.clock()
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
    before it has thawed, and becomes due when the metric stops improving."""

    def __init__(self, thaws: Sequence[Thaw]) -> None:
        self.order = [str(t.name) for t in thaws]
        self.plateaus = {
            str(t.name): Plateau(t.monitor, patience=t.patience, min_delta=t.min_delta, mode=t.mode)
            for t in thaws
            if t.monitor is not None
        }
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


def _blocks(model: nn.Module) -> tuple[str, list[str]]:
    """The top-level blocks holding parameters, below any single-child wrappers."""
    prefix = ""
    module = model
    while True:
        children = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(children) == 1 and not any(True for _ in module.parameters(recurse=False)):
            prefix += children[0][0] + "."
            module = children[0][1]
            continue
        return prefix, [prefix + n for n, _ in children]


def default_schedule(
    model: nn.Module, *, monitor: str | None = "val_loss", patience: int = 3
) -> dict[str, Any]:
    """A starting schedule for ``model``: the last top-level block (the head) trains, every
    other block is frozen and thawed one phase at a time, from the head backwards.

    Args:
        model: the model (a LightningModule is looked through to its single child holding
            all parameters, if there is one).
        monitor: the metric whose plateau ends each phase; ``None`` thaws one block per epoch.
        patience: checks without improvement that end a phase.

    Returns:
        A mapping for :meth:`isolate.IsolationSpec.from_dict` (the same keys as the callback's
        ``init_args``).

    Raises:
        SpecError: the model has fewer than two top-level blocks holding parameters.

    >>> net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 1))
    >>> default_schedule(net, monitor=None)["thaw"]
    [{'select': '2', 'epoch': 1}, {'select': '0', 'epoch': 2}]
    """
    prefix, blocks = _blocks(model)
    if len(blocks) < 2:
        raise SpecError(
            f"default_schedule(): {type(model).__name__} has {len(blocks)} top-level block(s) "
            f"with parameters under {prefix or 'the root'!r}; a phased schedule needs a head and "
            f"at least one block before it. Write the schedule by hand"
        )
    *body, _head = blocks
    thaw: list[dict[str, Any]] = []
    for i, name in enumerate(reversed(body), start=1):
        step: dict[str, Any] = {"select": name}
        if monitor is None:
            step["epoch"] = i
        else:
            step.update(monitor=monitor, patience=patience)
        thaw.append(step)
    return {"freeze": list(body), "thaw": thaw}


def to_yaml(schedule: Mapping[str, Any], header: str = "") -> str:
    """A schedule mapping as YAML, one thaw step per line (plain data only, no PyYAML needed).

    >>> print(to_yaml({"freeze": ["a"], "thaw": [{"select": "a", "epoch": 1, "lr": 1e-5}]}), end="")
    freeze: [a]
    thaw:
      - {select: a, epoch: 1, lr: 1.0e-05}
    """

    def scalar(value: object) -> str:
        if isinstance(value, str):
            plain = value and value[0] not in "!&*[]{}#|>'\"%@`-?:," and ": " not in value
            return value if plain else '"' + value.replace('"', '\\"') + '"'
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(scalar(v) for v in value) + "]"
        if isinstance(value, float):
            if not math.isfinite(value):
                return {"inf": ".inf", "-inf": "-.inf"}.get(repr(value), ".nan")
            mantissa, e, exponent = repr(value).partition("e")
            if e and "." not in mantissa:  # PyYAML reads 1e-05 as a string, 1.0e-05 as a float
                return f"{mantissa}.0e{exponent}"
        return repr(value)

    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for key, value in schedule.items():
        if key == "thaw":
            lines.append("thaw:")
            for step in value:
                items = ", ".join(f"{k}: {scalar(v)}" for k, v in step.items())
                lines.append(f"  - {{{items}}}")
        elif isinstance(value, list):
            lines.append(f"{key}: [{', '.join(scalar(v) for v in value)}]")
        else:
            lines.append(f"{key}: {scalar(value)}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m isolate.schedule package.module:build_model``: print a default schedule."""
    parser = argparse.ArgumentParser(
        prog="python -m isolate.schedule",
        description="Print a default thaw schedule (YAML) for a model: the head trains, the "
        "blocks before it thaw one phase at a time, from the head backwards. Edit it, then "
        "use it as the init_args of isolate.lightning.IsolationCallback or with "
        "IsolationSpec.from_dict(yaml.safe_load(...)).",
    )
    parser.add_argument("factory", help="module:callable that returns the model (no arguments)")
    parser.add_argument("--monitor", default="val_loss", help="metric ending each phase")
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--by-epoch", action="store_true", help="one phase per epoch instead")
    args = parser.parse_args(argv)
    module_name, _, attribute = args.factory.partition(":")
    if not attribute:
        parser.error(f"expected module:callable, got {args.factory!r}")
    factory = getattr(importlib.import_module(module_name), attribute)
    model = factory() if not isinstance(factory, nn.Module) else factory
    schedule = default_schedule(
        model, monitor=None if args.by_epoch else args.monitor, patience=args.patience
    )
    header = (
        f"Default isolate schedule for {args.factory} ({type(model).__name__}).\n"
        "Phase 0 trains what is not frozen (the head); each thaw step is one more phase.\n"
        "Per step: epoch/step (a fixed time), or monitor/patience/min_delta/mode (a plateau;\n"
        "epoch/step then is the latest), lr, warmup_ratio + warmup_steps|warmup_epochs,\n"
        "warmup_shape, align. Selectors: names, globs, 'type:<Class>', '!' exclusions."
    )
    sys.stdout.write(to_yaml(schedule, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
