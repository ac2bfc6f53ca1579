"""The Lightning adapter: each hook drives the core :class:`~isolate.IsolationHandle`."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import nn

from isolate.errors import IsolationError, IsolationWarning, SpecError
from isolate.ledger import Ledger
from isolate.lightning._compat import Callback
from isolate.lightning.checkpoint import SavedState
from isolate.lightning.losses import LOSSES_ATTRIBUTE, check_named, take_losses
from isolate.lightning.metrics import grad_norms, log_figure
from isolate.lightning.notices import (
    explain_eval_modes,
    print_ledger,
    warn_on_norm_clipping,
    warn_unvalidated,
)
from isolate.lightning.preflight import check_validation, monitors, optimizers_of, spec_of
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

__all__ = ["IsolationCallback"]

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

    A thin adapter over :class:`isolate.IsolationSpec` and its handle's
    :class:`~isolate.spec.cadence.Loop`: ``setup("fit")`` applies the spec, ``on_fit_start``
    attaches the optimizers, each batch runs the thaw schedule and the checks due, and the
    spec's state goes into checkpoints; ``teardown`` and ``on_exception`` undo it all.
    ``training_step`` names the losses to check in ``self.isolation_losses`` (a dict of
    name -> loss tensor). The guide, with the traps it handles and the ones it cannot, is
    docs/lightning.md.

    Args:
        spec: the :class:`~isolate.IsolationSpec`; or give its keywords instead (``freeze``,
            ``detach``, ``clone``, ``bn``, ``thaw``, ``protect``, ``frozen_in_optimizer``,
            ``mode``, ``contracts``, each as ``IsolationSpec``'s).
        verify_every_n_steps: how often to check, in optimizer steps (step 0 included);
            ``0`` turns the periodic checks and gradient-norm logging off.
        on_violation: ``"raise"`` an error naming the parameters, or ``"warn"`` and carry on.
        log_grad_norms: log gradient norms per group at each check.
        log_figures: log :func:`isolate.gradient_report`'s figure at each check (needs
            matplotlib and a logger with ``add_figure``).
        drift: how frozen tensors are watched, as ``IsolationSpec.apply(drift=)``.
        expected_unused: selectors of parameters that may go without gradient on a step.
        ledger: print :func:`isolate.ledger.ledger` once, at the first training step (kept
            in :attr:`ledger`); the contracts' verdicts are kept in :attr:`verdicts`.

    Raises:
        SpecError: an argument, the spec against the model, or the optimizers is wrong;
            nothing is left changed.
        SelectorError: a selector matches nothing.
        CheckpointMismatchError: a resume from a checkpoint written under another spec, or
            without the callback (checked before the weights load).
        GradientLeakError, DriftError, RankDivergenceError: a violation during training.

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
        self.spec = spec_of(spec, {k: v for k, v in given.items() if v != _DEFAULTS[k]}, _CALLER)
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
        check_validation(trainer, pl_module, self.spec, _CALLER)
        self._validations = 0
        self._modes = [(m, m.training) for m in pl_module.modules()]
        if applies_at_fit_start(trainer):  # FSDP2: configure_model replaces the parameters
            return
        handle = self._apply(pl_module)
        # A resume loads the weights before callbacks see the checkpoint: check it first.
        self.saved.check_before_weights(trainer, self.state_key, handle)

    def _apply(self, pl_module: pl.LightningModule) -> IsolationHandle:
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
                optimizers_of(trainer, pl_module, self.spec, _CALLER),
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
        losses = take_losses(pl_module)
        if self.print_ledger and self.ledger is None:
            self.ledger = print_ledger(trainer, pl_module, self.handle, losses, loss)
        if self.handle.loop.checking and losses is not None:  # a zero loss is falsy
            check_named(pl_module, losses, self.spec.protect, _CALLER)
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
        if self.handle is None or trainer.sanity_checking or not monitors(self.spec):
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
