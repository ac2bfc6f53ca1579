"""Which Lightning strategies the callback supports, when it applies the spec under each, and
rebuilding DDP after a thaw.

* ``SingleDeviceStrategy`` and ``DDPStrategy``: the spec is applied at ``setup``, before
  ``configure_optimizers`` and before DDP wraps the model; a thaw rebuilds the DDP wrapper.
* ``ModelParallelStrategy`` (FSDP2 and tensor parallelism): ``configure_model`` runs after the
  callbacks' ``setup`` and ``fully_shard`` replaces every ``Parameter`` object, so the spec is
  applied at ``on_fit_start``, resolved by name against the sharded module; a resume hands
  the callback its saved state before the strategy loads the optimizer state.
* ``FSDPStrategy`` (FSDP1): only with ``use_orig_params=True`` (the default), which keeps the
  original ``Parameter`` objects.
* ``DeepSpeedStrategy``: refused (see :func:`check_trainer`).

Each is the class of the trainer's own package (``pytorch_lightning`` or ``lightning.pytorch``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from isolate.errors import CheckpointMismatchError, SpecError, UnsupportedStrategyError
from isolate.lightning._compat import package

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["applies_at_fit_start", "check_trainer", "load_state_first", "rewrap"]

_METADATA = "meta.pt"  # where Lightning's distributed checkpoints keep everything but tensors


def check_trainer(trainer: pl.Trainer, callback: Any, caller: str) -> None:
    """Refuse a second callback of the same kind and strategies under which a spec cannot
    hold.

    Raises:
        SpecError: a second callback of the same kind.
        UnsupportedStrategyError: naming the strategy, the reason and what to use instead.
    """
    callbacks: list[Any] = getattr(trainer, "callbacks", [])
    others = [c for c in callbacks if type(c) is type(callback) and c is not callback]
    if others:
        raise SpecError(
            f"{caller}: the Trainer has {len(others) + 1} {type(callback).__name__}s; their "
            f"checkpoint states would collide: merge them into one"
        )
    strategy: Any = trainer.strategy  # narrowed by _is(), against its own package
    if _is(strategy, "DeepSpeedStrategy"):
        raise UnsupportedStrategyError(
            f"{caller}: the DeepSpeedStrategy is not supported: deepspeed.initialize builds "
            f"its optimizer and gradient partitions from the parameters that require grad at "
            f"that moment, and a parameter thawed afterwards is silently never updated "
            f"(microsoft/DeepSpeed#5639), so neither a thaw step nor the in-training checks "
            f"can hold. Use ModelParallelStrategy (FSDP2, fully_shard in configure_model) or "
            f"strategy='ddp'; with DeepSpeed, freeze by hand before the Trainer starts and "
            f"never thaw"
        )
    if _is(strategy, "FSDPStrategy"):
        if not strategy.kwargs.get("use_orig_params", True):
            raise UnsupportedStrategyError(
                f"{caller}: FSDPStrategy(use_orig_params=False) flattens each unit's "
                f"parameters into one FlatParameter with one requires_grad, so a unit that "
                f"mixes frozen and trainable parameters is refused by FSDP and a thaw "
                f"cannot be expressed. Use FSDPStrategy(use_orig_params=True), or "
                f"ModelParallelStrategy (FSDP2)"
            )
        return
    if not _is(strategy, "SingleDeviceStrategy", "ModelParallelStrategy", "DDPStrategy"):
        raise UnsupportedStrategyError(
            f"{caller}: the {type(strategy).__name__} strategy is not supported (it shards or "
            f"re-creates parameters in ways isolate does not know, so freezing by identity "
            f"cannot hold); use a single device, strategy='ddp' / 'ddp_spawn', or "
            f"ModelParallelStrategy (FSDP2)"
        )


def applies_at_fit_start(trainer: pl.Trainer) -> bool:
    """Whether the spec waits for ``on_fit_start``: the strategy builds or shards the model in
    ``configure_model``, after the callbacks' ``setup``, replacing its ``Parameter`` objects."""
    return _is(trainer.strategy, "ModelParallelStrategy")


def load_state_first(
    trainer: pl.Trainer, key: str, load: Callable[[dict[str, Any]], None], caller: str
) -> None:
    """Make the strategy hand the callback its saved state before it loads the optimizers.

    ``ModelParallelStrategy`` loads the optimizer state (after ``on_fit_start``) into the
    param groups that exist at that moment, and only then do callbacks see the checkpoint: a
    group thawed in the checkpoint must exist by then, or its optimizer state is silently
    dropped. The strategy's ``load_checkpoint`` is wrapped, for one call, so that ``load``
    gets the callback's entry from the checkpoint's small metadata file first
    (``weights_only=True``).

    Raises:
        CheckpointMismatchError: (at the load) the checkpoint holds no state of this callback.
    """
    strategy = trainer.strategy
    original = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        strategy.__dict__.pop("load_checkpoint", None)  # once
        path = Path(str(checkpoint_path))
        file = path / _METADATA if path.is_dir() else path
        saved = torch.load(file, map_location="cpu", weights_only=True, mmap=not path.is_dir())
        states = saved.get("callbacks") or {}
        if key not in states:
            raise CheckpointMismatchError(
                f"{caller}: the checkpoint {str(path)!r} holds no {caller} state: it was "
                f"written without this callback, so it is unknown what was frozen or thawed. "
                f"To start a new isolation schedule from its weights, load them into the "
                f"model and call fit() without ckpt_path"
            )
        load(states[key])
        return original(checkpoint_path, *args, **kwargs)

    strategy.__dict__["load_checkpoint"] = load_checkpoint


def rewrap(trainer: pl.Trainer, caller: str) -> bool:
    """Build the DDP wrapper anew so that it registers the parameters just thawed.

    DDP registers only the parameters that require grad when it is built: a thawed group
    would get unsynchronised gradients and the ranks would drift apart. A new wrapper
    registers them, and broadcasts rank 0's parameters and buffers. FSDP2 units need no new
    wrapper: the engine reshards them and flips the sharded parameters.

    Returns:
        Whether the model was wrapped in DDP (and so rebuilt).
    """
    strategy: Any = trainer.strategy  # narrowed by _is(), against its own package
    if not isinstance(strategy.model, DistributedDataParallel):
        return False
    if not _is(strategy, "DDPStrategy"):
        raise SpecError(
            f"{caller}: the model is wrapped in DistributedDataParallel by "
            f"{type(strategy).__name__}, which the callback cannot rebuild; use strategy='ddp'"
        )
    strategy.model = strategy.lightning_module
    strategy.configure_ddp()
    return True


def _is(strategy: object, *kinds: str) -> bool:
    """Whether ``strategy`` is one of the ``kinds`` of strategy of its own Lightning package."""
    lightning = package(strategy, "strategies.Strategy")
    if lightning is None:
        return False
    return isinstance(strategy, tuple(getattr(lightning.strategies, k) for k in kinds))
