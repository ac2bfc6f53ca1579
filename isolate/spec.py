"""An isolation spec: what to freeze, detach, clone and thaw, as plain, checkable data.

:class:`IsolationSpec` holds the declaration and validates it when it is built;
:meth:`IsolationSpec.apply` makes it real on a model and returns an
:class:`~isolate.engine.IsolationHandle` that thaws, verifies, saves and undoes it. The same
spec drives a plain PyTorch loop, Lightning Fabric, and the Lightning callback
(:class:`isolate.lightning.IsolationCallback`), which is a thin adapter over it.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from isolate.errors import SpecError

if TYPE_CHECKING:
    from torch import nn

    from isolate.engine import IsolationHandle, Optimizers

__all__ = ["IsolationSpec", "Thaw", "ThawKeys"]

_CALLER = "IsolationSpec"
BN = Literal["eval", "train"]
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
)


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_ramp(thaw: Thaw, where: str) -> None:
    ratio, steps, epochs = thaw.warmup_ratio, thaw.warmup_steps, thaw.warmup_epochs
    if ratio is None:
        if steps is not None or epochs is not None:
            raise SpecError(
                f"{where}: warmup_steps / warmup_epochs need warmup_ratio= (the fraction of "
                f"the lr to start from, e.g. 0.1)"
            )
    elif not _number(ratio) or not 0 < ratio <= 1:
        raise SpecError(f"{where}: warmup_ratio must be a number in (0, 1], got {ratio!r}")
    elif (steps is None) == (epochs is None):
        raise SpecError(
            f"{where}: warmup_ratio={ratio} needs exactly one of warmup_steps= or "
            f"warmup_epochs= (the ramp's length), got {'both' if steps else 'neither'}"
        )
    for key, value in (("warmup_steps", steps), ("warmup_epochs", epochs)):
        if value is not None and (not _is_int(value) or value < 1):
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


def _check_monitor(thaw: Thaw, where: str) -> None:
    if thaw.monitor is not None and (not isinstance(thaw.monitor, str) or not thaw.monitor):
        raise SpecError(f"{where}: monitor must be a metric name, got {thaw.monitor!r}")
    if not _is_int(thaw.patience) or thaw.patience < 1:
        raise SpecError(f"{where}: patience must be an integer >= 1, got {thaw.patience!r}")
    if not _number(thaw.min_delta) or thaw.min_delta < 0:
        raise SpecError(f"{where}: min_delta must be a number >= 0, got {thaw.min_delta!r}")
    if thaw.mode not in ("min", "max"):
        raise SpecError(f"{where}: mode must be 'min' or 'max', got {thaw.mode!r}")
    if thaw.monitor is None:
        set_by_hand = [k for k in ("patience", "min_delta", "mode") if k in thaw.extras()]
        if set_by_hand:
            raise SpecError(f"{where}: {set_by_hand} apply to monitor=, which is not set")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def string_list(value: object, what: str, caller: str = _CALLER) -> tuple[str, ...]:
    """A selector argument as a tuple; a lone string is one selector, not its characters."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else _bad_strings(value, what, caller)
    if isinstance(value, Sequence) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    return _bad_strings(value, what, caller)


def _bad_strings(value: object, what: str, caller: str) -> tuple[str, ...]:
    raise SpecError(
        f"{caller}: {what} must be a list of non-empty strings (module names, parameter "
        f"names or globs), got {value!r}"
    )


def _unknown_keys(keys: Sequence[str], known: Sequence[str], where: str) -> None:
    unknown = [k for k in keys if k not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        if close:
            hints.append(f"{key!r} -> {close[0]!r}")
    guess = f" (did you mean {', '.join(hints)}?)" if hints else ""
    raise SpecError(f"{where} has unknown keys {unknown}{guess}; the keys are {sorted(known)}")


@dataclass(frozen=True)
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
            if not _is_int(at) or at < 0:
                raise SpecError(f"{where}: {key} must be an integer >= 0, got {at!r}")
        _check_ramp(self, where)
        _check_monitor(self, where)
        if self.lr is not None and (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, (int, float))
            or not math.isfinite(self.lr)
            or self.lr <= 0
        ):
            raise SpecError(
                f"{where}: lr must be a finite number > 0 or None (the settings of the group "
                f"the parameters came from), got {self.lr!r}"
            )
        if self.optimizer_idx is not None and (
            not _is_int(self.optimizer_idx) or self.optimizer_idx < 0
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
        _unknown_keys(list(mapping), known, where)
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


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(value: object, where: str) -> None:
    """Refuse anything but the types YAML and JSON produce."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise SpecError(f"{where}: keys must be strings, got {k!r}")
            _check_plain(v, f"{where}.{k}")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    raise SpecError(
        f"{where}: from_dict() takes plain data (str, int, float, bool, None, lists and "
        f"dicts), got {type(value).__name__}; build IsolationSpec(...) directly for objects"
    )


@dataclass(frozen=True)
class IsolationSpec:
    """What must not learn from what, as data: validated when built, applied to a model.

    Args:
        freeze: parameters to freeze: module names (``"trunk"``), parameter names or globs
            over them (``"trunk.*"``, ``"*.bias"``).
        detach: names of submodules to feed detached inputs (:class:`isolate.Detached`): they
            learn from their own loss, nothing upstream of them does.
        clone: names of submodules to feed cloned inputs (:class:`isolate.Cloned`): gradient
            still flows back, in-place edits stay inside.
        bn: BatchNorm layers among the frozen parameters: ``"eval"`` holds them in eval mode,
            through ``model.train()``, so their running statistics do not move; ``"train"``
            lets them update.
        thaw: the unfreezing schedule: :class:`Thaw` steps, or mappings with their keys.
        protect: loss name -> selectors of the parameters that loss must not reach. ``None``
            protects everything upstream of ``detach`` branches from every named loss.
        frozen_in_optimizer: what to do with frozen parameters found in an optimizer, where
            weight decay or momentum could move them: ``"remove"`` takes them out (with a
            warning naming them; a thaw puts them back), ``"error"`` refuses.

    Raises:
        SpecError: an argument has the wrong type or value, a thaw name repeats, or a branch
            is both detached and cloned.

    >>> spec = IsolationSpec(freeze=["trunk"], detach=["probe"], thaw=[Thaw("trunk", epoch=2)])
    >>> spec
    IsolationSpec(freeze=['trunk'], detach=['probe'], thaw=[trunk at epoch 2])
    >>> IsolationSpec.from_dict({"freeze": "trunk", "bn": "eval"}).freeze
    ('trunk',)
    >>> IsolationSpec.from_dict({"frezze": ["trunk"]})
    Traceback (most recent call last):
    ...
    isolate.errors.SpecError: IsolationSpec.from_dict() has unknown keys ['frezze'] (did you ...
    """

    freeze: tuple[str, ...] = ()
    detach: tuple[str, ...] = ()
    clone: tuple[str, ...] = ()
    bn: BN = "eval"
    thaw: tuple[Thaw, ...] = ()
    protect: Mapping[str, tuple[str, ...]] | None = None
    frozen_in_optimizer: Literal["remove", "error"] = "remove"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for key in ("freeze", "detach", "clone"):
            set_(self, key, string_list(getattr(self, key), key))
        if self.bn not in ("eval", "train"):
            raise SpecError(f"{_CALLER}: bn must be 'eval' or 'train', got {self.bn!r}")
        thaw: object = self.thaw
        if thaw is not None and (
            isinstance(thaw, (str, Mapping, Thaw)) or not isinstance(thaw, Sequence)
        ):
            raise SpecError(
                f"{_CALLER}: thaw must be a list of Thaw steps (or mappings), got "
                f"{type(thaw).__name__}"
            )
        steps = tuple(
            Thaw.from_dict(item, where=f"{_CALLER}: thaw[{i}]") for i, item in enumerate(thaw or ())
        )
        set_(self, "thaw", steps)
        names = [str(t.name) for t in steps]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise SpecError(
                f"{_CALLER}: thaw steps share the names {repeated}; give each a distinct name="
            )
        both = sorted(set(self.detach) & set(self.clone))
        if both:
            raise SpecError(
                f"{_CALLER}: {both} are both in detach and clone; a branch either gets "
                f"gradient back (clone) or not (detach): pick one"
            )
        for kind in ("detach", "clone"):
            names = list(getattr(self, kind))
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise SpecError(f"{_CALLER}: {kind} lists {twice} twice; list each branch once")
        set_(self, "protect", self._checked_protect(self.protect))
        if self.frozen_in_optimizer not in ("remove", "error"):
            raise SpecError(
                f"{_CALLER}: frozen_in_optimizer must be 'remove' or 'error', got "
                f"{self.frozen_in_optimizer!r}"
            )

    @staticmethod
    def _checked_protect(protect: object) -> dict[str, tuple[str, ...]] | None:
        if protect is None:
            return None
        if not isinstance(protect, Mapping):
            raise SpecError(
                f"{_CALLER}: protect must map loss names to selectors, got {type(protect).__name__}"
            )
        checked = {str(k): string_list(v, f"protect[{k!r}]") for k, v in protect.items()}
        empty = [k for k, v in checked.items() if not v]
        if empty:
            raise SpecError(f"{_CALLER}: protect{empty} select nothing; name what to protect")
        return checked

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> IsolationSpec:
        """A spec from plain data, as read from YAML or JSON: the keys of the constructor.

        Raises:
            SpecError: ``mapping`` is not a mapping, holds an unknown key (with the closest
                known one), or holds anything but plain data.
        """
        where = f"{_CALLER}.from_dict()"
        if not isinstance(mapping, Mapping):
            raise SpecError(f"{where}: expected a mapping of spec keys, got {type(mapping)}")
        known = [f.name for f in fields(cls) if f.init]
        _unknown_keys(list(mapping), known, where)
        _check_plain(dict(mapping), where)
        return cls(**mapping)

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data; ``IsolationSpec.from_dict(spec.to_dict()) == spec``."""
        thaw = [
            {f.name: getattr(t, f.name) for f in fields(Thaw) if f.name != "_"} for t in self.thaw
        ]
        for step in thaw:
            step["select"] = list(string_list(step["select"], "select"))
        return {
            "freeze": list(self.freeze),
            "detach": list(self.detach),
            "clone": list(self.clone),
            "bn": self.bn,
            "thaw": thaw,
            "protect": None
            if self.protect is None
            else {k: list(v) for k, v in self.protect.items()},
            "frozen_in_optimizer": self.frozen_in_optimizer,
        }

    def prefixed(self, prefix: str) -> IsolationSpec:
        """The same spec for a model that holds this one's model under ``prefix`` (for
        example a LightningModule's ``self.net``): every selector and branch name gets
        ``prefix + "."`` in front; thaw group names stay.

        >>> IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1)]).prefixed("net")
        IsolationSpec(freeze=['net.trunk'], thaw=[trunk.3 at epoch 1])
        """
        if not isinstance(prefix, str) or not prefix or prefix.endswith("."):
            raise SpecError(f"{_CALLER}.prefixed(): prefix must be a module name, got {prefix!r}")
        data = self.to_dict()
        for key in ("freeze", "detach", "clone"):
            data[key] = [f"{prefix}.{s}" for s in data[key]]
        for step in data["thaw"]:
            step["select"] = [f"{prefix}.{s}" for s in step["select"]]
        if data["protect"] is not None:
            data["protect"] = {k: [f"{prefix}.{s}" for s in v] for k, v in data["protect"].items()}
        return type(self).from_dict(data)

    def __repr__(self) -> str:
        parts = [f"{k}={list(getattr(self, k))!r}" for k in ("freeze", "detach", "clone")]
        parts = [p for p in parts if not p.endswith("=[]")]
        if self.bn != "eval":
            parts.append(f"bn={self.bn!r}")
        if self.thaw:
            steps = [
                f"{t.name} at {t.when}" + (f", lr={t.lr}" if t.lr is not None else "")
                for t in self.thaw
            ]
            parts.append(f"thaw=[{'; '.join(steps)}]")
        if self.protect is not None:
            parts.append(f"protect={ {k: list(v) for k, v in self.protect.items()} }")
        if self.frozen_in_optimizer != "remove":
            parts.append(f"frozen_in_optimizer={self.frozen_in_optimizer!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def apply(
        self,
        model: nn.Module,
        optimizer: Optimizers = None,
        *,
        drift: Literal["fingerprint", "copy"] = "fingerprint",
    ) -> IsolationHandle:
        """Check the whole spec against ``model``, then freeze, hold and wrap.

        Args:
            model: the module to isolate.
            optimizer: an optimizer (or a list of them) to take the frozen parameters out of,
                and for thawed groups to join; it can also be attached later with
                :meth:`~isolate.engine.IsolationHandle.attach`.
            drift: how ``verify`` checks that frozen tensors stay put: ``"fingerprint"``
                keeps a 128-bit fingerprint of each (O(number of tensors) memory; any changed
                bit is caught, its size is not known), ``"copy"`` a copy in host memory (the
                size of a change is reported; costs the size of the frozen part).

        Returns:
            An :class:`~isolate.engine.IsolationHandle`: ``thaw``, ``step``, ``verify``,
            ``state_dict`` / ``load_state_dict`` and an exact ``restore``.

        Raises:
            SelectorError: a selector matches nothing, or a branch is not a submodule.
            SpecError: the spec does not fit the model or the optimizer. On any error the
                model (and the optimizer) are exactly as before.
        """
        from isolate.engine import IsolationHandle  # the engine imports this module

        return IsolationHandle.apply(self, model, optimizer, drift=drift)

    @contextlib.contextmanager
    def applied(
        self,
        model: nn.Module,
        optimizer: Optimizers = None,
        *,
        drift: Literal["fingerprint", "copy"] = "fingerprint",
    ) -> Iterator[IsolationHandle]:
        """:meth:`apply` as a context manager: restored on exit, exceptions included.

        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with IsolationSpec(freeze=["0"]).applied(model) as handle:
        ...     model[0].weight.requires_grad, handle.frozen
        (False, ('0.weight', '0.bias'))
        >>> model[0].weight.requires_grad
        True
        """
        handle = self.apply(model, optimizer, drift=drift)
        try:
            yield handle
        finally:
            if handle.active:
                handle.restore()
