"""What the Lightning callback tells the user: why modules sit in eval mode, the ledger at fit
start, a monitor thaw that never saw a validation, and global-norm clipping across branches."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn

from isolate.errors import IsolationWarning
from isolate.freezing import held_in_eval
from isolate.ledger import Ledger, ledger
from isolate.spec.handle import IsolationHandle

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["explain_eval_modes", "print_ledger", "warn_on_norm_clipping", "warn_unvalidated"]

_CALLER = "IsolationCallback"


def _warn(message: str) -> None:
    warnings.warn(message, IsolationWarning, stacklevel=2)


def explain_eval_modes(pl_module: pl.LightningModule) -> None:
    """Say which of the modules Lightning is about to report in eval mode the spec holds."""
    held = set(held_in_eval(pl_module))
    in_eval = [n or "<root>" for n, m in pl_module.named_modules() if not m.training]
    ours = [n for n in in_eval if n in held]
    if not ours:
        return
    rest = [n for n in in_eval if n not in held]
    shown = ", ".join(ours[:5]) + (f" and {len(ours) - 5} more" if len(ours) > 5 else "")
    others = (
        f"; the other {len(rest)} are in eval mode for another reason: {', '.join(rest[:5])}"
        if rest
        else ""
    )
    rank_zero_info(
        f"{_CALLER}: {len(ours)} of the {len(in_eval)} module(s) Lightning finds in eval mode at "
        f"the start of training are held there by the spec (a frozen part in eval mode, "
        f"through model.train()): {shown}{others}"
    )


def print_ledger(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    handle: IsolationHandle,
    losses: object,
    loss: torch.Tensor,
) -> Ledger:
    """Print the ledger on rank zero and log its summary; returns it."""
    named = dict(losses) if isinstance(losses, Mapping) else {}
    book = ledger(pl_module, {**named, "total": loss}, list(trainer.optimizers), spec=handle)
    rank_zero_info(
        f"{_CALLER}: the parameters at step {trainer.global_step}\n{book.format(limit=40)}"
    )
    summary = {f"isolation/ledger/{k}": v for k, v in book.summary().items() if v is not None}
    for logger in trainer.loggers:
        logger.log_metrics(summary, step=trainer.global_step)
    return book


def warn_unvalidated(handle: IsolationHandle, trainer: pl.Trainer) -> None:
    """Say so when a ``monitor`` thaw waited through a fit that never validated."""
    waiting = handle.watching
    if waiting is not None:
        monitor = handle.plan.group(waiting).thaw.monitor
        _warn(
            f"{_CALLER}: thaw group {waiting!r} waited for {monitor!r} to stop improving, "
            f"but no validation ran during this fit, so it never thawed; pass "
            f"val_dataloaders to fit (or validate more often than every "
            f"{trainer.check_val_every_n_epoch} epochs), or give it epoch= or step="
        )


def warn_on_norm_clipping(trainer: pl.Trainer, detach: tuple[str, ...]) -> None:
    """Warn when the trainer clips gradients by their global norm across detached branches."""
    # The clip factor is computed from the norm of *all* gradients, so a detached
    # branch's gradient rescales the trunk's: the branch leaks into the trunk's update.
    algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm").lower()
    if detach and trainer.gradient_clip_val and algorithm.endswith("norm"):
        rank_zero_warn(
            f"{_CALLER}: gradient_clip_val={trainer.gradient_clip_val} clips by the global "
            f"norm, which includes the gradients of the detached branches "
            f"{list(detach)}: their gradient changes the factor applied to every "
            f"other parameter, so isolation does not hold for the update. Clip per group "
            f"instead (override configure_gradient_clipping), or use "
            f"gradient_clip_algorithm='value'",
            category=IsolationWarning,
        )
