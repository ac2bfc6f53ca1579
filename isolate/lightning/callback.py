"""The Lightning adapter: each hook drives the core :class:`~isolate.IsolationHandle`."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import nn

from isolate.errors import (
    IsolationError,
    IsolationTypeError,
    IsolationWarning,
    SpecError,
)
from isolate.ledger import Ledger
from isolate.lightning._compat import Callback, package
from isolate.lightning.checkpoint import SavedState
from isolate.lightning.metrics import grad_norms, log_figure
from isolate.lightning.notices import (
    explain_eval_modes,
    print_ledger,
    warn_on_norm_clipping,
    warn_unvalidated,
)
from isolate.lightning.strategies import (
    applies_at_fit_start,
    check_trainer,
    load_state_first,
    rewrap,
)
from isolate.spec import IsolationSpec, Thaw, ThawKeys
from isolate.spec.cadence import Cadence
from isolate.spec.handle import IsolationHandle, Tally
from isolate.spec.isolation import apply as apply_spec

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["LOSSES_ATTRIBUTE", "IsolationCallback"]

LOSSES_ATTRIBUTE = "isolation_losses"
"""The attribute of the LightningModule where ``training_step`` leaves its named losses."""

_CALLER = "IsolationCallback"
_DEFAULTS: dict[str, Any] = {
    "freeze": None,
    "detach": None,
    "clone": None,
    "bn": "eval",
    "thaw": None,
    "protect": None,
    "frozen_in_optimizer": "remove",
    "mode": None,
    "contracts": None,
}


def _warn(message: str) -> None:
    warnings.warn(message, IsolationWarning, stacklevel=2)


class IsolationCallback(Callback):
    """Freeze, detach, clone and thaw by name, and check while training that isolation holds.

    A thin adapter over :class:`isolate.IsolationSpec`: ``setup("fit")`` applies the spec
    (before ``configure_optimizers`` and DDP), ``on_fit_start`` attaches the optimizers, each
    batch runs the thaw schedule, and every ``verify_every_n_steps`` optimizer steps
    :meth:`~isolate.spec.handle.IsolationHandle.verify` checks reach, replaced parameters,
    drift, flags, optimizers and ranks. It adds: DDP rebuilt after a thaw, gradient norms per
    group in the loggers (``isolation/grad_norm/<group>``), the spec's state in checkpoints (a
    resume thaws what was thawed, before DDP wraps the model); ``teardown`` and
    ``on_exception`` undo it all.

    **Naming losses.** ``training_step`` leaves the losses to check in
    ``self.isolation_losses``, a dict of name -> loss tensor, set every step (holding
    references costs nothing); the callback reads it in ``on_before_backward``, while the
    graph is alive, and clears it. Each named loss must not reach the parameters
    ``protect[name]`` selects; without ``protect``, each must reach no parameter upstream
    of a ``detach`` branch. No named loss may reach a frozen parameter.

    Args:
        spec: the :class:`~isolate.IsolationSpec`; or give its keywords instead.
        freeze: what to freeze, as ``IsolationSpec(freeze=...)``.
        detach: the branches to detach, as ``IsolationSpec(detach=...)``.
        clone: the branches to clone, as ``IsolationSpec(clone=...)``.
        bn: how frozen BatchNorm layers behave, as ``IsolationSpec(bn=...)``.
        thaw: the thaw steps, as ``IsolationSpec(thaw=...)`` (items may be
            :class:`ThawKeys` mappings).
        protect: loss name -> what it must not reach, as ``IsolationSpec(protect=...)``.
        frozen_in_optimizer: as ``IsolationSpec(frozen_in_optimizer=...)``.
        mode: hold the frozen part in eval mode as a whole, as ``IsolationSpec(mode=...)``.
        contracts: the methods' contracts, as ``IsolationSpec(contracts=...)`` (mappings
            with a ``kind``).
        verify_every_n_steps: how often to check, in optimizer steps (step 0 included);
            ``0`` turns the periodic checks and gradient-norm logging off.
        on_violation: ``"raise"`` an error naming the parameters, or ``"warn"`` with an
            :class:`~isolate.IsolationWarning` and carry on.
        log_grad_norms: whether to log gradient norms per group at each check.
        log_figures: whether to log, at each check, the losses x groups figure of
            :func:`isolate.gradient_report` (with the parameters cut off from the loss) to the
            loggers that take figures (TensorBoard's ``add_figure``). Costs one
            ``autograd.grad`` per named loss at check steps; needs matplotlib.
        expected_unused: selectors of parameters that may go without gradient on a step
            (a mixture-of-experts expert no token was routed to). Every other trainable
            parameter must be reached by the loss backpropagated at each check step and on
            the first step after a thaw, else a :class:`~isolate.errors.CutOffError`.
        drift: how frozen tensors are watched: ``"fingerprint"`` (O(number of tensors) host
            memory, any changed bit caught) or ``"copy"`` (a host copy of the frozen part; the
            report gives the size of a change).
        ledger: print :func:`isolate.ledger.ledger` of the model once, at the first training
            step (when the first losses exist; on rank zero, as ``ModelSummary`` prints at fit
            start), and log its summary (``isolation/ledger/*``); it is kept in
            :attr:`ledger`. The contracts' verdicts of the fit are kept in :attr:`verdicts`.

    Raises:
        SpecError: (at construction) an argument has the wrong type or value; (at setup and
            fit start) the spec does not fit the model or the optimizers. Nothing is left
            changed.
        SelectorError: a selector matches nothing, or a ``detach`` / ``clone`` name is not a
            submodule.
        CheckpointMismatchError: resuming from a checkpoint written under another spec, or
            without the callback; checked before the strategy loads the weights, so the model
            keeps its own.
        GradientLeakError, DriftError, RankDivergenceError: a violation during training
            (``on_violation="raise"``).

    Note:
        Traps it handles, and the ones it cannot (the engine's own are in
        :class:`~isolate.spec.handle.IsolationHandle`):

        * Lightning calls ``model.train()`` every epoch and resets ``training`` flags after
          validation by assignment; ``bn="eval"`` (``mode="eval"``: the whole frozen part)
          holds layers in a forward pre-hook instead, so Lightning's "Found N module(s) in
          eval mode" warning at fit start is expected: the callback says how many it holds.
          ``sync_batchnorm=True`` replaces the layers after setup, which would drop the
          hold: it is refused at fit start.
        * DDP synchronises only the parameters that required grad when it was built; a thaw
          under DDP wraps the model again, then checks that all ranks agree.
        * Global-norm gradient clipping couples detached branches to the rest (warned).
        * One ``IsolationCallback`` per Trainer: its checkpoint state has a fixed key.
        * A resume repeats the uninterrupted run bit for bit only if the checkpoint holds all
          its state; Lightning's holds neither the global RNG (dropout) nor a plain
          DataLoader's position. Resume from epoch ends, or checkpoint those too.

    >>> callback = IsolationCallback(
    ...     freeze=["trunk"], detach=["probe"], thaw=[Thaw("trunk", epoch=2, lr=1e-3)]
    ... )
    >>> callback
    IsolationCallback(freeze=['trunk'], detach=['probe'], thaw=[trunk at epoch 2, lr=0.001])
    >>> IsolationCallback(verify_every_n_steps=-1)
    Traceback (most recent call last):
    ...
    isolate.errors.SpecError: IsolationCallback: verify_every_n_steps must be an integer >= 0 ...
    """

    def __init__(
        self,
        *,
        spec: IsolationSpec | None = None,
        freeze: list[str] | None = None,
        detach: list[str] | None = None,
        clone: list[str] | None = None,
        bn: Literal["eval", "train"] = "eval",
        thaw: list[Thaw | ThawKeys] | None = None,
        protect: dict[str, list[str]] | None = None,
        frozen_in_optimizer: Literal["remove", "error"] = "remove",
        mode: Literal["eval", "train"] | None = None,
        contracts: list[dict[str, Any]] | None = None,
        verify_every_n_steps: int = 50,
        on_violation: Literal["raise", "warn"] = "raise",
        log_grad_norms: bool = True,
        log_figures: bool = False,
        drift: Literal["fingerprint", "copy"] = "fingerprint",
        expected_unused: list[str] | None = None,
        ledger: bool = True,
    ) -> None:
        super().__init__()
        given = {
            "freeze": freeze,
            "detach": detach,
            "clone": clone,
            "bn": bn,
            "thaw": thaw,
            "protect": protect,
            "frozen_in_optimizer": frozen_in_optimizer,
            "mode": mode,
            "contracts": contracts,
        }
        self.spec = _spec(spec, {k: v for k, v in given.items() if v != _DEFAULTS[k]})
        self.cadence = Cadence.checked(verify_every_n_steps, expected_unused, on_violation, _CALLER)
        if drift not in ("fingerprint", "copy"):
            raise SpecError(f"{_CALLER}: drift must be 'fingerprint' or 'copy', got {drift!r}")
        self.log_grad_norms = bool(log_grad_norms)
        self.log_figures = bool(log_figures)
        self.drift: Literal["fingerprint", "copy"] = drift
        self.print_ledger = bool(ledger)
        self.ledger: Ledger | None = None
        self.verdicts: dict[str, Any] = {}  # the contracts' verdicts of the last fit
        self.handle: IsolationHandle | None = None
        self.tally = Tally()  # the last fit's handle.tally, kept after the handle is restored
        self.saved = SavedState(_CALLER)
        self._modes: list[tuple[nn.Module, bool]] = []
        self._validations = 0  # validation runs seen in this fit (monitor thaws need them)

    def __repr__(self) -> str:
        return repr(self.spec).replace(type(self.spec).__name__, _CALLER, 1)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Validate the spec against the model, then freeze and wrap (``fit`` only)."""
        if stage != "fit":
            return
        self._restore()  # a fit that ended without teardown
        check_trainer(trainer, self, _CALLER)
        _check_validation(trainer, pl_module, self.spec)
        self._validations = 0
        self._modes = [(m, m.training) for m in pl_module.modules()]
        if applies_at_fit_start(trainer):  # FSDP2: configure_model replaces the parameters
            return
        self._apply(pl_module)
        # A resume loads the weights before callbacks see the checkpoint: check it first.
        self.saved.check_before_weights(trainer, self.state_key, self._handle())

    def _apply(self, pl_module: pl.LightningModule) -> None:
        self.handle = apply_spec(self.spec, pl_module, caller=_CALLER, warn=_warn, drift=self.drift)
        self.verdicts = self.handle.contracts.verdicts  # updated in place, kept after teardown
        self.tally = self.handle.tally
        cadence = self.cadence
        self.handle.check_every(
            cadence.every,
            expected_unused=cadence.expected_unused,
            on_violation=cadence.on_violation,
            losses_hint=(
                f"{type(pl_module).__name__}.training_step did not set self.{LOSSES_ATTRIBUTE} "
                "at step {step}; set it to a dict {{'loss name': loss_tensor}} in every "
                "training_step"
            ),
        )

    def _handle(self) -> IsolationHandle:
        if self.handle is None:  # pragma: no cover - every caller checks first
            raise SpecError(f"{_CALLER}: the spec is not applied")
        return self.handle

    def _restore(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None and handle.active:
            # The optimizers stay as they are: a checkpoint saved after an error must hold the
            # param groups thawed so far, and they are not used after fit.
            handle.restore(optimizers=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Put back the submodules and every flag and mode as they were before ``fit``."""
        if stage == "fit" and self.handle is not None:
            self.saved.keep(self.handle)
            self._restore()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Undo everything, as in ``teardown`` (Lightning does not call it after an error), and
        put back every module's ``training`` flag as it was at setup.

        :meth:`state_dict` goes on returning the state at the error: checkpoint callbacks run
        their ``on_exception`` after this one (Lightning orders them last).
        """
        if self.handle is None:
            return
        self.saved.keep(self.handle)
        self._restore()
        for module, training in self._modes:
            module.training = training

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Take frozen parameters out of the optimizers and plan where thawed ones go."""
        self.saved.no_resume(trainer)
        at_fit_start = self.handle is None and applies_at_fit_start(trainer)
        if at_fit_start:
            # Resolved by name against the sharded module; a resume thaws what was thawed
            # now, before the strategy loads the optimizer state into the param groups.
            self._apply(pl_module)
            load_state_first(trainer, self.state_key, self.load_state_dict, _CALLER)
        if self.handle is None:
            return
        try:
            self.handle.attach(
                trainer.optimizers,
                [c.scheduler for c in trainer.lr_scheduler_configs],
                built_before_apply=at_fit_start,  # configure_optimizers saw nothing frozen
            )
        except IsolationError:
            self._restore()
            raise
        warn_on_norm_clipping(trainer, self.spec.detach)
        explain_eval_modes(pl_module)
        self.ledger = None
        self.handle.verify(
            checks=("ranks",), on_violation=self.cadence.on_violation, when="at fit start"
        )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Thaw the groups due at this epoch."""
        self._begin(trainer, arm=False)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Thaw the groups due, and arm the checks of this step (also thaws by epoch:
        Lightning skips ``on_train_epoch_start`` for the first epoch of a fit resumed from a
        checkpoint written after the last batch of the epoch before)."""
        self._begin(trainer, arm=True)

    def _begin(self, trainer: pl.Trainer, *, arm: bool) -> None:
        if self.handle is None:
            return
        epoch, step = trainer.current_epoch, trainer.global_step
        thawed = self.handle.loop.begin_step(epoch=epoch, step=step, arm=arm)
        if not thawed:
            return
        rewrapped = rewrap(trainer, _CALLER)
        for name in thawed:
            g = self.handle.plan.group(name)
            rank_zero_info(
                f"{_CALLER}: thawed {name!r} ({len(g.params)} parameters) at epoch {epoch}, "
                f"step {step}"
                + ("; DDP wrapper rebuilt so its gradients are synchronised" if rewrapped else "")
            )

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        """Check the named losses while their graph is alive (a walk, no backward)."""
        if self.handle is None:
            return
        losses = _take_losses(pl_module)
        if self.print_ledger and self.ledger is None:
            self.ledger = print_ledger(trainer, pl_module, self.handle, losses, loss)
        if self.handle.loop.checking and losses:
            _check_named(pl_module, losses, self.spec.protect)
        self.handle.loop.before_backward(loss, losses if self.handle.loop.checking else None)
        if self.log_figures and self.handle.loop.checking and losses:
            log_figure(trainer, pl_module, losses, loss, self.cadence.expected_unused)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Log gradient norms per group at check steps."""
        if self.handle is None or not self.handle.loop.checking or not self.log_grad_norms:
            return
        if trainer.loggers:
            metrics = grad_norms(self.handle)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Check reach, params, drift, flags, optimizers and ranks at check steps, reach on the
        first step after a thaw, and ranks after a thaw."""
        if self.handle is not None:
            self.handle.loop.end_step()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Give the validation metrics to the ``monitor`` thaws (rank 0's, on every rank)."""
        if self.handle is None or trainer.sanity_checking or not _monitors(self.spec):
            return
        self._validations += 1
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        for name in self.handle.observe(trainer.strategy.broadcast(metrics)):
            rank_zero_info(f"{_CALLER}: {name!r} is due: its metric stopped improving")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A last check of drift and ranks; a warning if a ``monitor`` thaw never saw a
        validation run (no ``val_dataloader``, or validation less often than the fit lasted)."""
        if self.handle is None:
            return
        self.handle.loop.finish()
        if not self._validations:
            warn_unvalidated(self.handle, trainer)

    def state_dict(self) -> dict[str, Any]:
        """The spec, what is frozen now and when each group was thawed, by parameter name."""
        return self.saved.state(self.handle)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Refuse a checkpoint that holds no state of this callback."""
        if self.handle is not None:
            self.saved.require(checkpoint, self.state_key)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the checkpoint's spec against this one, then thaw what it had thawed (before
        DDP wraps the model, so thawed groups are synchronised from the start; groups thawed
        in the checkpoint are not frozen again).

        Raises:
            CheckpointMismatchError: the checkpoint was written under another spec.
        """
        try:
            self.saved.load(self.handle, state_dict)
        except IsolationError:
            self._restore()
            raise


def _spec(spec: object, keywords: dict[str, Any]) -> IsolationSpec:
    if spec is not None:
        if not isinstance(spec, IsolationSpec):
            raise SpecError(
                f"{_CALLER}: spec must be an isolate.IsolationSpec, got {type(spec).__name__}"
                f"; for a mapping use IsolationSpec.from_dict(...)"
            )
        if keywords:
            raise SpecError(
                f"{_CALLER}: give spec= or the spec's keywords {sorted(keywords)}, not both"
            )
        return spec
    try:
        return IsolationSpec(**keywords)
    except SpecError as error:  # name what the user called
        message = str(error).replace("IsolationSpec:", f"{_CALLER}:", 1)
        raise SpecError(message) from None


def _monitors(spec: IsolationSpec) -> bool:
    return any(t.monitor is not None for t in spec.thaw)


def _check_validation(
    trainer: pl.Trainer, pl_module: pl.LightningModule, spec: IsolationSpec
) -> None:
    """Refuse ``monitor`` thaws in a fit that cannot validate: they would never thaw."""
    watching = {str(t.name): str(t.monitor) for t in spec.thaw if t.monitor is not None}
    if not watching:
        return
    if trainer.limit_val_batches == 0:
        why = "limit_val_batches=0"
    elif not _overrides(pl_module, "validation_step"):
        why = f"{type(pl_module).__name__} defines no validation_step"
    else:
        return
    raise SpecError(
        f"{_CALLER}: thaw groups {sorted(watching)} wait for {sorted(set(watching.values()))} "
        f"to stop improving, but this fit runs no validation ({why}), so they would never "
        f"thaw; log the metric in a validation_step and validate, or give them epoch= or step="
    )


def _overrides(pl_module: pl.LightningModule, hook: str) -> bool:
    lightning = package(pl_module, "LightningModule")
    if lightning is None:
        raise IsolationTypeError(
            f"{_CALLER}: expected a LightningModule, got {type(pl_module).__qualname__}"
        )
    return bool(lightning.utilities.model_helpers.is_overridden(hook, pl_module))


def _take_losses(pl_module: pl.LightningModule) -> Any:
    """The named losses ``training_step`` left, cleared so that each is read once."""
    losses = getattr(pl_module, LOSSES_ATTRIBUTE, None)
    if losses is not None:
        setattr(pl_module, LOSSES_ATTRIBUTE, {})
    return losses


def _check_named(
    pl_module: pl.LightningModule, losses: object, protect: Mapping[str, Any] | None
) -> None:
    if not isinstance(losses, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in losses.items()
    ):
        raise IsolationTypeError(
            f"{_CALLER}: {type(pl_module).__name__}.{LOSSES_ATTRIBUTE} must be a dict of "
            f"loss name -> loss tensor, got {losses!r}"
        )
    missing = sorted(set(protect or {}) - set(losses))
    if missing:
        raise SpecError(
            f"{_CALLER}: protect names the losses {missing}, but "
            f"{type(pl_module).__name__}.training_step set {LOSSES_ATTRIBUTE} with "
            f"{sorted(losses)}; set self.{LOSSES_ATTRIBUTE} = {{'name': loss, ...}} in "
            f"training_step, with the names used in protect"
        )
