"""What decides whether a walk may re-run a checkpointed segment on fake tensors, and what
puts back the modules a fake re-run changed.

A fake re-run (``isolate._checkpointing``) builds the segment's graph without its
arithmetic. It must not run code that could keep or read what it is given (a forward hook
not marked :func:`recompute_safe`), must not make torch.compile compile again (any compile
in the process sends every segment to a real re-run), and must leave each module the segment
holds as it found it (:func:`state_of` before, :func:`restore` after).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = [
    "Kept",
    "compiles",
    "hooks_allow_fake",
    "modules_in",
    "recompute_safe",
    "restore",
    "state_of",
]

_MARK = "__isolate_recompute_safe__"


def recompute_safe(hook: Any) -> Any:
    """Mark a forward hook (a function or a class of callable hooks) as one that does nothing
    while an audit re-runs a segment (it checks ``recomputing()``, or only sets a mode), so
    a walk may re-run the segment on fake tensors with the hook in place.

    >>> layer = nn.Linear(2, 2)
    >>> _ = layer.register_forward_hook(lambda module, args, output: None)
    >>> hooks_allow_fake(layer)
    False
    >>> layer = nn.Linear(2, 2)
    >>> _ = layer.register_forward_hook(recompute_safe(lambda module, args, output: None))
    >>> hooks_allow_fake(layer)
    True
    """
    setattr(hook, _MARK, True)
    return hook


def hooks_allow_fake(fn: object) -> bool:
    """Whether every forward hook that a re-run of ``fn`` could call is marked
    :func:`recompute_safe`: a user's hook could keep or read what it is given."""
    from torch.nn.modules import module as hooks

    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return False
    for root in modules_in(fn):
        for module in root.modules():
            for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
                if not getattr(hook, _MARK, False):
                    return False
    return True


def modules_in(obj: object, depth: int = 0) -> Iterator[nn.Module]:
    """The modules a segment's function holds: itself, a bound method's owner, a partial's
    arguments, a closure's cells (transformers checkpoints ``partial(forward, layer)``)."""
    if isinstance(obj, nn.Module):
        yield obj
        return
    if depth > 3:
        return
    children: list[object] = []
    if isinstance(obj, functools.partial):
        children = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.MethodType):
        children = [obj.__self__, obj.__func__]
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                children.append(cell.cell_contents)
    for child in children:
        yield from modules_in(child, depth + 1)


def compiles() -> int:
    """How many frames torch.compile has compiled in this process (0 before any)."""
    dynamo = sys.modules.get("torch._dynamo")
    return int(dynamo.utils.counters["frames"]["total"]) if dynamo is not None else 0


Kept = tuple[nn.Module, dict[str, Any], list[dict[str, Any]]]


def state_of(fn: object) -> list[Kept]:
    """Each module ``fn`` holds, with a shallow copy of its attributes and tensor slots."""
    kept: list[Kept] = []
    for root in modules_in(fn):
        for module in root.modules():
            slots: list[dict[str, Any]] = [dict(module._parameters), dict(module._buffers)]
            kept.append((module, dict(module.__dict__), slots))
    return kept


def restore(kept: list[Kept]) -> bool:
    """Put back every attribute and tensor slot a fake run changed; whether one changed."""
    changed = False
    for module, attributes, (params, buffers) in kept:
        for now, before in ((module.__dict__, attributes), (module._parameters, params),
                            (module._buffers, buffers)):  # fmt: skip
            if now.keys() != before.keys() or any(now[k] is not v for k, v in before.items()):
                changed = True
                now.clear()
                now.update(before)
    return changed
