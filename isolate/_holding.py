"""Holding a module in a mode through ``model.train()``: a stack of policies per module,
enforced by a forward pre-hook that travels with the module (copies, pickles, ``torch.save``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["ModeHold", "find_hold", "pop_hold", "push_hold"]


class ModeHold:
    """The stack of BatchNorm policies pushed on one module, and the forward pre-hook that
    enforces the top one.

    The object *is* the hook and lives only in the module's ``_forward_pre_hooks``, so it
    travels with the module through ``copy.deepcopy``, pickling and ``torch.save``: a copy's
    policy is found on the copy, and releasing it never touches the original. A forward
    pre-hook is used rather than an override of ``train()`` because Lightning's evaluation
    loop restores modes by assigning ``module.training`` directly.
    """

    def __init__(self) -> None:
        self.stack: list[tuple[int, str]] = []

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.stack and self.stack[-1][1] == "eval":
            module.training = False


def find_hold(module: nn.Module) -> tuple[int, ModeHold] | None:
    """The hook's key and the hold on ``module``, if any."""
    for key, hook in module._forward_pre_hooks.items():
        if isinstance(hook, ModeHold):
            return key, hook
    return None


def push_hold(module: nn.Module, seq: int, policy: str) -> None:
    """Push ``policy`` (``"eval"`` or ``"train"``) for the freeze numbered ``seq``."""
    found = find_hold(module)
    if found is None:
        state = ModeHold()
        module.register_forward_pre_hook(state)
    else:
        state = found[1]
    state.stack.append((seq, policy))


def pop_hold(module: nn.Module, seq: int) -> None:
    """Drop the policy of the freeze numbered ``seq``; the hook goes with the last one."""
    found = find_hold(module)
    if found is None:
        return
    key, state = found
    state.stack = [entry for entry in state.stack if entry[0] != seq]
    if not state.stack:
        del module._forward_pre_hooks[key]
