"""The named losses ``training_step`` leaves for the callback to check.

``training_step`` sets ``self.isolation_losses = {"name": loss_tensor, ...}`` every step; the
callback takes it in ``on_before_backward``, while the graphs are alive, and clears it, so each
is read once (see docs/lightning.md, "Naming losses").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from isolate.errors import IsolationTypeError, SpecError

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["LOSSES_ATTRIBUTE", "check_named", "take_losses"]

LOSSES_ATTRIBUTE = "isolation_losses"
"""The attribute of the LightningModule where ``training_step`` leaves its named losses."""


def take_losses(pl_module: pl.LightningModule) -> Any:
    """The named losses ``training_step`` left, cleared so that each is read once."""
    losses = getattr(pl_module, LOSSES_ATTRIBUTE, None)
    if losses is not None:
        setattr(pl_module, LOSSES_ATTRIBUTE, {})
    return losses


def check_named(
    pl_module: pl.LightningModule,
    losses: object,
    protect: Mapping[str, Any] | None,
    caller: str,
) -> None:
    """Refuse named losses that are not a dict of name -> tensor, or that lack a loss
    ``protect`` names.

    Raises:
        IsolationTypeError: ``losses`` is not a dict of loss name -> loss tensor.
        SpecError: ``protect`` names a loss that ``losses`` lacks.
    """
    if not isinstance(losses, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in losses.items()
    ):
        raise IsolationTypeError(
            f"{caller}: {type(pl_module).__name__}.{LOSSES_ATTRIBUTE} must be a dict of "
            f"loss name -> loss tensor, got {losses!r}"
        )
    missing = sorted(set(protect or {}) - set(losses))
    if missing:
        raise SpecError(
            f"{caller}: protect names the losses {missing}, but "
            f"{type(pl_module).__name__}.training_step set {LOSSES_ATTRIBUTE} with "
            f"{sorted(losses)}; set self.{LOSSES_ATTRIBUTE} = {{'name': loss, ...}} in "
            f"training_step, with the names used in protect"
        )
