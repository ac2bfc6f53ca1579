"""The named losses' check of a spec: each loss reaches nothing it must be kept from (the
frozen parameters, ``protect[loss]``, or what is upstream of a ``detach`` branch), and no
detach branch is called around its wrapper.

Like every check of :mod:`isolate.spec.checks`, each returns the violations it found as typed
errors; only misuse that leaves nothing to check (a loss missing from ``protect``, a branch
run too often to record) raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from isolate._autograd import refuse_raising, walk
from isolate._sharding import check_leaves
from isolate._text import shown
from isolate._walker import Names
from isolate.errors import GradientLeakError, IsolationError, IsolationTypeError, SpecError
from isolate.reachability import assert_isolated
from isolate.spec.branches import RECORD_LIMIT, Branches
from isolate.spec.plan import Plan

__all__ = ["check_bypass", "check_isolation", "check_losses", "checked_losses"]


def check_isolation(
    plan: Plan,
    frozen: Mapping[str, nn.Parameter],
    losses: Mapping[str, torch.Tensor] | None,
    total: torch.Tensor | Sequence[torch.Tensor] | None,
    branches: Branches,
    when: str,
    caller: str,
) -> tuple[dict[str, int], list[IsolationError]]:
    """The ``"losses"`` check of ``verify``: the named ``losses`` (:func:`check_losses`), then
    the ``total`` loss for detach branches called around their wrapper (:func:`check_bypass`,
    on a step that records the branches). Returns the count per named loss and the
    violations."""
    counts: dict[str, int] = {}
    found: list[IsolationError] = []
    flagged: set[str] = set()
    if losses is not None:
        named = checked_losses(plan, losses, branches.overflow, caller)
        counts, found, flagged = check_losses(plan, frozen, named, branches.inputs, when, caller)
    if total is not None and branches.recording:
        found += check_bypass(plan, total, branches.inputs, flagged, when, caller)
    return counts, found


def check_losses(
    plan: Plan,
    frozen: Mapping[str, nn.Parameter],
    losses: Mapping[str, torch.Tensor],
    branch_inputs: Mapping[str, Sequence[torch.Tensor]],
    when: str,
    caller: str,
) -> tuple[dict[str, int], list[IsolationError], set[str]]:
    """Check that each named loss reaches no protected parameter; also return the names of
    the detach branches found bypassed.

    Protected are the frozen parameters, and ``protect[loss]`` where given, else everything
    upstream of the inputs the ``detach`` branches received.
    """
    names = Names.of(plan.model)
    upstream: dict[str, nn.Parameter] = {}
    if plan.protect is None:
        inputs = [t for ts in branch_inputs.values() for t in ts]
        if inputs:
            leaves = _walk(inputs, plan.model, caller)
            upstream = {n: p for n, p in names.params.items() if id(p) in leaves}
    counts: dict[str, int] = {}
    violations: list[IsolationError] = []
    flagged: set[str] = set()
    for loss_name, loss in losses.items():
        reached = _walk([loss], plan.model, caller)
        bypassed = _bypassed(
            plan, names, branch_inputs, f"loss {loss_name!r}", reached, when, caller
        )
        violations += bypassed.values()
        flagged.update(bypassed)
        protected = dict(frozen)
        protected.update(upstream if plan.protect is None else plan.protect.get(loss_name, {}))
        detached = [w.name for w in plan.wraps if w.kind == "detach"]
        if not protected and detached and not bypassed:
            raise SpecError(
                f"{caller}.verify(): {when}, loss {loss_name!r} has no parameter to be kept "
                f"from: the detach branches {detached} did not run with inputs that require "
                f"grad, nothing is frozen and protect does not name {loss_name!r}, so the "
                f"check would pass whatever the loss reaches. Compute it through the detach "
                f"branch in this step's forward, or name what it must not reach with "
                f"protect={{{loss_name!r}: [...]}}"
            )
        counts[loss_name] = len(protected)
        leaked = {n: p for n, p in protected.items() if id(p) in reached}
        if not leaked:
            continue
        try:
            assert_isolated(loss, leaked, model=plan.model)
        except GradientLeakError as error:
            why = (
                f"protect[{loss_name!r}]"
                if plan.protect is not None and loss_name in plan.protect
                else "frozen, or upstream of a detach branch"
            )
            violations.append(
                GradientLeakError(
                    f"{caller}: {when}, loss {loss_name!r} reaches {len(leaked)} protected "
                    f"parameters ({why}) {shown(leaked)}:\n{error}"
                )
            )
    return counts, violations, flagged


def _walk(
    outputs: Sequence[torch.Tensor], model: nn.Module, caller: str
) -> dict[int, torch.Tensor]:
    """The leaves the outputs reach, FSDP2 temporaries mapped to their parameters."""
    found = walk(outputs, caller)
    refuse_raising(found, caller, walk_only=True)
    check_leaves(found, [model], caller)
    return found.leaves


def _bypassed(
    plan: Plan,
    names: Names,
    branch_inputs: Mapping[str, Sequence[torch.Tensor]],
    who: str,
    reached: Mapping[int, torch.Tensor],
    when: str,
    caller: str,
) -> dict[str, IsolationError]:
    """By branch name: the detach branches whose parameters ``who`` (a loss) reaches though
    their wrapper did not run (called some other way, so their inputs were not detached)."""
    out: dict[str, IsolationError] = {}
    for w in plan.wraps:
        if w.kind != "detach" or w.name in branch_inputs:
            continue
        inside = [names.name(p) for p in w.child.parameters() if id(p) in reached]
        if inside:
            out[w.name] = GradientLeakError(
                f"{caller}: {when}, {who} reaches the parameters of the detach branch "
                f"{w.name!r} {shown(inside)}, but its Detached wrapper did not run with inputs "
                f"that require grad: the forward calls the branch some other way (an alias, or "
                f"model.{w.name}.module(...)), so its inputs are not detached. Call the branch "
                f"as model.{w.name}(...)"
            )
    return out


def check_bypass(
    plan: Plan,
    total: torch.Tensor | Sequence[torch.Tensor],
    branch_inputs: Mapping[str, Sequence[torch.Tensor]],
    flagged: set[str],
    when: str,
    caller: str,
) -> list[IsolationError]:
    """The detach branches the total loss reaches around their wrapper (not already named by
    a named loss's check): without named losses, the one sign that the forward bypassed one."""
    missing = [
        w
        for w in plan.wraps
        if w.kind == "detach" and w.name not in branch_inputs and w.name not in flagged
    ]
    if not missing:  # every wrapper ran: nothing to walk for
        return []
    totals = [total] if isinstance(total, torch.Tensor) else list(total)
    reached = _walk(totals, plan.model, caller)
    names = Names.of(plan.model)
    found = _bypassed(plan, names, branch_inputs, "the total loss", reached, when, caller)
    return list(found.values())


def checked_losses(
    plan: Plan, losses: object, overflow: set[str], caller: str
) -> Mapping[str, torch.Tensor]:
    """``losses`` if it is a dict of name -> tensor that covers ``protect``, else a typed error.

    Raises:
        IsolationTypeError: ``losses`` is not a dict of loss name -> loss tensor.
        SpecError: ``protect`` names a loss that is missing, or a branch ran more often than
            its inputs could be recorded (the check could not see what is upstream of it).
    """
    if not isinstance(losses, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in losses.items()
    ):
        raise IsolationTypeError(
            f"{caller}.verify(): losses must be a dict of loss name -> loss tensor, got {losses!r}"
        )
    if plan.protect is not None:
        missing = sorted(set(plan.protect) - set(losses))
        if missing:
            raise SpecError(
                f"{caller}: protect names the losses {missing}, but verify() got "
                f"{sorted(losses)}; pass every loss that protect names"
            )
    if overflow:
        raise SpecError(
            f"{caller}: the detach branches {sorted(overflow)} ran more than {RECORD_LIMIT} "
            f"times since the last step(), so their inputs were not all recorded and the check "
            f"cannot see what is upstream of them; call handle.step(epoch=..., step=...) at "
            f"the start of every training step"
        )
    return losses
