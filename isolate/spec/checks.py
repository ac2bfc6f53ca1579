"""The checks a spec runs while training: params, reach, drift, flags, optimizers and ranks
(the named losses' check is :mod:`isolate.spec.loss_checks`).

Each check returns the violations it found as typed errors and never raises by itself; the
engine decides whether to raise or warn. Tensors are looked up by name at every check, so a
buffer that something replaced (Lightning's SWA does) is checked by its new values.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from isolate._checkpointing import shared_reruns
from isolate._text import shown
from isolate._walker import Names
from isolate.cutoff import cut_off_parameters
from isolate.drift import Drift, Snapshot, snapshot
from isolate.errors import (
    CutOffError,
    DriftError,
    IsolationError,
    SpecError,
    StaleCompileError,
)
from isolate.exposure import optimizer_exposure
from isolate.spec.branches import Branches
from isolate.spec.contract_checks import ContractWatch
from isolate.spec.identity import check_replaced
from isolate.spec.loss_checks import check_isolation
from isolate.spec.optimizers import find
from isolate.spec.plan import Plan
from isolate.spec.ranks import check_ranks, world_size

__all__ = [
    "Tally",
    "Verification",
    "check_drift",
    "check_flags",
    "check_optimizers",
    "check_reach",
    "run_checks",
    "watch",
]


@dataclass(frozen=True)
class Verification:
    """What one :meth:`~isolate.spec.handle.IsolationHandle.verify` checked.

    Attributes:
        params: how many parameters the spec applies to were checked to be the objects the
            model holds under their names (none replaced since the spec was applied).
        losses: loss name -> how many protected parameters were checked against it.
        reach: how many trainable parameters were checked to be reached by the total loss.
        drift: how many frozen parameters and buffers of the frozen part were compared with
            their values when frozen.
        flags: how many frozen parameters were checked to still have ``requires_grad=False``.
        optimizers: how many optimizers were searched for frozen parameters.
        ranks: the number of processes compared (1 outside a distributed run).
        contracts: contract name -> how many of its clauses were checked.
        violations: the messages of the violations found (only with ``on_violation="warn"``;
            with ``"raise"`` the first one is raised).
    """

    losses: Mapping[str, int] = field(default_factory=dict)
    params: int = 0
    reach: int = 0
    drift: int = 0
    flags: int = 0
    optimizers: int = 0
    ranks: int = 1
    contracts: Mapping[str, int] = field(default_factory=dict)
    violations: tuple[str, ...] = ()


_SAID = {
    "params": "{n} parameters of the spec were still the objects the model holds (none replaced)",
    "reach": "the loss backpropagated reached each of {n} trainable parameters",
    "drift": "{n} frozen tensors (parameters, buffers of the frozen part) unchanged since frozen",
    "flags": "{n} frozen parameters still had requires_grad=False",
    "optimizers": "{n} optimizer(s) held no frozen parameter",
    "ranks": "{n} process(es) held the same frozen tensors",
}


@dataclass
class Tally:
    """What every :meth:`~isolate.spec.handle.IsolationHandle.verify` of a handle checked,
    added up: how often each check ran, and what its last run counted (``handle.tally``).

    >>> tally = Tally()
    >>> tally.add(Verification(losses={"probe": 4}, drift=4), ("losses", "drift"))
    >>> tally.add(Verification(drift=4), ("drift",))
    >>> print(tally)
    verify ran 2 times; every check passed:
      losses (1x): 'probe' reached none of the 4 parameters it must not reach
      drift (2x): 4 frozen tensors (parameters, buffers of the frozen part) unchanged since frozen
    """

    runs: int = 0
    times: dict[str, int] = field(default_factory=dict)
    last: dict[str, Verification] = field(default_factory=dict)

    def add(self, verification: Verification, checks: Collection[str]) -> None:
        """Count one verification that ran ``checks``. A check with nothing to look at is not
        counted: ``losses`` without losses, ``reach`` without a total loss, ``ranks`` in one
        process, ``contracts`` without a clause to check."""
        self.runs += 1
        looked = {
            "losses": bool(verification.losses),
            "contracts": bool(verification.contracts),
            "reach": verification.reach > 0,
            "ranks": verification.ranks > 1,
        }
        ran = [c for c in checks if looked.get(c, True)]
        for check in ran:
            self.times[check] = self.times.get(check, 0) + 1
            self.last[check] = verification

    def __str__(self) -> str:
        lines = [f"verify ran {self.runs} times; every check passed:"]
        for check, times in self.times.items():
            last = self.last[check]
            if check == "losses":
                said = "; ".join(
                    f"{name!r} reached none of the {n} parameters it must not reach"
                    for name, n in last.losses.items()
                )
            elif check == "contracts":
                said = "; ".join(
                    f"contract {name!r} held ({n} clause checks)"
                    for name, n in last.contracts.items()
                )
            elif check not in _SAID:
                said = "passed"
            else:
                said = _SAID[check].format(n=getattr(last, check))
            lines.append(f"  {check} ({times}x): {said}")
        return "\n".join(lines)


def watch(
    plan: Plan,
    frozen: Mapping[str, nn.Parameter],
    norms: Mapping[str, nn.Module],
    *,
    drift: Drift = "fingerprint",
) -> Snapshot:
    """A :func:`~isolate.drift.snapshot` of the ``frozen`` parameters and of the buffers of the
    frozen part, by ``state_dict`` key.

    The frozen part's buffers are those of every module whose parameters are all frozen (and
    of the modules under it): a frozen layer's forward must not change its state either
    (spectral norm's power iteration, a running average, a quantizer's scale). The held
    ``norms`` are left out when the spec lets them train (``bn="train"``, ``mode="train"``);
    held in eval mode, their statistics must stay still.

    Fingerprints by default: any change of any bit is caught for O(number of tensors) memory,
    but not its size. With ``drift="copy"`` copies live in host memory (a frozen backbone does
    not cost accelerator memory twice) and a report gives the largest change.
    """
    training = (
        {id(b) for m in norms.values() for b in m.buffers(recurse=False)}
        if plan.spec.policy == "train"
        else set()
    )
    buffers = [
        plan.names.of_id[id(b)]
        for b in _frozen_part_buffers(plan.model, {id(p) for p in frozen.values()})
        if id(b) in plan.names.of_id and id(b) not in training
    ]
    moving = plan.moving  # an EMA target is frozen to gradients, but moves by its rule
    return snapshot(
        plan.model, names=[n for n in [*frozen, *buffers] if n not in moving], drift=drift
    )


def _frozen_part_buffers(model: nn.Module, frozen: set[int]) -> list[torch.Tensor]:
    """The buffers of the modules of ``model`` that have parameters, all of them ``frozen``
    (ids), and of every module under those, each once."""
    seen: set[int] = set()
    out = []
    for module in model.modules():
        params = list(module.parameters())
        if params and all(id(p) in frozen for p in params):
            for b in module.buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    out.append(b)
    return out


def check_drift(watched: Snapshot, when: str, caller: str) -> tuple[list[IsolationError], Snapshot]:
    """A :class:`DriftError` naming what moved since ``watched``, and the snapshot to watch
    from next: the same one, or a new one from the moved values, so that a run that only
    warns reports each move once."""
    moved = watched.changed()
    if not moved:
        return [], watched
    renewed = watched.renewed()
    width = max(len(name) for name in moved)
    kinds = watched.kinds
    lines = [
        f"  {name:<{width}}  ({kinds[name]}) "
        + ("changed (size unknown: fingerprints only)" if math.isnan(d) else f"max|Δ|={d:.3e}")
        for name, d in list(moved.items())[:8]
    ]
    if any(kinds[name] == "buffer" for name in moved):
        lines.append(
            "A frozen layer's forward in train mode updates its buffers (BatchNorm's running "
            "statistics, spectral norm's vectors, a running average). Fix: hold the frozen "
            "part in eval mode with mode='eval', or let its layers train with mode='train' "
            "(bn='train' for BatchNorm alone). A buffer that moves in either mode (a step "
            "counter, a quantization observer) means its layer is not frozen: leave the layer "
            "out of freeze"
        )
    error = DriftError(
        f"{caller}: frozen tensors moved ({when}): {shown(moved)}\n" + "\n".join(lines)
    )
    return [error], renewed


def check_reach(
    model: nn.Module,
    total: torch.Tensor | Sequence[torch.Tensor],
    expected_unused: tuple[str, ...],
    when: str,
    caller: str,
) -> tuple[int, list[IsolationError]]:
    """Every trainable parameter must be reached by ``total`` (or be expected unused);
    return how many trainable parameter names were checked, and the violations."""
    try:
        result = cut_off_parameters(total, model, expected_unused=expected_unused)
    except StaleCompileError as error:  # a thaw the compiled forward does not see
        names = Names.of(model)
        stale = [names.name(t) for t in error.tensors if isinstance(t, torch.Tensor)]
        named = StaleCompileError(f"{caller}: {when}, {shown(stale)} get no gradient: {error}")
        named.tensors = error.tensors
        return 0, [named]
    found: list[IsolationError] = []
    if result.parameters:
        found.append(
            CutOffError(
                f"{caller}: {when}, {result}\nFix: connect them to the loss, freeze them if "
                f"they are not meant to learn, or declare them with expected_unused="
            )
        )
    return result.trainable, found


def check_flags(frozen: Mapping[str, nn.Parameter], when: str, caller: str) -> list[IsolationError]:
    """A :class:`~isolate.errors.DriftError` for frozen parameters that require grad again."""
    unfrozen = [n for n, p in frozen.items() if p.requires_grad]
    if not unfrozen:
        return []
    return [
        DriftError(
            f"{caller}: {when}, {len(unfrozen)} frozen parameters require grad again: "
            f"{shown(unfrozen)}; something other than the spec unfroze them (another "
            f"finetuning callback, or model code). Thaw them with a Thaw step instead"
        )
    ]


def check_optimizers(
    frozen: Mapping[str, nn.Parameter],
    optimizers: Sequence[torch.optim.Optimizer],
    when: str,
    caller: str,
    thawed: Mapping[str, nn.Parameter] | None = None,
) -> list[IsolationError]:
    """Frozen parameters back in an optimizer that can move them, and thawed parameters in
    none of the attached optimizers (they get gradients and never move)."""
    held = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    idle = [n for n, p in (thawed or {}).items() if id(p) not in held]
    found: list[IsolationError] = []
    if idle:
        found.append(
            SpecError(
                f"{caller}: {when}, thawed parameters are in none of the {len(optimizers)} "
                f"attached optimizers, so they get gradients but never move: {shown(idle)}. "
                f"Attach the optimizer that trains them (handle.attach(optimizer, "
                f"schedulers)) before training, and do not rebuild it after a thaw"
            )
        )
    ids = {id(p): n for n, p in frozen.items()}
    exposed: list[str] = []
    for oi, opt in enumerate(optimizers):
        slots = {(s.group, id(s.param)) for s in find(ids, [opt])}
        if not slots:
            continue
        for e in optimizer_exposure(opt):
            p = opt.param_groups[e.group]["params"][e.index]
            if (e.group, id(p)) in slots and e.at_risk:
                exposed.append(
                    f"{ids[id(p)]} (optimizer {oi}, group {e.group}: {'; '.join(e.reasons)})"
                )
    if not exposed:
        return found
    return [
        *found,
        DriftError(
            f"{caller}: {when}, frozen parameters are back in an optimizer that can move them: "
            f"{shown(exposed)}; something added them after the spec was applied. Thaw them "
            f"with a Thaw step instead"
        ),
    ]


def _check_contracts(
    contracts: ContractWatch,
    losses: Mapping[str, torch.Tensor] | None,
    total: torch.Tensor | Sequence[torch.Tensor] | None,
    optimizers: Sequence[torch.optim.Optimizer],
    checks: Collection[str],
    when: str,
) -> tuple[dict[str, int], list[IsolationError]]:
    totals = None if total is None else [total] if torch.is_tensor(total) else list(total)
    # The named losses' check before backward leaves what the optimizer step may move
    # (optimizers, modes, drift) to the check after the step.
    state = "drift" in checks or "losses" not in checks
    return contracts.check(losses, totals, optimizers, when, state=state)


def run_checks(
    plan: Plan,
    frozen: Mapping[str, nn.Parameter],
    losses: Mapping[str, torch.Tensor] | None,
    reach: tuple[torch.Tensor | Sequence[torch.Tensor] | None, tuple[str, ...]],
    branches: Branches,
    watched: Snapshot | None,
    optimizers: Sequence[torch.optim.Optimizer],
    checks: Collection[str],
    when: str,
    caller: str,
    thawed: Mapping[str, nn.Parameter] | None = None,
    contracts: ContractWatch | None = None,
) -> tuple[Verification, list[IsolationError], Snapshot | None]:
    """Run the ``checks`` asked for; return what was checked, the violations found, and the
    snapshot to check drift against next time."""
    found: list[IsolationError] = []
    held = 0
    if "params" in checks:
        held, found = check_replaced(plan, frozen, optimizers, when, caller)
    if found:  # the other checks would look at objects the model no longer holds
        checks = [c for c in checks if c == "ranks"]
    # The checks below walk the same graph several times: each checkpointed segment is
    # re-run once for all of them.
    with shared_reruns():
        total, expected_unused = reach
        counts: dict[str, int] = {}
        if "losses" in checks:
            counts, leaks = check_isolation(plan, frozen, losses, total, branches, when, caller)
            found += leaks
        reached = 0
        if "reach" in checks and total is not None:
            reached, cut = check_reach(plan.model, total, expected_unused, when, caller)
            found += cut
        drifted = 0
        if "drift" in checks and watched is not None:
            drifted = len(watched)
            moved, watched = check_drift(watched, when, caller)
            found += moved
        if "flags" in checks:
            found += check_flags(frozen, when, caller)
        if "optimizers" in checks:
            found += check_optimizers(frozen, optimizers, when, caller, thawed)
        kept: dict[str, int] = {}
        if "contracts" in checks and contracts:
            kept, broken = _check_contracts(contracts, losses, total, optimizers, checks, when)
            found = broken + found  # a method's clause says more than the generic check it implies
    ranks = world_size() if "ranks" in checks else 1
    if ranks > 1:  # every rank also learns what the others found: one verdict for all
        found += check_ranks(Names.of(plan.model).params, when, caller, found)
    verification = Verification(
        params=held,
        losses=counts,
        reach=reached,
        drift=drifted,
        flags=len(frozen) if "flags" in checks else 0,
        optimizers=len(optimizers) if "optimizers" in checks else 0,
        ranks=ranks,
        contracts=kept,
        violations=tuple(str(e) for e in found),
    )
    return verification, found, watched
