"""What the Trainer adapter needs of a ``transformers.Trainer``: a setup it supports, its
methods between which the spec acts, the optimizer it built, and the isolation state of the
checkpoint it resumes from."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import Trainer

from isolate.errors import (
    CheckpointMismatchError,
    IsolationTypeError,
    SpecError,
    UnsupportedStrategyError,
)
from isolate.exposure import unwrap_optimizer
from isolate.spec import IsolationSpec
from isolate.spec.handle import warn_user

__all__ = [
    "check_evaluation",
    "check_trainer",
    "saved_state",
    "torch_optimizer",
    "unwrap_methods",
    "warn_on_norm_clipping",
    "wrap_methods",
]

WRAPPED = ("create_optimizer", "create_scheduler", "compute_loss")
"""The Trainer methods :func:`wrap_methods` wraps, as instance attributes."""


def check_trainer(trainer: object, caller: str) -> Trainer:
    """``trainer``, if the adapter can hold isolation under its setup; else the error naming
    the setting and the fix.

    Raises:
        IsolationTypeError: ``trainer`` is not a ``transformers.Trainer``.
        UnsupportedStrategyError: DeepSpeed, FSDP, several processes or several GPUs.
        SpecError: ``restore_callback_states_from_checkpoint=True``.
    """
    if not isinstance(trainer, Trainer):
        raise IsolationTypeError(
            f"{caller}: expected a transformers.Trainer, got {type(trainer).__qualname__}"
        )
    args = trainer.args
    unsupported = [
        ("DeepSpeed", trainer.is_deepspeed_enabled, "it builds and shards its own optimizer"),
        ("FSDP", trainer.is_fsdp_enabled or trainer.is_fsdp_xla_enabled, "it shards parameters"),
        (
            f"{args.world_size} processes",
            args.world_size > 1,
            "DDP synchronises only the parameters that required grad when it was built, and a "
            "thaw cannot rebuild it inside Trainer",
        ),
        (f"{args.n_gpu} GPUs", args.n_gpu > 1, "nn.DataParallel replicates the model each step"),
    ]
    for what, used, why in unsupported:
        if used:
            raise UnsupportedStrategyError(
                f"{caller}: training with {what} is not supported ({why}); train on one "
                f"process and one device, or use isolate.lightning.IsolationCallback, which "
                f"supports DDP and FSDP"
            )
    if args.restore_callback_states_from_checkpoint:
        raise SpecError(
            f"{caller}: restore_callback_states_from_checkpoint=True would replace this "
            f"callback by a new instance built from the checkpoint, without its Trainer; it "
            f"restores its own state from the checkpoint. Set "
            f"TrainingArguments(restore_callback_states_from_checkpoint=False)"
        )
    return trainer


def check_evaluation(trainer: Trainer, spec: IsolationSpec, caller: str) -> None:
    """Refuse ``monitor`` thaws in a Trainer that never evaluates: they would never thaw.

    Raises:
        SpecError: a thaw watches a metric and ``eval_strategy="no"``.
    """
    watching = {str(t.name): str(t.monitor) for t in spec.thaw if t.monitor is not None}
    strategy = trainer.args.eval_strategy  # an IntervalStrategy, or a string set after init
    if watching and str(getattr(strategy, "value", strategy)) == "no":
        raise SpecError(
            f"{caller}: thaw groups {sorted(watching)} wait for "
            f"{sorted(set(watching.values()))} to stop improving, but this Trainer never "
            f"evaluates (eval_strategy='no'), so they would never thaw; set "
            f"TrainingArguments(eval_strategy='steps') and an eval_dataset, or give them "
            f"epoch= or step="
        )


def warn_on_norm_clipping(trainer: Trainer, detach: tuple[str, ...]) -> None:
    """Warn when the Trainer clips gradients by their global norm across detached branches:
    the branches' gradients change the factor applied to every other parameter."""
    if detach and trainer.args.max_grad_norm and trainer.args.max_grad_norm > 0:
        warn_user(
            f"IsolationTrainerCallback: max_grad_norm={trainer.args.max_grad_norm} clips by "
            f"the global norm, which includes the gradients of the detached branches "
            f"{list(detach)}: their gradient changes the factor applied to every other "
            f"parameter, so isolation does not hold for the update. Set "
            f"TrainingArguments(max_grad_norm=0) and clip per group, if at all"
        )


def wrap_methods(
    trainer: Trainer,
    *,
    before_optimizer: Callable[[], None],
    after_scheduler: Callable[[], None],
    on_loss: Callable[[Any], None],
) -> None:
    """Wrap, for one ``train()``, the three Trainer methods between which the spec must act:
    ``before_optimizer()`` runs before ``create_optimizer``, ``after_scheduler()`` after
    ``create_scheduler``, and ``on_loss(loss)`` gets the loss ``compute_loss`` returns (with
    grad enabled; the first item when it also returns outputs). Undone by
    :func:`unwrap_methods`; a subclass's overrides are the methods wrapped."""
    create_optimizer, create_scheduler = trainer.create_optimizer, trainer.create_scheduler
    compute_loss = trainer.compute_loss

    def apply_then_create_optimizer(*args: Any, **kwargs: Any) -> Any:
        before_optimizer()
        return create_optimizer(*args, **kwargs)

    def create_scheduler_then_attach(*args: Any, **kwargs: Any) -> Any:
        scheduler = create_scheduler(*args, **kwargs)
        after_scheduler()
        return scheduler

    def compute_loss_then_keep(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        result = compute_loss(model, inputs, *args, **kwargs)
        if torch.is_grad_enabled():
            on_loss(result[0] if isinstance(result, tuple) else result)
        return result

    trainer.create_optimizer = apply_then_create_optimizer  # type: ignore[method-assign]
    trainer.create_scheduler = create_scheduler_then_attach  # type: ignore[method-assign]
    trainer.compute_loss = compute_loss_then_keep  # type: ignore[method-assign]


def unwrap_methods(trainer: Trainer) -> None:
    """Remove the wrappers of :func:`wrap_methods`: the class's methods show through again."""
    for name in WRAPPED:
        trainer.__dict__.pop(name, None)


def torch_optimizer(trainer: Trainer, caller: str) -> torch.optim.Optimizer:
    """The torch optimizer the Trainer steps, out of accelerate's ``AcceleratedOptimizer``
    (which shares its param groups but not its step hooks).

    Raises:
        SpecError: the Trainer holds no optimizer.
        IsolationTypeError: it holds something else than a torch optimizer.
    """
    optimizer: object = trainer.optimizer
    if optimizer is None:
        raise SpecError(
            f"{caller}: the Trainer built no optimizer, so thawed groups have nowhere to go "
            f"and frozen parameters cannot be checked out of it; let Trainer build it "
            f"(create_optimizer) or pass optimizers=(optimizer, scheduler)"
        )
    return unwrap_optimizer(optimizer, caller)


def saved_state(stateful: object, key: str) -> dict[str, Any] | None:
    """The isolation state under ``key`` in a ``TrainerState.stateful_callbacks``: ``None``
    on a fresh run (the Trainer fills it from the callback itself, which has none yet).

    Raises:
        CheckpointMismatchError: a resume from a checkpoint written without the callback.
    """
    entry = stateful.get(key) if isinstance(stateful, Mapping) else None
    if entry is None:
        raise CheckpointMismatchError(
            f"{key}: the checkpoint holds no {key} state in trainer_state.json "
            f"(stateful_callbacks): it was written without this callback, so it is unknown "
            f"what was frozen or thawed. To start a new isolation schedule from its weights, "
            f"load them into the model and call train() without resume_from_checkpoint"
        )
    attributes = entry.get("attributes") if isinstance(entry, Mapping) else None
    if not isinstance(attributes, Mapping) or "isolation" not in attributes:
        raise CheckpointMismatchError(
            f"{key}: the checkpoint's {key} state is malformed: expected "
            f"{{'args': {{}}, 'attributes': {{'isolation': ...}}}}, got {entry!r}"
        )
    state = attributes["isolation"]
    return None if state is None else dict(state)
