"""The flag flip: every ``requires_grad`` checked before the first one changes, then written."""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from isolate._selectors import is_float
from isolate._text import counted
from isolate.errors import IsolationTypeError

__all__ = ["HandleSequence", "check_params", "outside_compile", "whole_module", "write_flags"]

_dtype = operator.attrgetter("dtype")
# Types whose requires_grad_ is torch's own, so assigning .requires_grad does the same thing
# (the same leaf and inference-tensor checks) at half the cost of the method call. A subclass
# may override requires_grad_, and then gets its method called.
_PLAIN = frozenset({nn.Parameter, torch.Tensor})


def check_params(
    model: nn.Module, caller: str, params: dict[str, nn.Parameter], requires_grad: bool
) -> tuple[list[nn.Parameter], bool]:
    """Everything that could make a flag flip fail, checked before the first one.

    Returns the parameters as a list, and whether all of them are of a type in ``_PLAIN``.

    Each check is one C-level pass (over the distinct types, dtypes, or ``is_inference``)
    that finds whether anything is wrong; only then are the culprits named, by a second pass.
    On 10,000 tensors a Python-level ``isinstance`` per parameter alone cost as much as the
    flag flips it guards.
    """
    values = list(params.values())
    kinds = set(map(type, values))
    if any(issubclass(kind, UninitializedParameter) for kind in kinds):
        lazy = [name for name, p in params.items() if isinstance(p, UninitializedParameter)]
        raise IsolationTypeError(
            f"{caller}: {counted(lazy, 'parameter')} of {type(model).__name__} are "
            f"uninitialized lazy parameters (UninitializedParameter, from nn.LazyLinear and "
            f"friends), whose requires_grad cannot be set; nothing was changed. Fix: run one "
            f"forward pass with a sample batch first, so they are created, then call {caller} again"
        )
    if requires_grad and not all(
        d.is_floating_point or d.is_complex for d in set(map(_dtype, values))
    ):
        integral = [name for name, p in params.items() if not is_float(p)]
        raise IsolationTypeError(
            f"{caller}: parameters {integral} are not floating point, so they cannot "
            f"require grad; leave them out of the selection (e.g. with a predicate)"
        )
    # requires_grad=True cannot be set on an inference tensor (a parameter created under
    # torch.inference_mode()): not by unfreeze, and not by the restore() of a freeze.
    if any(map(torch.Tensor.is_inference, values)):
        stuck = [
            name
            for name, p in params.items()
            if p.is_inference() and p.requires_grad != requires_grad
        ]
        if stuck:
            raise IsolationTypeError(
                f"{caller}: {counted(stuck, 'parameter')} of {type(model).__name__} were "
                f"created under torch.inference_mode(), so requires_grad=True can never be set "
                f"on them again and this change could not be undone; nothing was changed. Fix: "
                f"create the model outside inference_mode (or clone its parameters outside it)"
            )
    return values, kinds <= _PLAIN


def whole_module(
    module: nn.Module, caller: str
) -> tuple[dict[str, nn.Parameter], dict[str, nn.Module]]:
    """The whole module, as ``select(module, ())`` would give it, without the selector
    grammar (a module with no parameters, a BatchNorm without affine, is fine here), checked
    before anything changes so a refused module is left as it was."""
    params = dict(module.named_parameters())
    norms: dict[str, nn.Module] = {
        name: m
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }
    check_params(module, caller, params, False)
    return params, norms


def write_flags(params: list[nn.Parameter], flags: list[bool] | bool, plain: bool) -> None:
    """Set ``requires_grad`` of each parameter to its flag (or all to one flag)."""
    if isinstance(flags, list):
        trues = flags.count(True)
        if trues in (0, len(flags)):  # one flag for all (the common case): a loop without zip
            flags = trues > 0
    if isinstance(flags, bool):
        if plain:
            for p in params:
                p.requires_grad = flags
        else:
            for p in params:
                p.requires_grad_(flags)
    elif plain:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad = flag
    else:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)


_F = TypeVar("_F", bound=Callable[..., Any])


def outside_compile(fn: _F) -> _F:
    """Keep ``fn`` out of compiled graphs: a flag flipped while tracing would be baked in.

    ``torch._disable_dynamo`` is ``torch.compiler.disable`` that imports the compiler on the
    first call instead of now: ``import isolate`` stays as light as ``import torch``.
    """
    lazy = getattr(torch, "_disable_dynamo", None)
    if lazy is None:  # pragma: no cover - torch versions without the lazy form
        return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]
    return cast(_F, lazy(fn))


class HandleSequence:
    """Numbers handles in creation order; handles loaded from a pickle keep their numbers and
    move the count past them, so a handle made afterwards is still the newer one."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            seq = self._next
            self._next += 1
            return seq

    def past(self, seq: int) -> None:
        with self._lock:
            self._next = max(self._next, seq + 1)
