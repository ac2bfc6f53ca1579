"""The transformers adapter: each ``Trainer`` event drives the core handle's
:class:`~isolate.spec.cadence.Loop`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from isolate.errors import BlindSpotError, SpecError
from isolate.spec import IsolationSpec
from isolate.spec.cadence import Cadence
from isolate.spec.handle import IsolationHandle, Tally, warn_user
from isolate.spec.isolation import apply as apply_spec
from isolate.transformers.trainer import (
    check_evaluation,
    check_trainer,
    saved_state,
    torch_optimizer,
    unwrap_methods,
    warn_on_norm_clipping,
    wrap_methods,
)

__all__ = ["IsolationTrainerCallback"]

_CALLER = "IsolationTrainerCallback"
logger = logging.get_logger(__name__)


class IsolationTrainerCallback(TrainerCallback, ExportableState):
    """Apply an :class:`~isolate.IsolationSpec` for ``trainer.train()``, thaw on its schedule,
    check that isolation holds while training, and keep its state in the Trainer's checkpoints.

    A thin adapter over :class:`~isolate.spec.handle.IsolationHandle`, made with its Trainer
    and added to its callbacks at once. In each ``train()`` the spec is applied before the
    Trainer builds its optimizer (``create_optimizer``: frozen parameters never enter it), and
    the optimizer and LR scheduler it built are attached once both exist
    (``create_scheduler``). Then the Trainer's events drive the handle's loop:
    ``on_epoch_begin`` and ``on_step_begin`` thaw what is due (``Thaw(step=...)`` counts
    ``state.global_step``, optimizer updates; ``Thaw(epoch=...)`` the Trainer's epochs), the
    loss ``compute_loss`` returns is kept for the reach check (Trainer has no event before
    backward; ``compute_loss`` returns just before it), ``on_optimizer_step`` runs the checks
    due (every ``verify_every_n_steps`` steps, and reach on a thaw's first step), and
    ``on_evaluate`` feeds ``monitor`` thaws, and ``on_train_end`` checks drift once more and
    undoes everything. On an error the model is restored too.

    **Checkpoints.** The handle's state goes into ``trainer_state.json``
    (``stateful_callbacks``, as for any ``ExportableState``). On
    ``train(resume_from_checkpoint=...)`` it is checked against the spec and the groups it had
    thawed join the optimizer and scheduler before the Trainer loads their states, so the
    resumed run is the uninterrupted one, bit for bit.

    Args:
        trainer: the ``transformers.Trainer`` to isolate; this callback adds itself to it.
        spec: the :class:`~isolate.IsolationSpec`.
        verify_every_n_steps: how often to check, in optimizer steps (step 0 included);
            ``0``: only the checks a thaw needs.
        on_violation: ``"raise"`` an error naming the parameters, or ``"warn"`` with an
            :class:`~isolate.IsolationWarning` and carry on.
        expected_unused: selectors of parameters allowed to go without gradient on a step;
            every other trainable parameter must be reached by the loss at each check step,
            else a :class:`~isolate.errors.CutOffError`.
        drift: how frozen tensors are watched, ``"fingerprint"`` or ``"copy"``.

    Raises:
        IsolationTypeError: ``trainer`` is not a ``transformers.Trainer``.
        UnsupportedStrategyError: DeepSpeed, FSDP, several processes or GPUs.
        SpecError: an option is wrong, the spec protects named losses (``compute_loss`` gives
            one loss), a ``monitor`` thaw waits for a Trainer that never evaluates, the Trainer
            has an ``IsolationTrainerCallback`` already, or
            ``restore_callback_states_from_checkpoint=True``. (In ``train()``) the spec does
            not fit the model or the optimizer. Nothing is changed then.
        CheckpointMismatchError: (in ``train()``) resuming from a checkpoint written without
            the callback or under another spec.
        GradientLeakError, CutOffError, DriftError, ReplacedParameterError: (in ``train()``)
            a violation, with ``on_violation="raise"``.
        BlindSpotError: (in ``train()``) a training step whose loss never went through
            ``compute_loss``: the reach check could not see it.

    Note:
        * The Trainer loads a checkpoint's weights into the model at the start of ``train()``,
          before any callback runs: a resume refused for its isolation state leaves the model
          with the checkpoint's weights (and nothing frozen).
        * The Trainer wraps its optimizer in accelerate's ``AcceleratedOptimizer``; the
          handle attaches the torch optimizer inside, whose param groups they share.
        * ``train()``'s own ``create_optimizer``, ``create_scheduler`` and ``compute_loss``
          are wrapped for the call (instance attributes, removed after it); overriding them
          in a subclass works, replacing ``training_step`` so that ``compute_loss`` is not
          called is refused at the first step.

    >>> from transformers import Trainer, TrainingArguments
    >>> from torch import nn
    >>> args = TrainingArguments("out", use_cpu=True, report_to=[])
    >>> trainer = Trainer(model=nn.Linear(2, 1), args=args)
    >>> IsolationTrainerCallback(trainer, IsolationSpec(freeze=["bias"]), verify_every_n_steps=10)
    IsolationTrainerCallback(freeze=['bias'])
    >>> IsolationTrainerCallback(trainer, IsolationSpec(freeze=["bias"]))
    Traceback (most recent call last):
    ...
    isolate.errors.SpecError: IsolationTrainerCallback: the Trainer has an IsolationTrainer...
    """

    def __init__(
        self,
        trainer: Trainer,
        spec: IsolationSpec,
        *,
        verify_every_n_steps: int = 50,
        on_violation: Literal["raise", "warn"] = "raise",
        expected_unused: list[str] | None = None,
        drift: Literal["fingerprint", "copy"] = "fingerprint",
    ) -> None:
        if not isinstance(spec, IsolationSpec):
            raise SpecError(
                f"{_CALLER}: spec must be an isolate.IsolationSpec, got {type(spec).__name__}; "
                f"for a mapping use IsolationSpec.from_dict(...)"
            )
        if spec.protect:
            raise SpecError(
                f"{_CALLER}: protect names the losses {sorted(spec.protect)}, but Trainer's "
                f"compute_loss returns one loss; protect the parameters by freezing or "
                f"detaching them, or check named losses in a loop that has them "
                f"(isolate.lightning.IsolationCallback, handle.loop)"
            )
        self.cadence = Cadence.checked(verify_every_n_steps, expected_unused, on_violation, _CALLER)
        if drift not in ("fingerprint", "copy"):
            raise SpecError(f"{_CALLER}: drift must be 'fingerprint' or 'copy', got {drift!r}")
        self.trainer = check_trainer(trainer, _CALLER)
        check_evaluation(trainer, spec, _CALLER)
        if any(isinstance(c, IsolationTrainerCallback) for c in trainer.callback_handler.callbacks):
            raise SpecError(
                f"{_CALLER}: the Trainer has an {_CALLER} already; give one spec per Trainer "
                f"(its checkpoint state has a fixed key)"
            )
        self.spec = spec
        self.drift: Literal["fingerprint", "copy"] = drift
        self.handle: IsolationHandle | None = None
        self.tally = Tally()  # the last train()'s handle.tally, kept after the handle is restored
        self._built_before_apply = False
        self._attached = False
        self._epoch: int | None = None
        self._stepping = False  # between on_step_begin and on_optimizer_step
        self._losses = 0  # losses seen by compute_loss in this step
        self._evaluations = 0  # evaluations seen in this train() (monitor thaws need them)
        warn_on_norm_clipping(trainer, spec.detach)
        trainer.add_callback(self)
        trainer.train = self._wrap_train(trainer.train)  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return repr(self.spec).replace(type(self.spec).__name__, _CALLER, 1)

    # ------------------------------------------------------------------ train() and its steps

    def _wrap_train(self, train: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(train)
        def isolated_train(*args: Any, **kwargs: Any) -> Any:
            if self not in self.trainer.callback_handler.callbacks:
                return train(*args, **kwargs)  # removed from the Trainer on purpose
            check_trainer(self.trainer, _CALLER)
            wrap_methods(
                self.trainer,
                before_optimizer=self._before_optimizer,
                after_scheduler=self._after_scheduler,
                on_loss=self._keep_loss,
            )
            try:
                return train(*args, **kwargs)
            except BaseException:
                self._restore()
                raise
            finally:
                unwrap_methods(self.trainer)

        return isolated_train

    def _before_optimizer(self) -> None:
        """Apply the spec before the Trainer builds its optimizer (once per ``train()``)."""
        if self.handle is None:
            self._built_before_apply = self.trainer.optimizer is not None
            self._apply(self.trainer.model)

    def _after_scheduler(self) -> None:
        """Attach once the Trainer has built both its optimizer and its scheduler."""
        if self.handle is not None and not self._attached:
            self._attach(self.trainer)

    def _keep_loss(self, loss: torch.Tensor) -> None:
        """Keep a training step's loss for the reach check (no event comes before backward)."""
        if self._stepping and self.handle is not None:
            self._losses += 1
            self.handle.loop.before_backward(loss)

    def _apply(self, model: torch.nn.Module | None) -> None:
        if model is None:
            raise SpecError(f"{_CALLER}: the Trainer has no model to apply the spec to")
        handle = apply_spec(self.spec, model, caller=_CALLER, warn=warn_user, drift=self.drift)
        if handle.contracts.losses:
            handle.restore()
            raise SpecError(
                f"{_CALLER}: the contracts read the losses {sorted(handle.contracts.losses)}, "
                f"but Trainer's compute_loss returns one loss; check these contracts in a loop "
                f"that names its losses (isolate.lightning.IsolationCallback, handle.loop)"
            )
        self.handle, self.tally = handle, handle.tally
        cadence = self.cadence
        handle.check_every(
            cadence.every,
            expected_unused=cadence.expected_unused,
            on_violation=cadence.on_violation,
        )

    def _attach(self, trainer: Trainer) -> None:
        """Thaw what the checkpoint resumed from had thawed, then attach the optimizer and
        scheduler: thawed groups join both before the Trainer loads their states."""
        handle = self._handle()
        state = saved_state(trainer.state.stateful_callbacks, _CALLER)
        if state is not None:
            handle.load_state_dict(state)
        schedulers = [] if trainer.lr_scheduler is None else [trainer.lr_scheduler]
        handle.attach(
            torch_optimizer(trainer, _CALLER),
            schedulers,
            built_before_apply=self._built_before_apply,
        )
        self._attached = True

    def _handle(self) -> IsolationHandle:
        if self.handle is None or not self.handle.active:
            raise SpecError(
                f"{_CALLER}: the spec is not applied: this train() never called "
                f"Trainer.create_optimizer and create_scheduler, where it is applied and "
                f"attached; keep them in the training path (override, do not bypass them)"
            )
        return self.handle

    def _restore(self) -> None:
        handle, self.handle = self.handle, None
        self._attached = self._stepping = False
        if handle is not None and handle.active:
            handle.restore()

    # ------------------------------------------------------------------ the Trainer's events

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Refuse a train() in which the spec was not applied and attached."""
        self._handle()
        if not self._attached:
            raise SpecError(
                f"{_CALLER}: the Trainer built an optimizer but no LR scheduler through "
                f"create_scheduler, so the optimizer was never attached; keep create_scheduler "
                f"in the training path"
            )
        self._epoch, self._evaluations = None, 0

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Thaw the groups due at this epoch (the first of a resumed run is the checkpoint's)."""
        self._epoch = int(state.epoch) if self._epoch is None else self._epoch + 1
        self._begin(state, arm=False)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Thaw the groups due at this optimizer step and arm its checks."""
        self._begin(state, arm=True)
        self._stepping, self._losses = True, 0

    def _begin(self, state: TrainerState, *, arm: bool) -> None:
        if self._epoch is None:  # pragma: no cover - the Trainer begins an epoch first
            self._epoch = int(state.epoch)
        step = state.global_step
        for name in self._handle().loop.begin_step(epoch=self._epoch, step=step, arm=arm):
            group = self._handle().plan.group(name)
            logger.info(
                f"{_CALLER}: thawed {name!r} ({len(group.params)} parameters) at epoch "
                f"{self._epoch}, step {step}"
            )

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The checks due after this step: reach of the step's loss, params, drift, flags,
        optimizers at check steps; reach on a thaw's first step."""
        handle = self._handle()
        self._stepping = False
        if not self._losses:
            raise BlindSpotError(
                f"{_CALLER}: no loss went through Trainer.compute_loss at step "
                f"{state.global_step}, so what this step backpropagated cannot be checked; "
                f"compute the loss in compute_loss (override it rather than training_step)"
            )
        handle.loop.end_step()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Give the evaluation's metrics to the ``monitor`` thaws (``Thaw(monitor="eval_loss")``:
        the Trainer prefixes them with ``eval_``); a group due thaws at the next step."""
        if self.handle is None or not any(t.monitor is not None for t in self.spec.thaw):
            return
        self._evaluations += 1
        for name in self.handle.observe(kwargs["metrics"]):
            logger.info(f"{_CALLER}: {name!r} is due: its metric stopped improving")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A last check of params, drift and contracts, then undo everything; a warning if a
        ``monitor`` thaw never saw an evaluation."""
        handle = self._handle()
        try:
            handle.loop.finish()
            waiting = handle.watching
            if waiting is not None and not self._evaluations:
                warn_user(
                    f"{_CALLER}: thaw group {waiting!r} waited for "
                    f"{handle.plan.group(waiting).thaw.monitor!r} to stop improving, but no "
                    f"evaluation ran during this train(), so it never thawed; evaluate more "
                    f"often (eval_steps) or give it epoch= or step="
                )
        finally:
            self._restore()

    def state(self) -> dict[str, Any]:
        """The handle's state (``None`` outside ``train()``) for ``trainer_state.json``."""
        isolation = None if self.handle is None else self.handle.state_dict()
        return {"args": {}, "attributes": {"isolation": isolation}}
