"""Which Lightning strategies the callback supports, and rebuilding DDP after a thaw."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from torch.nn.parallel import DistributedDataParallel

from isolate.errors import SpecError

__all__ = ["check_trainer", "rewrap"]


def check_trainer(trainer: pl.Trainer, callback: Any, caller: str) -> None:
    """Refuse a second callback of the same kind and strategies that re-create parameters.

    Raises:
        SpecError: naming the strategy or the duplicate, and the fix.
    """
    callbacks: list[Any] = getattr(trainer, "callbacks", [])
    others = [c for c in callbacks if type(c) is type(callback) and c is not callback]
    if others:
        raise SpecError(
            f"{caller}: the Trainer has {len(others) + 1} {type(callback).__name__}s; their "
            f"checkpoint states would collide: merge them into one"
        )
    strategy = trainer.strategy
    supported = isinstance(strategy, SingleDeviceStrategy) or (
        isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy)
    )
    if not supported:
        raise SpecError(
            f"{caller}: the {type(strategy).__name__} strategy is not supported (it shards or "
            f"re-creates parameters, so freezing by identity cannot hold); use a single device, "
            f"or strategy='ddp' / 'ddp_spawn'"
        )


def rewrap(trainer: pl.Trainer, caller: str) -> bool:
    """Build the DDP wrapper anew so that it registers the parameters just thawed.

    DDP registers only the parameters that require grad when it is built: a thawed group
    would get unsynchronised gradients and the ranks would drift apart. A new wrapper
    registers them, and broadcasts rank 0's parameters and buffers.

    Returns:
        Whether the model was wrapped in DDP (and so rebuilt).
    """
    strategy = trainer.strategy
    if not isinstance(strategy.model, DistributedDataParallel):
        return False
    if not isinstance(strategy, DDPStrategy):
        raise SpecError(
            f"{caller}: the model is wrapped in DistributedDataParallel by "
            f"{type(strategy).__name__}, which the callback cannot rebuild; use strategy='ddp'"
        )
    strategy.model = strategy.lightning_module
    strategy.configure_ddp()
    return True
