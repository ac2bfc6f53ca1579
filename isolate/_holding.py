"""Holding a module in a mode through ``model.train()``: a stack of policies per module,
enforced by a forward pre-hook that travels with the module (copies, pickles, ``torch.save``),
and which modules a mode matters to (:func:`reads_training`).
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

from isolate._rerun_safety import recompute_safe
from isolate.errors import SelectorError

__all__ = [
    "POLICIES",
    "READS_TRAINING",
    "ModeHold",
    "check_policy",
    "find_hold",
    "held_policy",
    "policy_of",
    "pop_hold",
    "push_hold",
    "reads_training",
]

READS_TRAINING = "isolate_reads_training"
"""A class attribute by which a module declares whether its forward depends on ``.training``
(``True`` or ``False``); it overrides what :func:`reads_training` reads from the code."""


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, comprehensions, lambdas
            yield from _codes(const)


def _own_attributes(code: types.CodeType, owner: str) -> Iterator[str]:
    """The attributes ``code`` reads off ``owner`` (``self.training``, ``self._helper``)."""
    previous: dis.Instruction | None = None
    for ins in dis.get_instructions(code):
        if (
            ins.opname in ("LOAD_ATTR", "LOAD_METHOD")
            and previous is not None
            and previous.opname in ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_FAST_CHECK")
            and previous.argval == owner
        ):
            yield str(ins.argval)
        previous = ins


def _method_code(cls: type, name: str) -> types.CodeType | None:
    value = inspect.getattr_static(cls, name, None)
    if isinstance(value, property):  # self.name runs the getter
        value = value.fget
    elif isinstance(value, functools.partialmethod):
        value = value.func
    func = inspect.unwrap(value) if callable(value) else None
    code = getattr(func, "__code__", None)
    return code if isinstance(code, types.CodeType) and code.co_varnames else None


@functools.cache
def _class_reads_training(cls: type) -> bool:
    # forward and the methods it calls on self, transitively: torch's InstanceNorm reads the
    # flag in a helper that forward calls, and a subclass may read it only through
    # super().forward(). Methods that forward does not call (an export that saves and
    # restores the mode) do not count. A method is looked up from a place in the MRO: 0 for
    # self.name, past the class that defines the caller for super().name.
    mro = cls.__mro__
    pending: list[tuple[int, str]] = [(0, "forward")]
    seen: set[tuple[int, str]] = set()
    while pending:
        start, name = pending.pop()
        if (start, name) in seen:
            continue
        seen.add((start, name))
        owner = next((i for i in range(start, len(mro)) if name in vars(mro[i])), None)
        if owner is None or mro[owner] in (nn.Module, object):
            continue  # not defined, or nn.Module's own (_call_impl, ...)
        code = _method_code(mro[owner], name)
        if code is None:
            continue  # not a Python method
        for inner in _codes(code):
            names = set(_own_attributes(inner, code.co_varnames[0]))
            if "training" in names:
                return True
            pending.extend((0, n) for n in names)
            if "super" in inner.co_names:  # super().name(...), for any name it calls
                pending.extend((owner + 1, n) for n in inner.co_names)
    return False


def reads_training(module: nn.Module) -> bool:
    """Whether ``module``'s behaviour depends on its mode: dropout, drop path and stochastic
    depth, BatchNorm and InstanceNorm with running statistics, RNN dropout, attention.

    A class declares it with the attribute :data:`READS_TRAINING`; otherwise the answer is
    read from the code of the methods its class defines (any that reads ``.training``), so a
    module whose forward calls a free function that reads the flag of *another* module must
    declare it.

    >>> [reads_training(m) for m in (nn.Dropout(), nn.BatchNorm1d(2), nn.Linear(2, 2))]
    [True, True, False]
    """
    declared = getattr(type(module), READS_TRAINING, None)
    if isinstance(declared, bool):
        return declared
    return _class_reads_training(type(module))  # type: ignore[arg-type]


@recompute_safe  # it only sets the module's mode, as the forward did
class ModeHold:
    """The stack of mode policies pushed on one module, and the forward pre-hook that
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


def held_policy(module: nn.Module) -> str | None:
    """The policy that holds ``module`` now (``"eval"`` or ``"train"``), or ``None``."""
    found = find_hold(module)
    if found is None or not found[1].stack:
        return None
    return found[1].stack[-1][1]


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


POLICIES = ("eval", "train")


def check_policy(bn: object, caller: str) -> str:
    """``bn`` if it names a policy (``"eval"`` or ``"train"``), else the error naming it."""
    if bn not in POLICIES:
        raise SelectorError(
            f"{caller}: bn={bn!r} is not a BatchNorm policy; expected one of {list(POLICIES)}"
        )
    return str(bn)


def policy_of(mode: object, bn: object, default: str, caller: str) -> tuple[str, bool]:
    """The policy to push, and whether it goes on every mode-dependent layer (``mode=``) or
    on the BatchNorm layers only (``bn=``, the older and narrower spelling)."""
    if mode is None:
        return check_policy(default if bn is None else bn, caller), False
    if bn is not None:
        raise SelectorError(
            f"{caller}: give mode= (every layer whose behaviour depends on its mode) or bn= "
            f"(BatchNorm layers only), not both; got mode={mode!r}, bn={bn!r}"
        )
    if mode not in POLICIES:
        raise SelectorError(
            f"{caller}: mode={mode!r} is not a mode; expected one of {list(POLICIES)}"
        )
    return str(mode), True
