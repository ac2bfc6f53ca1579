"""PyTorch Lightning integration: declare what must not learn from what, without model code.

:class:`IsolationCallback` freezes parameters, wraps named submodules in
:class:`isolate.Detached` / :class:`isolate.Cloned`, thaws groups on a schedule, checks while
training that the declared isolation holds, and saves where it stands in checkpoints.
:class:`Thaw` is one step of the schedule.

This is the only module of ``isolate`` that imports Lightning; import it explicitly
(``from isolate.lightning import IsolationCallback``): ``import isolate`` does not.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import Any, Literal, TypedDict

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from isolate import freezing
from isolate._selectors import describe, select
from isolate._tree import iter_tensors
from isolate._wrapping import Wrapper
from isolate.cloning import Cloned
from isolate.detaching import Detached
from isolate.drift import Snapshot, optimizer_exposure, snapshot
from isolate.errors import (
    DriftError,
    GradientLeakError,
    IsolationError,
    IsolationTypeError,
    IsolationWarning,
    SelectorError,
    WrappingError,
)
from isolate.graph import assert_isolated, reachable_parameters

__all__ = [
    "LOSSES_ATTRIBUTE",
    "CheckpointMismatchError",
    "IsolationCallback",
    "IsolationWarning",
    "RankDivergenceError",
    "SpecError",
    "Thaw",
    "ThawKeys",
]

LOSSES_ATTRIBUTE = "isolation_losses"
"""The attribute of the LightningModule where ``training_step`` leaves its named losses."""

_CALLER = "IsolationCallback"
_STATE_FORMAT = 1
_SHOW = 8  # how many names an error message lists before "... and N more"
_RANK_CHECK_BUCKET = 1 << 22  # elements per all-reduce when comparing ranks (32 MiB in float64)


class SpecError(IsolationError, ValueError):
    """An isolation spec that cannot work: bad arguments, overlaps, or an optimizer mismatch."""


class CheckpointMismatchError(IsolationError, ValueError):
    """A checkpoint was written under a different isolation spec, or without the callback."""


class RankDivergenceError(DriftError):
    """Parameters differ across the processes of a distributed run."""


def _names(names: Iterable[str]) -> str:
    listed = list(names)
    shown = ", ".join(repr(n) for n in listed[:_SHOW])
    more = f", ... and {len(listed) - _SHOW} more" if len(listed) > _SHOW else ""
    return f"[{shown}{more}]"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _string_list(value: object, what: str) -> tuple[str, ...]:
    """A selector argument as a tuple; a lone string is one selector, not its characters."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise SpecError(
        f"{_CALLER}: {what} must be a list of non-empty strings (module names, parameter "
        f"names or globs), got {value!r}"
    )


@dataclass(frozen=True)
class Thaw:
    """One step of the unfreezing schedule of :class:`IsolationCallback`.

    At the start of epoch ``epoch`` (``trainer.current_epoch``), or before optimizer step
    ``step`` (``trainer.global_step``), the selected parameters start to require grad and
    join the optimizer as a new param group.

    Args:
        select: which parameters: module names, parameter names or globs, as for ``freeze``
            (a string is one selector). Every one must be frozen by the callback's ``freeze``.
        epoch: the epoch (from 0) at whose start to thaw. Give ``epoch`` or ``step``.
        step: the number of optimizer steps after which to thaw.
        lr: the learning rate of the new param group. ``None`` gives the parameters the
            settings of the optimizer group they were in, which requires that
            ``configure_optimizers`` put them in one (the callback takes them out while
            they are frozen).
        optimizer_idx: which of ``trainer.optimizers`` receives them; by default the one that
            held them, or the only one.
        bn: BatchNorm layers in the group once thawed: ``"train"`` follow the model's mode
            and update their running statistics, ``"eval"`` stay in eval mode.
        name: the group's name in logs and checkpoints (default: the selectors joined by
            ``"+"``).

    Raises:
        SpecError: a field has the wrong type or value.

    >>> Thaw("trunk", epoch=2, lr=1e-3).name
    'trunk'
    >>> Thaw(["trunk.0", "trunk.1"], step=100)  # doctest: +ELLIPSIS
    Thaw(select=['trunk.0', 'trunk.1'], epoch=None, step=100, lr=None, ..., name='trunk.0+trunk.1')
    >>> Thaw("trunk")
    Traceback (most recent call last):
    ...
    isolate.lightning.SpecError: Thaw('trunk'): give exactly one of epoch= or step=, got neither
    """

    select: str | list[str]
    _: KW_ONLY
    epoch: int | None = None
    step: int | None = None
    lr: float | None = None
    optimizer_idx: int | None = None
    bn: Literal["train", "eval"] = "train"
    name: str | None = None

    def __post_init__(self) -> None:
        selectors = _string_list(self.select, "Thaw(select=...)")
        where = f"Thaw({self.select!r})"
        if not selectors:
            raise SpecError(f"{where}: select is empty; name the parameters to thaw")
        when = [k for k in ("epoch", "step") if getattr(self, k) is not None]
        if len(when) != 1:
            got = "both" if when else "neither"
            raise SpecError(f"{where}: give exactly one of epoch= or step=, got {got}")
        at = getattr(self, when[0])
        if not _is_int(at) or at < 0:
            raise SpecError(f"{where}: {when[0]} must be an integer >= 0, got {at!r}")
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
        return _string_list(self.select, "Thaw(select=...)")

    @property
    def when(self) -> str:
        """``"epoch 2"`` or ``"step 100"``."""
        return f"epoch {self.epoch}" if self.epoch is not None else f"step {self.step}"


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
    bn: Literal["train", "eval"]
    name: str | None


def _as_thaw(item: object, index: int) -> Thaw:
    if isinstance(item, Thaw):
        return item
    if isinstance(item, Mapping):
        known = {f.name for f in fields(Thaw) if f.name != "_"}
        unknown = sorted(set(item) - known)
        if unknown:
            raise SpecError(
                f"{_CALLER}: thaw[{index}] has unknown keys {unknown}; the keys of a thaw step "
                f"are {sorted(known)}"
            )
        if "select" not in item:
            raise SpecError(f"{_CALLER}: thaw[{index}] has no 'select'; name what to thaw")
        return Thaw(**item)
    raise SpecError(
        f"{_CALLER}: thaw[{index}] must be a Thaw or a mapping with its keys, got "
        f"{type(item).__name__}"
    )


# --------------------------------------------------------------------------------------------
# What one fit holds


@dataclass
class _Group:
    """A thaw step resolved against the model."""

    spec: Thaw
    name: str
    params: dict[str, nn.Parameter]  # clean name -> parameter, model order
    norms: dict[str, _BatchNorm]
    handles: list[freezing.FreezeHandle] = field(default_factory=list)
    optimizer_idx: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    applied: dict[str, int] | None = None  # {"epoch": e, "global_step": s} once thawed


@dataclass
class _Wrap:
    kind: Literal["detach", "clone"]
    name: str
    parent: nn.Module
    leaf: str
    child: nn.Module
    wrapper: Wrapper | None = None


@dataclass
class _Run:
    """Everything the callback changed or watches during one ``fit``."""

    trainer: pl.Trainer
    model: pl.LightningModule
    param_names: dict[int, str]  # id(parameter) -> clean name (a state_dict key)
    buffer_names: dict[int, str]
    frozen: dict[str, nn.Parameter]  # every parameter the spec freezes, model order
    norms: dict[str, _BatchNorm]  # BatchNorm layers the freeze handle holds
    wraps: list[_Wrap]
    groups: list[_Group]
    protect: dict[str, dict[str, nn.Parameter]] | None
    spec: dict[str, Any]
    freeze_handle: freezing.FreezeHandle | None = None
    hooks: list[RemovableHandle] = field(default_factory=list)
    by_name: dict[str, nn.Parameter] = field(default_factory=dict)  # names after wrapping
    snapshot: Snapshot | None = None
    applied: list[str] = field(default_factory=list)  # group names, in thaw order
    verify_now: bool = False
    verify_step: int = -1
    losses_seen: bool = False
    branch_inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    pending_rank_check: str | None = None
    fit_started: bool = False
    # Every module's training flag at setup: a validation step that raises leaves the model in
    # eval mode, and putting back only the held BatchNorm layers would leave a mix.
    modes: list[tuple[nn.Module, bool]] = field(default_factory=list)

    def frozen_now(self) -> dict[str, nn.Parameter]:
        thawed = {id(p) for g in self.groups if g.applied for p in g.params.values()}
        return {n: p for n, p in self.frozen.items() if id(p) not in thawed}

    def norms_now(self) -> dict[str, _BatchNorm]:
        thawed = {id(m) for g in self.groups if g.applied for m in g.norms.values()}
        return {n: m for n, m in self.norms.items() if id(m) not in thawed}

    def group(self, name: str) -> _Group:
        return next(g for g in self.groups if g.name == name)


def _clean_names(model: nn.Module) -> tuple[dict[int, str], dict[int, str]]:
    """id -> name of every parameter and buffer, as ``state_dict`` keys (no wrapper infix)."""
    params: dict[int, str] = {}
    buffers: dict[int, str] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        for name, p in module._parameters.items():
            if p is not None:
                params.setdefault(id(p), prefix + name)
        for name, b in module._buffers.items():
            if b is not None:
                buffers.setdefault(id(b), prefix + name)
        for name, child in module._modules.items():
            if child is None:
                continue
            inner = (
                prefix if isinstance(module, Wrapper) and name == "module" else f"{prefix}{name}."
            )
            walk(child, inner)

    walk(model, "")
    return params, buffers


def _norm_policy_layers(model: nn.Module, norms: Iterable[nn.Module]) -> list[nn.Module]:
    present = {id(m) for m in model.modules()}
    return [m for m in norms if id(m) not in present]


# --------------------------------------------------------------------------------------------
# The callback


class IsolationCallback(Callback):
    """Freeze, detach, clone and thaw by name, and check while training that isolation holds.

    What it does, hook by hook:

    * ``setup("fit")``, before ``configure_optimizers`` and before DDP wraps the model: checks
      the whole spec against the model (every selector must match, thaw groups must be frozen
      and disjoint), then freezes ``freeze`` and replaces each ``detach`` / ``clone`` submodule
      on its parent by :class:`isolate.Detached` / :class:`isolate.Cloned` (parameters keep
      their identity; ``state_dict`` keys do not change).
    * ``on_fit_start``, once the optimizers exist: takes frozen parameters out of the
      optimizers (warning which, and why), decides which optimizer and settings each thaw
      group will get, and snapshots the frozen parameters and held BatchNorm statistics.
    * at the scheduled epoch or step: thaws a group, adds it to its optimizer as one new param
      group, and, under DDP, wraps the model anew so that the group's gradients are
      synchronised; after the next step it checks that parameters are identical on all ranks.
    * every ``verify_every_n_steps`` optimizer steps: checks that the named losses reach no
      protected parameter (a walk of the autograd graph, no extra backward), that frozen
      parameters and held BatchNorm buffers have not moved (against a copy in host memory),
      that no frozen parameter is back in an optimizer with weight decay or momentum, that
      ranks agree (two all-reduces of the parameters, in 32 MiB buckets), and logs gradient
      norms per group to the trainer's loggers as ``isolation/grad_norm/<group>``.
    * checkpoints store the spec, what is frozen and which groups were thawed when, by
      parameter name, in plain types (they load with ``weights_only=True``); resuming thaws
      those groups again before DDP wraps the model, and a checkpoint written under another
      spec is refused, naming the differences.
    * ``teardown`` (and ``on_exception``): puts back the submodules and restores every
      ``requires_grad`` flag and BatchNorm mode exactly as they were before ``fit``; after an
      error, every module's ``training`` flag too (a validation step that raises leaves the
      model in eval mode).

    **Naming losses.** ``training_step`` leaves the losses to check in
    ``self.isolation_losses``, a dict of name -> loss tensor, set every step (holding
    references costs nothing); the callback reads it in ``on_before_backward``, while the
    graph is alive, and clears it. Each named loss must not reach the parameters
    ``protect[name]`` selects; without ``protect``, each must reach no parameter upstream
    of a ``detach`` branch. No named loss may reach a frozen parameter.

    Args:
        freeze: parameters to freeze for the run: module names (``"trunk"``), parameter names
            or globs over them (``"trunk.*"``, ``"*.bias"``).
        detach: names of submodules to feed detached inputs (:class:`isolate.Detached`): they
            learn from their own loss, nothing upstream of them does.
        clone: names of submodules to feed cloned inputs (:class:`isolate.Cloned`): gradient
            still flows back, in-place edits stay inside.
        bn: BatchNorm layers among the frozen parameters: ``"eval"`` holds them in eval mode,
            through ``model.train()`` and Lightning's evaluation loop, so their running
            statistics do not move; ``"train"`` lets them update.
        thaw: the unfreezing schedule: :class:`Thaw` steps, or mappings with their keys
            (:class:`ThawKeys`).
        protect: loss name -> selectors of the parameters that loss must not reach. ``None``
            protects everything upstream of ``detach`` branches from every named loss.
        frozen_in_optimizer: what to do with frozen parameters found in an optimizer at fit
            start, where weight decay or momentum could move them: ``"remove"`` takes them
            out (with a warning naming them; a thaw puts them back), ``"error"`` refuses.
        verify_every_n_steps: how often to check, in optimizer steps (step 0 included);
            ``0`` turns the periodic checks and gradient-norm logging off.
        on_violation: ``"raise"`` an error naming the parameters, or ``"warn"`` with an
            :class:`IsolationWarning` and carry on.
        log_grad_norms: whether to log gradient norms per group at each check: one group per
            ``detach`` / ``clone`` branch and per thawed group, ``rest`` and ``total``.

    Raises:
        SpecError: (at construction) an argument has the wrong type or value; (at setup and
            fit start) the spec does not fit the model or the optimizers. Nothing is left
            changed.
        SelectorError: a selector matches nothing, or a ``detach`` / ``clone`` name is not a
            submodule.
        CheckpointMismatchError: resuming from a checkpoint written under another spec. The
            isolation is undone, but the weights are the checkpoint's by then: Lightning loads
            the model's state before any callback sees the checkpoint.
        GradientLeakError, DriftError, RankDivergenceError: a violation during training
            (``on_violation="raise"``).

    Note:
        Traps it handles, and the ones it cannot:

        * BatchNorm running statistics ignore ``requires_grad``, and Lightning calls
          ``model.train()`` every epoch and resets ``training`` flags after validation by
          assignment; ``bn="eval"`` enforces eval mode in a forward pre-hook instead (so
          Lightning's "Found N module(s) in eval mode" warning at fit start is expected).
        * Optimizers move parameters whose ``.grad`` is a zero tensor (weight decay,
          momentum): frozen parameters are taken out of the optimizers, and a thawed group
          is added by identity, exactly once (Lightning's ``BaseFinetuning`` compares values,
          so it skips a parameter equal to one already there).
        * DDP synchronises only the parameters that required grad when it was built; a thaw
          under DDP wraps the model again (the new wrapper broadcasts rank 0's state), then
          checks that all ranks hold the same parameters. ``sync_batchnorm=True`` replaces
          BatchNorm layers after setup, which would drop the eval-mode hold: with
          ``bn="eval"`` and frozen BatchNorm layers it is refused at fit start.
        * A submodule reached by another reference (an alias attribute, ``self.aux.module``)
          bypasses the wrapper: aliases registered on the model are refused, and a named
          loss that reaches a ``detach`` branch whose wrapper did not run is a violation.
        * LR schedulers learn of a new group only through ``base_lrs`` (appended); those
          with other per-group state (``LambdaLR``'s lambdas, ``OneCycleLR``) do not schedule
          it.
        * One ``IsolationCallback`` per Trainer: its checkpoint state has a fixed key.
        * A resume repeats the uninterrupted run bit for bit only if the checkpoint holds all
          its state, and Lightning's holds neither the global RNG (dropout) nor a plain
          DataLoader's position: mid-epoch, Lightning iterates the loader from its start
          again. Give the train loader ``state_dict`` / ``load_state_dict`` and checkpoint
          the RNG, or resume from epoch ends.

    >>> callback = IsolationCallback(
    ...     freeze=["trunk"], detach=["probe"], thaw=[Thaw("trunk", epoch=2, lr=1e-3)]
    ... )
    >>> callback
    IsolationCallback(freeze=['trunk'], detach=['probe'], thaw=[trunk at epoch 2, lr=0.001])
    >>> IsolationCallback(verify_every_n_steps=-1)
    Traceback (most recent call last):
    ...
    isolate.lightning.SpecError: IsolationCallback: verify_every_n_steps must be an integer >= 0 ...
    """

    def __init__(
        self,
        *,
        freeze: list[str] | None = None,
        detach: list[str] | None = None,
        clone: list[str] | None = None,
        bn: Literal["eval", "train"] = "eval",
        thaw: list[Thaw | ThawKeys] | None = None,
        protect: dict[str, list[str]] | None = None,
        frozen_in_optimizer: Literal["remove", "error"] = "remove",
        verify_every_n_steps: int = 50,
        on_violation: Literal["raise", "warn"] = "raise",
        log_grad_norms: bool = True,
    ) -> None:
        super().__init__()
        self.freeze = _string_list(freeze, "freeze")
        self.detach = _string_list(detach, "detach")
        self.clone = _string_list(clone, "clone")
        if bn not in ("eval", "train"):
            raise SpecError(f"{_CALLER}: bn must be 'eval' or 'train', got {bn!r}")
        self.bn: Literal["eval", "train"] = bn
        if thaw is not None and (
            isinstance(thaw, (str, Mapping)) or not isinstance(thaw, Sequence)
        ):
            raise SpecError(
                f"{_CALLER}: thaw must be a list of Thaw steps (or mappings), got "
                f"{type(thaw).__name__}"
            )
        self.thaw = tuple(_as_thaw(item, i) for i, item in enumerate(thaw or ()))
        names = [str(t.name) for t in self.thaw]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise SpecError(
                f"{_CALLER}: thaw steps share the names {repeated}; give each a distinct name="
            )
        if protect is not None and not isinstance(protect, Mapping):
            raise SpecError(
                f"{_CALLER}: protect must map loss names to selectors, got {type(protect).__name__}"
            )
        self.protect: dict[str, tuple[str, ...]] | None = (
            None
            if protect is None
            else {str(k): _string_list(v, f"protect[{k!r}]") for k, v in protect.items()}
        )
        if self.protect is not None:
            empty = [k for k, v in self.protect.items() if not v]
            if empty:
                raise SpecError(f"{_CALLER}: protect{empty} select nothing; name what to protect")
        if frozen_in_optimizer not in ("remove", "error"):
            raise SpecError(
                f"{_CALLER}: frozen_in_optimizer must be 'remove' or 'error', got "
                f"{frozen_in_optimizer!r}"
            )
        self.frozen_in_optimizer: Literal["remove", "error"] = frozen_in_optimizer
        if not _is_int(verify_every_n_steps) or verify_every_n_steps < 0:
            raise SpecError(
                f"{_CALLER}: verify_every_n_steps must be an integer >= 0 (0 turns checks off), "
                f"got {verify_every_n_steps!r}"
            )
        self.verify_every_n_steps = verify_every_n_steps
        if on_violation not in ("raise", "warn"):
            raise SpecError(
                f"{_CALLER}: on_violation must be 'raise' or 'warn', got {on_violation!r}"
            )
        self.on_violation: Literal["raise", "warn"] = on_violation
        self.log_grad_norms = bool(log_grad_norms)
        self._run: _Run | None = None
        self._last_state: dict[str, Any] = {}

    def __repr__(self) -> str:
        parts = [f"{k}={list(v)!r}" for k, v in self._spec_args() if v]
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
        return f"{_CALLER}({', '.join(parts)})"

    def _spec_args(self) -> list[tuple[str, tuple[str, ...]]]:
        return [("freeze", self.freeze), ("detach", self.detach), ("clone", self.clone)]

    # ----------------------------------------------------------------------------------------
    # Setup: validate everything, then change

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Validate the spec against the model, then freeze and wrap (``fit`` only)."""
        if stage != "fit":
            return
        if self._run is not None:  # a fit that ended without teardown
            self._restore()
        self._check_trainer(trainer)
        run = self._plan(trainer, pl_module)
        self._apply(run)
        self._run = run

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        callbacks: list[Callback] = getattr(trainer, "callbacks", [])
        others = [c for c in callbacks if isinstance(c, IsolationCallback) and c is not self]
        if others:
            raise SpecError(
                f"{_CALLER}: the Trainer has {len(others) + 1} IsolationCallbacks; their "
                f"checkpoint states would collide: merge them into one"
            )
        strategy = trainer.strategy
        supported = isinstance(strategy, SingleDeviceStrategy) or (
            isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy)
        )
        if not supported:
            raise SpecError(
                f"{_CALLER}: the {type(strategy).__name__} strategy is not supported (it shards "
                f"or re-creates parameters, so freezing by identity cannot hold); use a single "
                f"device, or strategy='ddp' / 'ddp_spawn'"
            )

    def _plan(self, trainer: pl.Trainer, model: pl.LightningModule) -> _Run:
        """Resolve the spec against ``model`` without changing anything."""
        param_names, buffer_names = _clean_names(model)
        frozen: dict[str, nn.Parameter] = {}
        norms: dict[str, _BatchNorm] = {}
        if self.freeze:
            selection = select(model, self.freeze, f"{_CALLER}(freeze)")
            frozen = {param_names[id(p)]: p for p in selection.params.values()}
            norms = dict(selection.norms)
        wraps = self._plan_wraps(model)
        groups = self._plan_groups(model, param_names, frozen)
        protect: dict[str, dict[str, nn.Parameter]] | None = None
        if self.protect is not None:
            protect = {}
            for loss, selectors in self.protect.items():
                chosen = select(model, selectors, f"{_CALLER}(protect[{loss!r}])")
                protect[loss] = {param_names[id(p)]: p for p in chosen.params.values()}
        buffers = {
            buffer_names[id(b)]
            for m in norms.values()
            for b in m.buffers(recurse=False)
            if id(b) in buffer_names
        }
        spec = {
            "freeze": list(frozen),
            "bn": self.bn,
            "bn_held": sorted(buffers) if self.bn == "eval" else [],
            "detach": list(self.detach),
            "clone": list(self.clone),
            "thaw": [
                {
                    "name": g.name,
                    "params": list(g.params),
                    "epoch": g.spec.epoch,
                    "step": g.spec.step,
                    "lr": g.spec.lr,
                    "optimizer_idx": g.spec.optimizer_idx,
                    "bn": g.spec.bn,
                }
                for g in groups
            ],
        }
        return _Run(
            trainer=trainer,
            model=model,
            param_names=param_names,
            buffer_names=buffer_names,
            frozen=frozen,
            norms=norms,
            wraps=wraps,
            groups=groups,
            protect=protect,
            spec=spec,
            modes=[(m, m.training) for m in model.modules()],
        )

    def _plan_wraps(self, model: nn.Module) -> list[_Wrap]:
        both = sorted(set(self.detach) & set(self.clone))
        if both:
            raise SpecError(
                f"{_CALLER}: {both} are both in detach and clone; a branch either gets "
                f"gradient back (clone) or not (detach): pick one"
            )
        wraps: list[_Wrap] = []
        seen: set[int] = set()
        kinds: list[tuple[Literal["detach", "clone"], str]] = [
            *(("detach", n) for n in self.detach),
            *(("clone", n) for n in self.clone),
        ]
        aliases: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            aliases.setdefault(id(module), []).append(name)
        for kind, name in kinds:
            caller = f"{_CALLER}({kind})"
            try:
                child = model.get_submodule(name)
            except AttributeError:
                raise SelectorError(
                    f"{caller}: {name!r} is not a submodule of {describe(model)}; name a "
                    f"submodule with its dotted path, e.g. 'heads.aux'"
                ) from None
            if child is model:
                raise SpecError(f"{caller}: {name!r} names the LightningModule itself")
            if isinstance(child, Wrapper):
                raise WrappingError(
                    f"{caller}: {name!r} is already a {type(child).__name__}; drop it from "
                    f"{kind}, or unwrap it in the model code"
                )
            if id(child) in seen:
                raise SpecError(f"{caller}: {name!r} is listed twice")
            seen.add(id(child))
            names = aliases.get(id(child), [])
            if len(names) > 1:
                raise WrappingError(
                    f"{caller}: {name!r} is registered under {len(names)} names {names}; the "
                    f"callback can replace only one of them, and calls through the others "
                    f"would bypass the wrapper. Keep a single attribute for the branch"
                )
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            wraps.append(_Wrap(kind, name, parent, leaf, child))
        return wraps

    def _plan_groups(
        self,
        model: nn.Module,
        param_names: dict[int, str],
        frozen: dict[str, nn.Parameter],
    ) -> list[_Group]:
        groups: list[_Group] = []
        frozen_ids = {id(p) for p in frozen.values()}
        owner: dict[int, str] = {}
        for spec in self.thaw:
            name = str(spec.name)
            selection = select(model, spec.selectors, f"{_CALLER}(thaw {name!r})")
            params = {param_names[id(p)]: p for p in selection.params.values()}
            outside = [n for n, p in params.items() if id(p) not in frozen_ids]
            if outside:
                raise SpecError(
                    f"{_CALLER}: thaw group {name!r} selects {len(outside)} parameters that "
                    f"freeze does not freeze: {_names(outside)}; thawing them would do nothing "
                    f"and add them to the optimizer twice. Add them to freeze, or narrow the "
                    f"thaw selectors"
                )
            twice = [n for n, p in params.items() if id(p) in owner]
            if twice:
                first = owner[id(params[twice[0]])]
                raise SpecError(
                    f"{_CALLER}: thaw groups {first!r} and {name!r} both select "
                    f"{_names(twice)}; a parameter can be thawed once: split the selectors"
                )
            for p in params.values():
                owner[id(p)] = name
            groups.append(_Group(spec, name, params, dict(selection.norms)))
        return groups

    def _apply(self, run: _Run) -> None:
        """Freeze and wrap; on any failure, undo what was done and re-raise."""
        try:
            if self.freeze:
                run.freeze_handle = freezing.freeze(run.model, *self.freeze, bn=self.bn)
            for w in run.wraps:
                wrapper: Wrapper = (
                    Detached(w.child, name=w.name) if w.kind == "detach" else Cloned(w.child)
                )
                setattr(w.parent, w.leaf, wrapper)
                w.wrapper = wrapper
                if isinstance(wrapper, Detached):
                    run.hooks.append(
                        wrapper.register_forward_pre_hook(
                            self._branch_hook(w.name), with_kwargs=True
                        )
                    )
            run.by_name = dict(run.model.named_parameters(remove_duplicate=False))
        except BaseException:
            self._undo(run)
            raise

    def _branch_hook(self, name: str) -> Any:
        def record(module: nn.Module, args: Any, kwargs: Any) -> None:
            run = self._run
            if run is not None and run.verify_now:
                inputs = [t for t in iter_tensors((args, kwargs)) if t.requires_grad]
                run.branch_inputs.setdefault(name, []).extend(inputs)

        return record

    # ----------------------------------------------------------------------------------------
    # Undo

    def _undo(self, run: _Run) -> None:
        for hook in run.hooks:
            hook.remove()
        run.hooks.clear()
        for name in reversed(run.applied):
            for handle in reversed(run.group(name).handles):
                if handle.active:
                    handle.restore()
        for g in run.groups:  # a group thawed from a checkpoint whose load failed half-way
            for handle in reversed(g.handles):
                if handle.active:
                    handle.restore()
        for w in reversed(run.wraps):
            if w.wrapper is not None:
                if w.parent._modules.get(w.leaf) is w.wrapper:
                    setattr(w.parent, w.leaf, w.wrapper.unwrap())
                else:
                    w.wrapper.unwrap()
                w.wrapper = None
        if run.freeze_handle is not None and run.freeze_handle.active:
            run.freeze_handle.restore()
        run.branch_inputs.clear()
        run.snapshot = None

    def _restore(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            self._undo(run)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Put back the submodules and every flag and mode as they were before ``fit``."""
        if stage == "fit" and self._run is not None:
            self._last_state = self.state_dict()
            self._restore()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Undo everything, as in ``teardown`` (Lightning does not call it after an error), and
        put back every module's ``training`` flag as it was at setup.

        :meth:`state_dict` goes on returning the state at the error: checkpoint callbacks run
        their ``on_exception`` after this one (Lightning orders them last), and
        ``OnExceptionCheckpoint`` saves optimizers that hold the groups thawed so far.
        """
        run = self._run
        if run is None:
            return
        self._last_state = self.state_dict()
        self._restore()
        for module, training in run.modes:
            module.training = training

    # ----------------------------------------------------------------------------------------
    # Fit start: the optimizers

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Take frozen parameters out of the optimizers and plan where thawed ones go."""
        run = self._run
        if run is None:
            return
        try:
            self._check_norms_present(run)
            removals = self._plan_optimizers(run, trainer.optimizers)
        except IsolationError:
            self._restore()
            raise
        self._warn_on_norm_clipping(trainer)
        self._remove_from_optimizers(run, trainer.optimizers, removals)
        for name in run.applied:  # thawed in the checkpoint: same param groups, same order
            self._add_group(trainer, run.group(name))
        self._take_snapshot(run)
        run.fit_started = True
        self._check_ranks(run, "at fit start")

    def _warn_on_norm_clipping(self, trainer: pl.Trainer) -> None:
        # The clip factor is computed from the norm of *all* gradients, so a detached
        # branch's gradient rescales the trunk's: the branch leaks into the trunk's update.
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm").lower()
        if self.detach and trainer.gradient_clip_val and algorithm.endswith("norm"):
            rank_zero_warn(
                f"{_CALLER}: gradient_clip_val={trainer.gradient_clip_val} clips by the global "
                f"norm, which includes the gradients of the detached branches {self.detach}: "
                f"their gradient changes the factor applied to every other parameter, so "
                f"isolation does not hold for the update. Clip per group instead (override "
                f"configure_gradient_clipping), or use gradient_clip_algorithm='value'",
                category=IsolationWarning,
            )

    def _check_norms_present(self, run: _Run) -> None:
        if self.bn != "eval":
            return
        gone = _norm_policy_layers(run.model, run.norms.values())
        if gone:
            raise SpecError(
                f"{_CALLER}: {len(gone)} frozen BatchNorm layers were replaced after setup "
                f"(sync_batchnorm, or a configure_model hook), so bn='eval' no longer holds "
                f"them: {_names(n for n, m in run.norms.items() if m in gone)}. Build the "
                f"layers before fit, or use bn='train'"
            )

    def _plan_optimizers(
        self, run: _Run, optimizers: Sequence[torch.optim.Optimizer]
    ) -> list[tuple[int, int, nn.Parameter]]:
        """Where the spec's parameters sit in the optimizers; decide each group's target."""
        ours = {id(p): n for n, p in run.frozen.items()}
        held: list[tuple[int, int, nn.Parameter]] = []
        for oi, opt in enumerate(optimizers):
            for gi, group in enumerate(opt.param_groups):
                held.extend((oi, gi, p) for p in group["params"] if id(p) in ours)
        stateful = [ours[id(p)] for oi, _, p in held if optimizers[oi].state.get(p)]
        if stateful:
            raise SpecError(
                f"{_CALLER}: the optimizer already holds state for frozen parameters "
                f"{_names(stateful)} at fit start; create the optimizer in configure_optimizers"
            )
        still_frozen = [(oi, gi, p) for oi, gi, p in held if not p.requires_grad]
        if still_frozen and self.frozen_in_optimizer == "error":
            lines = [
                f"  {ours[id(p)]}: optimizer {oi}, param group {gi} "
                f"({_group_risk(optimizers[oi].param_groups[gi])})"
                for oi, gi, p in still_frozen[:_SHOW]
            ]
            raise SpecError(
                f"{_CALLER}: {len(still_frozen)} frozen parameters sit in an optimizer, where "
                f"a zero gradient with weight decay or momentum can still move them:\n"
                + "\n".join(lines)
                + "\nFix: build the optimizer from trainable parameters only "
                "([p for p in self.parameters() if p.requires_grad]), or let the callback take "
                "them out with frozen_in_optimizer='remove'"
            )
        origin: dict[int, set[tuple[int, int]]] = {}
        for oi, gi, p in held:
            origin.setdefault(id(p), set()).add((oi, gi))
        for g in run.groups:
            self._plan_target(g, optimizers, origin)
        return held

    def _plan_target(
        self,
        g: _Group,
        optimizers: Sequence[torch.optim.Optimizer],
        origin: dict[int, set[tuple[int, int]]],
    ) -> None:
        where = f"{_CALLER}: thaw group {g.name!r}"
        slots = set().union(*(origin.get(id(p), set()) for p in g.params.values()))
        homes = sorted({oi for oi, _ in slots})
        absent = [n for n, p in g.params.items() if id(p) not in origin]
        if g.spec.optimizer_idx is not None:
            if g.spec.optimizer_idx >= len(optimizers):
                raise SpecError(
                    f"{where}: optimizer_idx={g.spec.optimizer_idx} but configure_optimizers "
                    f"returned {len(optimizers)} optimizer(s); its parameters "
                    f"{_names(g.params)} would be in no optimizer once thawed"
                )
            target = g.spec.optimizer_idx
        elif len(homes) == 1:
            target = homes[0]
        elif len(homes) > 1:
            raise SpecError(
                f"{where}: its parameters sit in optimizers {homes}; say which one receives "
                f"them with optimizer_idx="
            )
        elif len(optimizers) == 1:
            target = 0
        else:
            raise SpecError(
                f"{where}: its parameters {_names(g.params)} are in no optimizer and "
                f"configure_optimizers returned {len(optimizers)} optimizers, so once thawed "
                f"they would be in no optimizer (never learn); set optimizer_idx= in the thaw "
                f"step"
                + ("" if optimizers else ", and return an optimizer from configure_optimizers")
            )
        opt = optimizers[target]
        sources = sorted({gi for oi, gi in slots if oi == target})
        options: dict[str, Any] = {}
        if len(sources) == 1:
            options = {k: v for k, v in opt.param_groups[sources[0]].items() if k != "params"}
        if g.spec.lr is None:
            if absent or len(sources) != 1:
                detail = (
                    f"{_names(absent)} are in no optimizer group"
                    if absent
                    else f"come from param groups {sources} of optimizer {target}"
                )
                raise SpecError(
                    f"{where}: lr is not set and its parameters {detail}, so there are no "
                    f"settings to give them once thawed; set lr= in the thaw step, or put "
                    f"them in one param group in configure_optimizers (the callback takes "
                    f"them out while they are frozen)"
                )
        else:
            options["lr"] = float(g.spec.lr)
        if any("initial_lr" in group for group in opt.param_groups):
            options["initial_lr"] = options.get("lr", opt.defaults.get("lr"))
        g.optimizer_idx = target
        g.options = options

    def _remove_from_optimizers(
        self,
        run: _Run,
        optimizers: Sequence[torch.optim.Optimizer],
        held: list[tuple[int, int, nn.Parameter]],
    ) -> None:
        if not held:
            return
        drop = {id(p) for _, _, p in held}
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in drop]
        frozen_held = [(oi, gi, p) for oi, gi, p in held if not p.requires_grad]
        if frozen_held:
            by_group: dict[tuple[int, int], list[str]] = {}
            for oi, gi, p in frozen_held:
                by_group.setdefault((oi, gi), []).append(run.param_names[id(p)])
            lines = [
                f"  optimizer {oi}, param group {gi} "
                f"({_group_risk(optimizers[oi].param_groups[gi])}): {_names(names)}"
                for (oi, gi), names in by_group.items()
            ]
            rank_zero_warn(
                f"{_CALLER}: took {len(frozen_held)} frozen parameters out of the optimizers, "
                f"where a zero gradient with weight decay or momentum could move them; a thaw "
                f"step adds them back as a new param group:\n"
                + "\n".join(lines)
                + "\nTo silence this, build the optimizer from trainable parameters only.",
                category=IsolationWarning,
            )

    def _add_group(self, trainer: pl.Trainer, g: _Group) -> None:
        if g.optimizer_idx is None:
            raise SpecError(f"{_CALLER}: thaw group {g.name!r} has no optimizer (fit not started)")
        opt = trainer.optimizers[g.optimizer_idx]
        opt.add_param_group({"params": list(g.params.values()), **g.options})
        lr = opt.param_groups[-1]["lr"]
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            base = getattr(scheduler, "base_lrs", None)
            if (
                getattr(scheduler, "optimizer", None) is opt
                and isinstance(base, list)
                and len(base) == len(opt.param_groups) - 1
            ):
                base.append(g.options.get("initial_lr", lr))

    # ----------------------------------------------------------------------------------------
    # The schedule

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Thaw the groups scheduled by epoch."""
        run = self._run
        if run is None:
            return
        self._thaw_due(trainer, run, "epoch")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Thaw the groups scheduled by step, and arm the checks of this step."""
        run = self._run
        if run is None:
            return
        # Lightning skips on_train_epoch_start for the first epoch of a fit resumed from a
        # checkpoint written after the last batch of the epoch before (the fit loop restarts
        # "mid-epoch" and counts that epoch as done): the epoch's first batch thaws what its
        # start did not, before the groups due by step, as in an uninterrupted run.
        self._thaw_due(trainer, run, "epoch")
        self._thaw_due(trainer, run, "step")
        n = self.verify_every_n_steps
        run.verify_now = bool(n) and trainer.global_step % n == 0
        if run.verify_now and run.verify_step != trainer.global_step:
            run.verify_step = trainer.global_step
            run.losses_seen = False
        run.branch_inputs.clear()

    def _thaw_due(self, trainer: pl.Trainer, run: _Run, by: Literal["epoch", "step"]) -> None:
        now = trainer.current_epoch if by == "epoch" else trainer.global_step
        for g in run.groups:
            at = g.spec.epoch if by == "epoch" else g.spec.step
            if g.applied is None and at is not None and now >= at:
                self._thaw(trainer, run, g)

    def _thaw(self, trainer: pl.Trainer, run: _Run, g: _Group) -> None:
        when = f"epoch {trainer.current_epoch}, step {trainer.global_step}"
        self._check_drift(run, f"before thawing {g.name!r} ({when})")
        self._unfreeze_group(run, g)
        g.applied = {"epoch": trainer.current_epoch, "global_step": trainer.global_step}
        run.applied.append(g.name)
        self._add_group(trainer, g)
        rewrapped = self._rewrap_ddp(trainer)
        self._take_snapshot(run)
        run.pending_rank_check = f"after thawing {g.name!r} ({when})"
        opt = trainer.optimizers[g.optimizer_idx or 0]
        rank_zero_info(
            f"{_CALLER}: thawed {g.name!r} ({len(g.params)} parameters) at {when}: param group "
            f"{len(opt.param_groups) - 1} of optimizer {g.optimizer_idx}, "
            f"lr={opt.param_groups[-1]['lr']}"
            + ("; DDP wrapper rebuilt so its gradients are synchronised" if rewrapped else "")
        )

    def _unfreeze_group(self, run: _Run, g: _Group) -> None:
        ids = {id(p) for p in g.params.values()}

        def chosen(name: str, p: nn.Parameter) -> bool:
            return id(p) in ids

        chosen.__name__ = f"thaw group {g.name!r}"
        g.handles = [freezing.unfreeze(run.model, chosen, bn=g.spec.bn)]
        covered = {id(run.model.get_submodule(n)) for n in g.handles[0].norms}
        for norm in g.norms.values():
            # A BatchNorm without affine parameters is not picked through parameters.
            if id(norm) not in covered and not list(norm.parameters(recurse=False)):
                g.handles.append(freezing.unfreeze(norm, bn=g.spec.bn))

    def _rewrap_ddp(self, trainer: pl.Trainer) -> bool:
        strategy = trainer.strategy
        if not isinstance(strategy.model, DistributedDataParallel):
            return False
        if not isinstance(strategy, DDPStrategy):
            raise SpecError(
                f"{_CALLER}: the model is wrapped in DistributedDataParallel by "
                f"{type(strategy).__name__}, which the callback cannot rebuild; use "
                f"strategy='ddp'"
            )
        # DDP registers only the parameters that require grad when it is built: the thawed
        # group would get unsynchronised gradients and the ranks would drift apart. Building
        # it anew registers them, and broadcasts rank 0's parameters and buffers.
        strategy.model = strategy.lightning_module
        strategy.configure_ddp()
        return True

    # ----------------------------------------------------------------------------------------
    # Checks while training

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        """Check the named losses while their graph is alive (a walk, no backward)."""
        run = self._run
        if run is None:
            return
        losses = getattr(pl_module, LOSSES_ATTRIBUTE, None)
        if losses is not None:
            setattr(pl_module, LOSSES_ATTRIBUTE, {})
        if not run.verify_now or not losses:
            run.branch_inputs.clear()
            return
        if not isinstance(losses, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in losses.items()
        ):
            raise IsolationTypeError(
                f"{_CALLER}: {type(pl_module).__name__}.{LOSSES_ATTRIBUTE} must be a dict of "
                f"loss name -> loss tensor, got {losses!r}"
            )
        run.losses_seen = True
        if run.protect is not None:
            missing = sorted(set(run.protect) - set(losses))
            if missing:
                raise SpecError(
                    f"{_CALLER}: protect names the losses {missing}, but "
                    f"{type(pl_module).__name__}.training_step set {LOSSES_ATTRIBUTE} with "
                    f"{sorted(losses)}; set self.{LOSSES_ATTRIBUTE} = {{'name': loss, ...}} in "
                    f"training_step, with the names used in protect"
                )
        try:
            self._check_losses(run, pl_module, losses, trainer.global_step)
        finally:
            run.branch_inputs.clear()

    def _check_losses(
        self,
        run: _Run,
        model: nn.Module,
        losses: Mapping[str, torch.Tensor],
        step: int,
    ) -> None:
        upstream: dict[str, nn.Parameter] = {}
        if run.protect is None and run.branch_inputs:
            inputs = [t for ts in run.branch_inputs.values() for t in ts]
            for p in self._reached(run, model, inputs):
                upstream.setdefault(self._name(run, p), p)
        frozen = run.frozen_now()
        for loss_name, loss in losses.items():
            reached = {id(p) for p in self._reached(run, model, [loss])}
            self._check_bypass(run, loss_name, reached, step)
            protected = dict(frozen)
            if run.protect is None:
                protected.update(upstream)
            else:
                protected.update(run.protect.get(loss_name, {}))
            leaked = {n: p for n, p in protected.items() if id(p) in reached}
            if not leaked:
                continue
            try:
                assert_isolated(loss, leaked)
            except GradientLeakError as error:
                why = (
                    f"protect[{loss_name!r}]"
                    if run.protect is not None and loss_name in run.protect
                    else "frozen, or upstream of a detach branch"
                )
                self._violation(
                    GradientLeakError(
                        f"{_CALLER}: at step {step}, loss {loss_name!r} reaches "
                        f"{len(leaked)} protected parameters ({why}) {_names(leaked)}:\n"
                        f"{error}"
                    )
                )

    def _reached(
        self, run: _Run, model: nn.Module, outputs: list[torch.Tensor]
    ) -> list[nn.Parameter]:
        names = reachable_parameters(outputs, model)
        if any(n not in run.by_name for n in names):  # modules added after setup
            run.by_name = dict(model.named_parameters(remove_duplicate=False))
        return [run.by_name[n] for n in names]

    def _name(self, run: _Run, p: torch.Tensor) -> str:
        if id(p) not in run.param_names:  # added after setup (configure_model)
            run.param_names, run.buffer_names = _clean_names(run.model)
        return run.param_names.get(id(p), f"<parameter of shape {tuple(p.shape)}>")

    def _check_bypass(self, run: _Run, loss_name: str, reached: set[int], step: int) -> None:
        for w in run.wraps:
            if w.kind != "detach" or w.name in run.branch_inputs:
                continue
            inside = [self._name(run, p) for p in w.child.parameters() if id(p) in reached]
            if inside:
                self._violation(
                    GradientLeakError(
                        f"{_CALLER}: at step {step}, loss {loss_name!r} reaches the parameters "
                        f"of the detach branch {w.name!r} {_names(inside)}, but its Detached "
                        f"wrapper did not run with inputs that require grad: the forward calls "
                        f"the branch some other way (an alias, or self.{w.name}.module(...)), "
                        f"so its inputs are not detached. Call the branch as self.{w.name}(...)"
                    )
                )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Log gradient norms per group at check steps."""
        run = self._run
        if run is None or not run.verify_now or not self.log_grad_norms or not trainer.loggers:
            return
        metrics = self._grad_norms(run)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _grad_norms(self, run: _Run) -> dict[str, float]:
        groups: dict[str, list[nn.Parameter]] = {}
        for w in run.wraps:
            groups[w.name] = list(w.child.parameters())
        for name in run.applied:
            groups[name] = list(run.group(name).params.values())
        placed = {id(p) for ps in groups.values() for p in ps}
        unique = {id(p): p for p in run.model.parameters()}
        groups["rest"] = [p for i, p in unique.items() if i not in placed and p.requires_grad]
        groups["total"] = [p for p in unique.values() if p.requires_grad]
        metrics: dict[str, float] = {}
        for name, params in groups.items():
            grads = [
                p.grad.detach() for p in {id(p): p for p in params}.values() if p.grad is not None
            ]
            if grads:
                norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
                )
                metrics[f"isolation/grad_norm/{name}"] = float(norm)
            else:
                metrics[f"isolation/grad_norm/{name}"] = 0.0
        return metrics

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Check drift, optimizers and ranks at check steps, and ranks after a thaw."""
        run = self._run
        if run is None:
            return
        if run.verify_now:
            step = run.verify_step
            if run.protect and not run.losses_seen:
                raise SpecError(
                    f"{_CALLER}: protect names the losses {sorted(run.protect)}, but "
                    f"{type(pl_module).__name__}.training_step did not set "
                    f"self.{LOSSES_ATTRIBUTE} at step {step}; set it to a dict "
                    f"{{'loss name': loss_tensor}} in every training_step"
                )
            self._check_drift(run, f"at step {step}")
            self._check_flags(run, step)
            self._check_optimizers(run, trainer, step)
            self._check_ranks(run, f"at step {step}")
            run.pending_rank_check = None
        elif run.pending_rank_check is not None:
            self._check_ranks(run, run.pending_rank_check)
            run.pending_rank_check = None
        run.verify_now = False
        run.branch_inputs.clear()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A last check of drift and ranks."""
        run = self._run
        if run is None:
            return
        self._check_drift(run, "at the end of training")
        self._check_ranks(run, "at the end of training")

    def _take_snapshot(self, run: _Run) -> None:
        tensors: dict[str, torch.Tensor] = dict(run.frozen_now())
        if self.bn == "eval":
            for m in run.norms_now().values():
                for b in m.buffers(recurse=False):
                    tensors[run.buffer_names.get(id(b), f"<buffer of {type(m).__name__}>")] = b
        # Copies live in host memory: a frozen backbone must not cost accelerator memory twice.
        run.snapshot = snapshot(tensors, device="cpu") if tensors else None

    def _check_drift(self, run: _Run, when: str) -> None:
        if run.snapshot is None:
            return
        try:
            run.snapshot.assert_unchanged()
        except DriftError as error:
            self._take_snapshot(run)  # with "warn", report each move once
            self._violation(DriftError(f"{_CALLER}: frozen tensors moved ({when}): {error}"))

    def _check_flags(self, run: _Run, step: int) -> None:
        unfrozen = [n for n, p in run.frozen_now().items() if p.requires_grad]
        if unfrozen:
            self._violation(
                DriftError(
                    f"{_CALLER}: at step {step}, {len(unfrozen)} frozen parameters require grad "
                    f"again: {_names(unfrozen)}; something other than the callback unfroze "
                    f"them (another finetuning callback, or model code). Thaw them with a "
                    f"Thaw step instead"
                )
            )

    def _check_optimizers(self, run: _Run, trainer: pl.Trainer, step: int) -> None:
        frozen = {id(p) for p in run.frozen_now().values()}
        exposed: list[str] = []
        for oi, opt in enumerate(trainer.optimizers):
            for e in optimizer_exposure(opt):
                p = opt.param_groups[e.group]["params"][e.index]
                if id(p) in frozen and e.at_risk:
                    exposed.append(
                        f"{self._name(run, p)} (optimizer {oi}, group {e.group}: "
                        f"{'; '.join(e.reasons)})"
                    )
        if exposed:
            self._violation(
                DriftError(
                    f"{_CALLER}: at step {step}, frozen parameters are back in an optimizer "
                    f"that can move them: {_names(exposed)}; something added them after fit "
                    f"start. Thaw them with a Thaw step instead"
                )
            )

    def _check_ranks(self, run: _Run, when: str) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        params = list({id(p): p for p in run.model.parameters()}.values())
        # Exact: the elementwise max and min over ranks agree only where every rank holds the
        # same value. Buckets bound the extra memory (float64 holds every float16/32 exactly).
        spread: dict[int, tuple[int, float]] = {}
        bucket: list[torch.Tensor] = []
        size = 0
        for i, p in enumerate(params):
            t = p.detach()
            bucket.append((torch.view_as_real(t) if t.is_complex() else t).reshape(-1))
            size += bucket[-1].numel()
            if size >= _RANK_CHECK_BUCKET or i == len(params) - 1:
                self._reduce_bucket(bucket, i - len(bucket) + 1, spread)
                bucket, size = [], 0
        if not spread:
            return
        names = [self._name(run, params[i]) for i in spread]
        lines = [
            f"  {name}: {count} of {params[i].numel()} elements, max spread {top:.3e}"
            for name, (i, (count, top)) in zip(names, spread.items(), strict=True)
        ]
        self._violation(
            RankDivergenceError(
                f"{_CALLER}: parameters differ across the {dist.get_world_size()} ranks "
                f"({when}): {_names(names)}\n"
                + "\n".join(lines[:_SHOW])
                + "\nDDP synchronises only the parameters that required grad when it was "
                "built: thaw with a Thaw step of this callback (it rebuilds the wrapper), not "
                "by setting requires_grad in another callback or in model code"
            )
        )

    @staticmethod
    def _reduce_bucket(
        bucket: list[torch.Tensor], first: int, spread: dict[int, tuple[int, float]]
    ) -> None:
        flat = torch.cat([t.double() for t in bucket])
        high, low = flat.clone(), flat
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        differ = (high != low) & ~(high.isnan() & low.isnan())
        if not bool(differ.any()):
            return
        gap = (high - low).abs()
        offset = 0
        for j, t in enumerate(bucket):
            n = t.numel()
            count = int(differ[offset : offset + n].sum())
            if count:
                spread[first + j] = (count, float(gap[offset : offset + n].max()))
            offset += n

    def _violation(self, error: IsolationError) -> None:
        if self.on_violation == "raise":
            raise error
        warnings.warn(str(error), IsolationWarning, stacklevel=3)

    # ----------------------------------------------------------------------------------------
    # Checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The spec, what is frozen now and when each group was thawed, by parameter name."""
        run = self._run
        if run is None:
            return dict(self._last_state)
        state: dict[str, Any] = _plain(
            {
                "format": _STATE_FORMAT,
                "spec": run.spec,
                "frozen": list(run.frozen_now()),
                "thawed": [{"name": n, **(run.group(n).applied or {})} for n in run.applied],
            }
        )
        return state

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Refuse a checkpoint that holds no state of this callback."""
        if self._run is None:
            return
        if self.state_key not in (checkpoint.get("callbacks") or {}):
            raise CheckpointMismatchError(
                f"{_CALLER}: the checkpoint holds no {_CALLER} state: it was written without "
                f"this callback, so it is unknown what was frozen or thawed. To start a new "
                f"isolation schedule from its weights, load them with "
                f"model.load_state_dict(torch.load(path, weights_only=True)['state_dict']) and "
                f"call fit() without ckpt_path"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the checkpoint's spec against this one, then thaw what it had thawed.

        Runs before DDP wraps the model, so thawed groups are synchronised from the start;
        groups thawed in the checkpoint are not frozen again.

        Raises:
            CheckpointMismatchError: the checkpoint was written under another spec.
        """
        run = self._run
        if run is None:
            self._last_state = dict(state_dict)
            return
        try:
            self._check_state(run, state_dict)
            for entry in state_dict["thawed"]:
                g = run.group(entry["name"])
                self._unfreeze_group(run, g)
                g.applied = {"epoch": entry["epoch"], "global_step": entry["global_step"]}
                run.applied.append(g.name)
            frozen = list(run.frozen_now())
            if frozen != list(state_dict["frozen"]):
                raise CheckpointMismatchError(
                    f"{_CALLER}: the checkpoint lists {_names(state_dict['frozen'])} as frozen, "
                    f"but its schedule leaves {_names(frozen)} frozen; the checkpoint is "
                    f"inconsistent"
                )
        except IsolationError:
            self._restore()
            raise

    def _check_state(self, run: _Run, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointMismatchError(
                f"{_CALLER}: the checkpoint's state has format {got!r}, expected {_STATE_FORMAT}"
            )
        missing = [k for k in ("spec", "frozen", "thawed") if k not in state]
        if missing or not isinstance(state["spec"], Mapping):
            raise CheckpointMismatchError(
                f"{_CALLER}: the checkpoint's state is malformed: it lacks {missing or ['spec']}"
            )
        saved, ours = state["spec"], run.spec
        lines = []
        for key in ours:
            if saved.get(key) == ours[key]:
                continue
            if key == "thaw" and isinstance(saved.get(key), list):
                lines.extend(_thaw_differences(saved[key], ours[key]))
                continue
            if isinstance(ours[key], list) and all(isinstance(v, str) for v in ours[key]):
                gone = [v for v in saved.get(key, []) if v not in ours[key]]
                new = [v for v in ours[key] if v not in saved.get(key, [])]
                detail = f"only in the checkpoint {_names(gone)}, only in this run {_names(new)}"
                if not gone and not new:
                    detail = "same names in another order"
            else:
                detail = f"checkpoint {saved.get(key)!r}, this run {ours[key]!r}"
            lines.append(f"  {key}: {detail}")
        if lines:
            raise CheckpointMismatchError(
                f"{_CALLER}: the checkpoint was written under a different isolation spec:\n"
                + "\n".join(lines)
                + "\nFix: resume with the callback arguments of the run that wrote it, or load "
                "only its weights (model.load_state_dict(torch.load(path, weights_only=True)"
                "['state_dict'])) to start a new run under the new spec"
            )
        names = [entry.get("name") for entry in state["thawed"]]
        unknown = [n for n in names if n not in {g.name for g in run.groups}]
        if unknown:
            raise CheckpointMismatchError(
                f"{_CALLER}: the checkpoint thawed groups {unknown} that this spec does not have"
            )


def _thaw_differences(saved: list[Any], ours: list[dict[str, Any]]) -> list[str]:
    """One line per thaw group that differs, naming the fields; groups are matched by name."""
    theirs = {str(g.get("name")): g for g in saved if isinstance(g, Mapping)}
    mine = {g["name"]: g for g in ours}
    lines = []
    gone = [n for n in theirs if n not in mine]
    new = [n for n in mine if n not in theirs]
    if gone or new:
        lines.append(
            f"  thaw: groups only in the checkpoint {_names(gone)}, only in this run {_names(new)}"
        )
    for name, group in mine.items():
        other = theirs.get(name)
        if other is None:
            continue
        fields_ = []
        for k, v in group.items():
            was = other.get(k)
            if was == v:
                continue
            if k == "params" and isinstance(was, list):
                gone, added = [n for n in was if n not in v], [n for n in v if n not in was]
                fields_.append(
                    f"params only in the checkpoint {_names(gone)}, only in this run "
                    f"{_names(added)}"
                )
            else:
                fields_.append(f"{k} {was!r} in the checkpoint, {v!r} in this run")
        if fields_:
            lines.append(f"  thaw group {name!r}: " + "; ".join(fields_))
    if not lines:
        lines.append("  thaw: the same groups in another order")
    return lines


def _plain(value: object) -> Any:
    """``value`` rebuilt from exact builtins, so ``torch.load(weights_only=True)`` reads it back:
    a numpy float (``Thaw(lr=np.float64(1e-3))`` passes as a float) or an enum would be pickled
    as its class, and the checkpoint could not be resumed under torch's default."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    for kind in (bool, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise IsolationTypeError(
        f"{_CALLER}: cannot save {type(value).__name__} {value!r} in a checkpoint's state; "
        f"expected plain str, int, float, bool, None, lists and dicts"
    )


def _group_risk(group: Mapping[str, Any]) -> str:
    """What in a param group can move a parameter whose gradient is zero."""
    risks = []
    if group.get("weight_decay"):
        risks.append(f"weight_decay={group['weight_decay']}")
    if group.get("momentum"):
        risks.append(f"momentum={group['momentum']}")
    if "betas" in group:
        risks.append(f"betas={tuple(group['betas'])}")
    return ", ".join(risks) if risks else "no weight decay or momentum"
