"""The callback's checkpoint state: saved by parameter name, checked before anything thaws."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from isolate.errors import CheckpointMismatchError
from isolate.spec.handle import IsolationHandle
from isolate.spec.state import check_state

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["SavedState"]

_NO_STATE = (
    "IsolationCallback: the checkpoint holds no IsolationCallback state: it was written "
    "without this callback, so it is unknown what was frozen or thawed. To start a new "
    "isolation schedule from its weights, load them with "
    "model.load_state_dict(torch.load(path, weights_only=True)['state_dict']) and call fit() "
    "without ckpt_path"
)


class SavedState:
    """What :class:`~isolate.lightning.IsolationCallback` saves in and reads from Lightning's
    checkpoints, over its handle: the handle's own state while applied, the last one kept
    after ``fit`` (or an error), and a state loaded before the spec was applied."""

    def __init__(self, caller: str) -> None:
        self.caller = caller
        self.last: dict[str, Any] = {}

    def keep(self, handle: IsolationHandle) -> None:
        """Keep ``handle``'s state for :meth:`state`, before it is restored."""
        self.last = handle.state_dict()

    def state(self, handle: IsolationHandle | None) -> dict[str, Any]:
        """The state to save: the handle's, or the last one kept."""
        return dict(self.last) if handle is None else handle.state_dict()

    def load(self, handle: IsolationHandle | None, state: Mapping[str, Any]) -> None:
        """Thaw what ``state`` had thawed (checked against the spec first); kept for later
        when the spec is not applied yet."""
        if handle is None:
            self.last = dict(state)
            return
        handle.load_state_dict(state)

    def require(self, checkpoint: Mapping[str, Any], key: str) -> None:
        """Refuse a checkpoint that holds no state under ``key``."""
        if key not in (checkpoint.get("callbacks") or {}):
            raise CheckpointMismatchError(_NO_STATE)

    def check_before_weights(self, trainer: pl.Trainer, key: str, handle: IsolationHandle) -> None:
        """Check the saved state before the strategy loads the model's weights.

        Lightning loads a checkpoint's weights into the model (``restore_model``) before any
        callback hook sees the checkpoint (``restore_callbacks``), and no callback hook runs
        in between, so a resume refused afterwards would leave the model with the refused
        run's weights. The strategy's ``load_model_state_dict`` is wrapped, for one call, to
        check the saved spec first (nothing thaws here; ``load_state_dict`` does that).

        Raises:
            CheckpointMismatchError: (at the load) the checkpoint holds no state of this
                callback, or one written under another spec; the weights are not loaded.
        """
        strategy = trainer.strategy
        original: Callable[..., Any] = strategy.load_model_state_dict

        def load_model_state_dict(checkpoint: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
            strategy.__dict__.pop("load_model_state_dict", None)  # once
            self.require(checkpoint, key)
            states = checkpoint["callbacks"]
            check_state(handle.plan.record(), states[key], handle.plan.group_names, self.caller)
            return original(checkpoint, *args, **kwargs)

        strategy.__dict__["load_model_state_dict"] = load_model_state_dict

    @staticmethod
    def no_resume(trainer: pl.Trainer) -> None:
        """Take the one-call wrapper off when fit starts without a resume."""
        trainer.strategy.__dict__.pop("load_model_state_dict", None)
