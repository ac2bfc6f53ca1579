"""Whether the parameters a spec applies to are still the model's.

A spec freezes, thaws and checks parameter *objects*, resolved once by name. Code that puts
a new ``Parameter`` under such a name afterwards (``module.weight = nn.Parameter(...)``, a
float8 or tensor-parallel conversion, ``fully_shard``, ``load_state_dict(..., assign=True)``,
``to_empty`` / ``to`` under ``torch.__future__.set_overwrite_module_params_on_conversion``)
leaves the spec holding objects the model no longer uses: a new ``Parameter`` requires grad
unless told otherwise and joins any optimizer built from ``model.parameters()``, a thaw would
flip the old object (the group never trains), and every check by identity (flags,
optimizers, ``protect``) would look at the old one. :func:`check_replaced` names each such
parameter and what changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from isolate._text import counted
from isolate._walker import Names
from isolate.errors import IsolationError, ReplacedParameterError
from isolate.spec.optimizers import find
from isolate.spec.plan import Plan

__all__ = ["check_replaced", "require_held", "roles"]

_FIX = (
    "The spec holds the old objects: its freeze, thaws and checks do not apply to the new "
    "ones. Fix: replace parameters before applying the spec (convert, shard, to_empty and "
    "load_state_dict(assign=True) first, then apply), or restore the handle and apply the spec "
    "again after the replacement; to load values into the parameters the spec holds, use "
    "load_state_dict without assign=True"
)


def roles(plan: Plan, frozen: Mapping[str, nn.Parameter]) -> dict[str, tuple[nn.Parameter, str]]:
    """Every parameter the spec applies to, by key: the object it holds and what it is to the
    spec (frozen, in a thaw group, protected), in model order."""
    held: dict[str, tuple[nn.Parameter, list[str]]] = {}
    for name, p in frozen.items():
        held.setdefault(name, (p, []))[1].append("frozen")
    for g in plan.groups:
        thawed = not any(n in frozen for n in g.params)
        for name, p in g.params.items():
            what = "thawed" if thawed else "to be thawed"
            held.setdefault(name, (p, []))[1].append(f"{what} by {g.name!r}")
    for loss, chosen in (plan.protect or {}).items():
        for name, p in chosen.items():
            held.setdefault(name, (p, []))[1].append(f"protected from {loss!r}")
    order = {name: i for i, name in enumerate(plan.names.params)}
    keys = sorted(held, key=lambda n: order.get(n, len(order)))
    return {n: (held[n][0], ", ".join(held[n][1])) for n in keys}


def check_replaced(
    plan: Plan,
    frozen: Mapping[str, nn.Parameter],
    optimizers: Sequence[torch.optim.Optimizer],
    when: str,
    caller: str,
) -> tuple[int, list[IsolationError]]:
    """A :class:`~isolate.errors.ReplacedParameterError` naming every parameter the spec
    applies to that the model no longer holds under its name, with what changed: the new
    object's ``requires_grad``, the optimizers that hold it, and those still holding the old
    one. Returns how many parameters were checked, and the violations.

    A parameter moved under another name with the same object (``parametrize`` moves
    ``weight`` to ``parametrizations.weight.original``) is still the spec's, and passes.
    """
    held = roles(plan, frozen)
    now = Names.of(plan.model, aliases=True).params
    present = {id(p) for p in now.values()}
    lines: list[str] = []
    for name, (old, role) in held.items():
        new = now.get(name)
        if new is old or (new is None and id(old) in present):
            continue
        if new is None:
            lines.append(f"  {name} ({role}): no longer in the model")
            continue
        changes = ["a new object"]
        if new.requires_grad != old.requires_grad:
            grad = "requires grad" if new.requires_grad else "does not require grad"
            changes.append(f"{grad} (the spec's object: requires_grad={old.requires_grad})")
        slots = find({id(new): name}, optimizers)
        changes += [f"in optimizer {s.opt}, group {s.group}" for s in slots]
        stale = find({id(old): name}, optimizers)
        changes += [f"optimizer {s.opt}, group {s.group} still holds the old one" for s in stale]
        lines.append(f"  {name} ({role}): " + "; ".join(changes))
    if not lines:
        return len(held), []
    replaced = [line.split(" (", 1)[0].strip() for line in lines]
    were = "was" if len(replaced) == 1 else "were"
    error = ReplacedParameterError(
        f"{caller}: {when}, the spec's {counted(replaced, 'parameter')} {were} replaced or removed "
        f"after it was applied:\n" + "\n".join(lines[:8]) + f"\n{_FIX}"
    )
    return len(held), [error]


def require_held(
    plan: Plan,
    frozen: Mapping[str, nn.Parameter],
    optimizers: Sequence[torch.optim.Optimizer],
    when: str,
    caller: str,
) -> None:
    """Refuse to change anything (attach, thaw) while a parameter of the spec is replaced.

    Raises:
        ReplacedParameterError: as :func:`check_replaced` reports.
    """
    _, replaced = check_replaced(plan, frozen, optimizers, when, caller)
    if replaced:
        raise replaced[0]
