"""The callback's checkpoint state: saved by parameter name, checked before anything thaws."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from isolate.errors import CheckpointMismatchError, IsolationError
from isolate.spec.handle import IsolationHandle
from isolate.spec.state import check_state

_NO_STATE = (
    "IsolationCallback: the checkpoint holds no IsolationCallback state: it was written "
    "without this callback, so it is unknown what was frozen or thawed. To start a new "
    "isolation schedule from its weights, load them with "
    "model.load_state_dict(torch.load(path, weights_only=True)['state_dict']) and call fit() "
    "without ckpt_path"
)

__all__ = ["CheckpointState", "check_before_weights"]


def check_before_weights(
    trainer: pl.Trainer, key: str, handle: IsolationHandle, caller: str
) -> None:
    """Check the callback's saved state before the strategy loads the model's weights.

    Lightning loads a checkpoint's weights into the model before any callback sees the
    checkpoint, so a resume refused afterwards would leave the model with the refused run's
    weights. The strategy's ``load_model_state_dict`` is wrapped, for one call, to check the
    saved spec first (nothing thaws here; ``load_state_dict`` does that later).

    Raises:
        CheckpointMismatchError: (at the load) the checkpoint holds no state of this callback,
            or one written under another spec; the weights are not loaded.
    """
    strategy = trainer.strategy
    original = strategy.load_model_state_dict

    def load_model_state_dict(checkpoint: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        strategy.__dict__.pop("load_model_state_dict", None)  # once
        states = checkpoint.get("callbacks") or {}
        if key not in states:
            raise CheckpointMismatchError(_NO_STATE)
        check_state(handle.plan.record(), states[key], handle.plan.group_names, caller)
        return original(checkpoint, *args, **kwargs)

    strategy.__dict__["load_model_state_dict"] = load_model_state_dict


class CheckpointState(Callback):
    """Checkpoint hooks of :class:`~isolate.lightning.IsolationCallback` over its handle."""

    handle: IsolationHandle | None
    _last_state: dict[str, Any]

    def _restore(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The spec, what is frozen now and when each group was thawed, by parameter name."""
        if self.handle is None:
            return dict(self._last_state)
        return self.handle.state_dict()

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Refuse a checkpoint that holds no state of this callback."""
        if self.handle is None:
            return
        if self.state_key not in (checkpoint.get("callbacks") or {}):
            raise CheckpointMismatchError(_NO_STATE)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the checkpoint's spec against this one, then thaw what it had thawed.

        Runs before DDP wraps the model, so thawed groups are synchronised from the start;
        groups thawed in the checkpoint are not frozen again.

        Raises:
            CheckpointMismatchError: the checkpoint was written under another spec.
        """
        if self.handle is None:
            self._last_state = dict(state_dict)
            return
        try:
            self.handle.load_state_dict(state_dict)
        except IsolationError:
            self._restore()
            raise
