"""Gradient norms per isolation group, for the trainer's loggers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from isolate.cutoff import cut_off_parameters
from isolate.figures import plot_report
from isolate.gradients import gradient_report
from isolate.spec.handle import IsolationHandle

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["grad_norms", "log_figure"]


def grad_norms(handle: IsolationHandle, prefix: str = "isolation/grad_norm/") -> dict[str, float]:
    """The L2 norm of ``.grad`` per group: each ``detach`` / ``clone`` branch, each thawed
    group, ``rest`` (every other trainable parameter) and ``total``; 0.0 where no grad."""
    plan = handle.plan
    groups: dict[str, list[nn.Parameter]] = {w.name: list(w.child.parameters()) for w in plan.wraps}
    for name in handle.thawed:
        groups[name] = list(plan.group(name).params.values())
    placed = {id(p) for ps in groups.values() for p in ps}
    unique = {id(p): p for p in plan.model.parameters()}
    groups["rest"] = [p for i, p in unique.items() if i not in placed and p.requires_grad]
    groups["total"] = [p for p in unique.values() if p.requires_grad]
    metrics: dict[str, float] = {}
    for name, params in groups.items():
        grads = [
            g.coalesce().values() if g.is_sparse else g
            for g in (
                p.grad.detach() for p in {id(p): p for p in params}.values() if p.grad is not None
            )
        ]
        norm = 0.0
        if grads:
            norm = float(
                torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
                )
            )
        metrics[prefix + name] = norm
    return metrics


def log_figure(
    trainer: pl.Trainer,
    model: nn.Module,
    losses: Mapping[str, torch.Tensor],
    total: torch.Tensor,
    expected_unused: Sequence[str],
    tag: str = "isolation/gradients",
) -> int:
    """Draw the losses x groups figure of this step and hand it to every logger that takes
    figures (``logger.experiment.add_figure``, as TensorBoard's); return how many did.

    Every rank computes the report (its ``autograd.grad`` calls are collectives under
    FSDP2); rank zero logs.
    """
    report = gradient_report(losses, model)
    figure = plot_report(
        report, cut_off=cut_off_parameters(total, model, expected_unused=expected_unused)
    )
    logged = 0
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            add_figure = getattr(getattr(logger, "experiment", None), "add_figure", None)
            if add_figure is not None:
                add_figure(tag, figure, global_step=trainer.global_step)
                logged += 1
    return logged
