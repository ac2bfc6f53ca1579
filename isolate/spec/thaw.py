"""One step of an unfreezing schedule, as plain, checkable data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any, Literal, TypedDict

from isolate.errors import SpecError
from isolate.spec._fields import is_int, number, string_list, unknown_keys, yaml_number_hint

__all__ = ["BN", "Thaw", "ThawKeys", "check_lr"]

BN = Literal["eval", "train"]
"""How frozen BatchNorm layers behave: held in eval mode, or following the model's mode."""
Shape = Literal["linear", "cosine", "exponential"]
_EXTRA = (
    "warmup_ratio",
    "warmup_steps",
    "warmup_epochs",
    "warmup_shape",
    "align",
    "monitor",
    "patience",
    "min_delta",
    "mode",
    "carry_best",
    "after_previous",
)


def _check_ramp(thaw: Thaw, where: str) -> None:
    ratio, steps, epochs = thaw.warmup_ratio, thaw.warmup_steps, thaw.warmup_epochs
    if ratio is None:
        if steps is not None or epochs is not None:
            raise SpecError(
                f"{where}: warmup_steps / warmup_epochs need warmup_ratio= (the fraction of "
                f"the lr to start from, e.g. 0.1)"
            )
    elif not number(ratio) or not 0 < ratio <= 1:
        raise SpecError(
            f"{where}: warmup_ratio must be a number in (0, 1], got {ratio!r}"
            + yaml_number_hint(ratio)
        )
    elif (steps is None) == (epochs is None):
        raise SpecError(
            f"{where}: warmup_ratio={ratio} needs exactly one of warmup_steps= or "
            f"warmup_epochs= (the ramp's length), got {'neither' if steps is None else 'both'}"
        )
    for key, value in (("warmup_steps", steps), ("warmup_epochs", epochs)):
        if value is not None and (not is_int(value) or value < 1):
            raise SpecError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    if thaw.warmup_shape not in ("linear", "cosine", "exponential"):
        raise SpecError(
            f"{where}: warmup_shape must be 'linear', 'cosine' or 'exponential', got "
            f"{thaw.warmup_shape!r} (a callable cannot come from a config; compose the shape "
            f"in a LambdaLR of the optimizer instead)"
        )
    if not isinstance(thaw.align, bool):
        raise SpecError(f"{where}: align must be true or false, got {thaw.align!r}")
    if thaw.align and thaw.lr is not None:
        raise SpecError(
            f"{where}: align=True follows the lr of the group the parameters came from, so "
            f"lr={thaw.lr} would be overridden; drop lr (start lower with warmup_ratio)"
        )


def check_lr(lr: object, where: str) -> None:
    """Refuse an lr that is not a finite number > 0 (``None``: the source group's settings).

    >>> check_lr(float("nan"), "doc")
    Traceback (most recent call last):
    ...
    isolate.errors.SpecError: doc: lr must be a finite number > 0 or None (the settings of ...
    """
    if lr is not None and (not number(lr) or lr <= 0):  # type: ignore[operator]
        raise SpecError(
            f"{where}: lr must be a finite number > 0 or None (the settings of the group "
            f"the parameters came from), got {lr!r}{yaml_number_hint(lr)}"
        )


def _check_monitor(thaw: Thaw, where: str) -> None:
    if thaw.monitor is not None and (not isinstance(thaw.monitor, str) or not thaw.monitor):
        raise SpecError(f"{where}: monitor must be a metric name, got {thaw.monitor!r}")
    if not is_int(thaw.patience) or thaw.patience < 1:
        raise SpecError(f"{where}: patience must be an integer >= 1, got {thaw.patience!r}")
    if not number(thaw.min_delta) or thaw.min_delta < 0:
        raise SpecError(
            f"{where}: min_delta must be a number >= 0, got {thaw.min_delta!r}"
            + yaml_number_hint(thaw.min_delta)
        )
    if thaw.mode not in ("min", "max"):
        raise SpecError(f"{where}: mode must be 'min' or 'max', got {thaw.mode!r}")
    if not isinstance(thaw.carry_best, bool):
        raise SpecError(f"{where}: carry_best must be true or false, got {thaw.carry_best!r}")
    if not is_int(thaw.after_previous) or thaw.after_previous < 0:
        raise SpecError(
            f"{where}: after_previous must be an integer >= 0 (epochs), got {thaw.after_previous!r}"
        )
    if thaw.monitor is None:
        set_by_hand = [
            k for k in ("patience", "min_delta", "mode", "carry_best") if k in thaw.extras()
        ]
        if set_by_hand:
            raise SpecError(f"{where}: {set_by_hand} apply to monitor=, which is not set")


@dataclass(frozen=True, eq=False)
class Thaw:
    """One step of an unfreezing schedule.

    At the start of epoch ``epoch``, or before optimizer step ``step`` (the number of steps
    taken so far), or once the metric ``monitor`` stops improving, the selected parameters
    start to require grad and join the optimizer as a new param group.

    Args:
        select: which parameters, in the selector grammar of ``freeze`` (names, globs,
            ``type:<Class>``, ``!`` exclusions; a string is one selector). The group is the
            frozen part of what it selects (``"backbone"`` after ``freeze: [backbone,
            "!type:_BatchNorm"]`` thaws the backbone but its BatchNorm layers); a selector
            that picks only parameters the spec does not freeze is refused.
        epoch: the epoch (from 0) at whose start to thaw. Give ``epoch`` or ``step`` (with
            ``monitor``: at the latest).
        step: the number of optimizer steps after which to thaw.
        lr: the base learning rate of the new param group: its lr when it joins, and its
            ``base_lrs`` / ``initial_lr`` entry for a scheduler, which scales it from its next
            step as it scales the others. ``None`` gives the parameters the settings of the
            optimizer group they were in (lr, momentum, weight decay, scheduler state), which
            requires that the optimizer was built with them in one group (the spec takes them
            out while they are frozen). Lightning's ``BackboneFinetuning`` instead derives the
            lr from group 0's (``lr / denominator``); here that is ``align`` with a ratio.
        warmup_ratio: ramp the group's lr up from this fraction of its lr, over
            ``warmup_steps`` optimizer steps or ``warmup_epochs`` epochs (give one). The ramp
            multiplies the lr inside ``optimizer.step()`` only, so schedulers and checkpoints
            see the unramped lr.
        warmup_steps: the ramp's length in optimizer steps after the thaw.
        warmup_epochs: the ramp's length in epochs after the thaw (constant within an epoch).
        warmup_shape: ``"linear"``, ``"cosine"`` or ``"exponential"`` (geometric) ramp.
        align: follow the lr of the group the parameters came from (or group 0 when they were
            in no group): during the ramp ``ratio(t) * lr_source(t)``, then ``lr_source(t)``,
            whatever schedules the source group (``BackboneFinetuning``'s ``should_align``).
            Cannot be combined with ``lr``.
        monitor: thaw once this logged metric stops improving, with the semantics of
            Lightning's ``EarlyStopping`` (``patience`` validation checks without an
            improvement by more than ``min_delta`` in direction ``mode``), without ending the
            run. Metric thaws are phases: each starts watching once the thaw steps listed
            before it have thawed.
        patience: checks without improvement before the thaw.
        min_delta: the least change that counts as an improvement.
        mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).
        carry_best: start from the best value the monitor thaw before it (in schedule order,
            on the same metric and mode) reached, instead of afresh; only the count of checks
            without improvement starts at 0 (finetuning-scheduler's ``FTSEarlyStopping``
            keeps its best score across phases).
        after_previous: thaw at the earliest this many epochs after the thaw listed before
            it (which must have thawed first): ``1`` moves on at most one phase per epoch
            start, as finetuning-scheduler does. ``0`` (the default): no such constraint.
        optimizer_idx: which optimizer receives them; by default the one that held them, or
            the only one.
        bn: BatchNorm layers in the group once thawed: ``"train"`` follow the model's mode
            and update their running statistics, ``"eval"`` stay in eval mode.
        name: the group's name in logs and checkpoints (default: the selectors joined by
            ``"+"``).

    Raises:
        SpecError: a field has the wrong type or value.

    >>> Thaw("trunk", epoch=2, lr=1e-3).name
    'trunk'
    >>> Thaw(["trunk.0", "trunk.1"], step=100)  # doctest: +ELLIPSIS
    Thaw(select=['trunk.0', 'trunk.1'], epoch=None, step=100, ..., name='trunk.0+trunk.1', ...)
    >>> Thaw("trunk")
    Traceback (most recent call last):
    ...
    isolate.errors.SpecError: Thaw('trunk'): give exactly one of epoch= or step= (or monitor=, ...
    >>> Thaw("backbone", epoch=2, warmup_ratio=0.1, warmup_epochs=3, align=True).when
    'epoch 2'
    >>> Thaw("layer3", monitor="val_loss", patience=2, epoch=10).when
    'val_loss plateau (at the latest epoch 10)'
    """

    select: str | list[str]
    _: KW_ONLY
    epoch: int | None = None
    step: int | None = None
    lr: float | None = None
    optimizer_idx: int | None = None
    bn: BN = "train"
    name: str | None = None
    warmup_ratio: float | None = None
    warmup_steps: int | None = None
    warmup_epochs: int | None = None
    warmup_shape: Shape = "linear"
    align: bool = False
    monitor: str | None = None
    patience: int = 3
    min_delta: float = 0.0
    mode: Literal["min", "max"] = "min"
    carry_best: bool = False
    after_previous: int = 0

    def __post_init__(self) -> None:
        where = f"Thaw({self.select!r})"
        selectors = string_list(self.select, "select", where)
        if not selectors:
            raise SpecError(f"{where}: select is empty; name the parameters to thaw")
        when = [k for k in ("epoch", "step") if getattr(self, k) is not None]
        if len(when) > 1 or (not when and self.monitor is None):
            got = "both" if when else "neither"
            raise SpecError(
                f"{where}: give exactly one of epoch= or step= (or monitor=, with either as "
                f"the latest), got {got}"
            )
        for key in when:
            at = getattr(self, key)
            if not is_int(at) or at < 0:
                raise SpecError(f"{where}: {key} must be an integer >= 0, got {at!r}")
        _check_ramp(self, where)
        _check_monitor(self, where)
        check_lr(self.lr, where)
        if self.optimizer_idx is not None and (
            not is_int(self.optimizer_idx) or self.optimizer_idx < 0
        ):
            raise SpecError(
                f"{where}: optimizer_idx must be an integer >= 0, got {self.optimizer_idx!r}"
            )
        if self.bn not in ("train", "eval"):
            raise SpecError(f"{where}: bn must be 'train' or 'eval', got {self.bn!r}")
        if self.name is None:
            object.__setattr__(self, "name", "+".join(selectors))
        elif not isinstance(self.name, str) or not self.name:
            raise SpecError(f"{where}: name must be a non-empty string, got {self.name!r}")

    @property
    def selectors(self) -> tuple[str, ...]:
        """``select`` as a tuple of selector strings."""
        return string_list(self.select, "select", f"Thaw({self.select!r})")

    def _key(self) -> tuple[Any, ...]:
        # A lone string is one selector: Thaw("trunk") and Thaw(["trunk"]) are one step.
        return tuple(
            self.selectors if f.name == "select" else getattr(self, f.name) for f in fields(self)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Thaw):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def when(self) -> str:
        """``"epoch 2"``, ``"step 100"``, or ``"val_loss plateau (at the latest epoch 5)"``."""
        at = f"epoch {self.epoch}" if self.epoch is not None else f"step {self.step}"
        if self.monitor is None:
            return at
        latest = "" if self.epoch is None and self.step is None else f" (at the latest {at})"
        return f"{self.monitor} plateau{latest}"

    def due(self, *, epoch: int, step: int) -> bool:
        """Whether the step is due at ``epoch`` after ``step`` optimizer steps (a metric
        thaw: its latest epoch or step only)."""
        if self.epoch is not None:
            return epoch >= self.epoch
        return self.step is not None and step >= self.step

    def extras(self) -> dict[str, Any]:
        """The ramp, align and monitor fields that differ from their defaults, by name."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name in _EXTRA and getattr(self, f.name) != f.default
        }

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], *, where: str = "thaw") -> Thaw:
        """A step from a mapping with its keys (``select`` is required).

        Raises:
            SpecError: an unknown or missing key, or a bad value.
        """
        if isinstance(mapping, Thaw):
            return mapping
        if not isinstance(mapping, Mapping):
            raise SpecError(
                f"{where} must be a Thaw or a mapping with its keys, got {type(mapping).__name__}"
            )
        known = [f.name for f in fields(cls) if f.name != "_"]
        unknown_keys(list(mapping), known, where)
        if "select" not in mapping:
            raise SpecError(f"{where} has no 'select'; name what to thaw")
        return cls(**mapping)


class ThawKeys(TypedDict, total=False):
    """The keys of a :class:`Thaw` step given as a mapping (``select`` is required).

    Typed key by key on purpose: LightningCLI (jsonargparse) instantiates any
    ``class_path`` it finds in a value typed ``Any``, so a ``dict[str, Any]`` here would let a
    YAML config construct arbitrary classes (``subprocess.Popen``) while parsing.
    """

    select: str | list[str]
    epoch: int | None
    step: int | None
    lr: float | None
    optimizer_idx: int | None
    bn: BN
    name: str | None
    warmup_ratio: float | None
    warmup_steps: int | None
    warmup_epochs: int | None
    warmup_shape: Shape
    align: bool
    monitor: str | None
    patience: int
    min_delta: float
    mode: Literal["min", "max"]
    carry_best: bool
    after_previous: int
