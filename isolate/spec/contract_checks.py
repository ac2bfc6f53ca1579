"""Checking a spec's contracts while training: when, with what, and what each one said.

:func:`bind` resolves the contracts against a model (with the rest of the plan, before
anything changes); :class:`ContractWatch` is what the handle runs: at the start of every
optimizer step (:meth:`ContractWatch.begin`) it closes the windows that are due (a tensor that
had to change, an EMA step) and, on a check step, opens new ones and records the inputs and
outputs of the modules the contracts name; :meth:`ContractWatch.check` runs the clauses that
what it is given allows (the named losses, the loss backpropagated, the optimizers) and keeps
each contract's verdict for reports.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from isolate._checkpointing import recomputing
from isolate._rerun_safety import recompute_safe
from isolate._walker import Names
from isolate.errors import IsolationError, SpecError
from isolate.spec.contract_clauses import (
    Clauses,
    Context,
    Outcome,
    Probe,
    Recorded,
    StopGradient,
    Teacher,
    Trains,
)
from isolate.spec.contracts import Contract
from isolate.spec.ema import Ema
from isolate.spec.reversal import Reversal

__all__ = ["ContractWatch", "bind"]

_KINDS: dict[str, type[Clauses]] = {
    "teacher": Teacher,
    "ema": Ema,
    "stop_gradient": StopGradient,
    "reversal": Reversal,
    "probe": Probe,
    "trains": Trains,
}


def bind(contracts: Sequence[Contract], model: nn.Module, caller: str) -> list[Clauses]:
    """Resolve every contract against ``model``; change nothing.

    Raises:
        SelectorError: a selector matches nothing, or a module name is no submodule.
        SpecError: an EMA's networks hold different tensors.
    """
    if not contracts:
        return []
    names = Names.of(model)
    return [_KINDS[c.kind](c, model, names, caller) for c in contracts]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors(item)]
    return []


class ContractWatch:
    """The contracts of an applied spec: their windows, recordings and verdicts.

    Attributes:
        verdicts: contract name -> ``{"kind", "clauses": {clause: {"checked", "violated",
            "first"}}}``: how often each clause was checked and found broken, and the first
            violation's message.
    """

    def __init__(self, bound: Sequence[Clauses], model: nn.Module, caller: str) -> None:
        self.bound = list(bound)
        self.model = model
        self.caller = caller
        self._recorded = Recorded()
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._step: int | None = None
        self._pending: list[tuple[Clauses, Outcome]] = []
        self.verdicts: dict[str, dict[str, Any]] = {
            b.contract.name: {
                "kind": b.contract.kind,
                "clauses": {c: {"checked": 0, "violated": 0, "first": None} for c in b.CLAUSES},
            }
            for b in self.bound
        }

    def __bool__(self) -> bool:
        return bool(self.bound)

    @property
    def losses(self) -> tuple[str, ...]:
        """The named losses the contracts read."""
        return tuple(dict.fromkeys(n for b in self.bound for n in b.losses))

    @property
    def pending(self) -> bool:
        """Whether windows closed since the last check left results to report."""
        return bool(self._pending)

    def begin(self, step: int, *, record: bool) -> None:
        """The start of optimizer step ``step`` (``step`` steps taken so far): close the windows
        that are due; on a check step (``record``) open windows and record the watched modules
        during the forward that follows."""
        if not self.bound:
            return
        if self._step != step:
            self._step = step
            self._disarm()
            self._close(step, f"at the start of step {step}")
        if record:
            for b in self.bound:
                b.open(step, self.model)
            self._arm()

    def finish(self, next_step: int) -> None:
        """The end of training, ``next_step`` optimizer steps taken: close what is due."""
        self._disarm()
        self._close(next_step, "at the end of training")

    def restore(self) -> None:
        """Remove every hook the watch registered, and drop its snapshots and copies."""
        self._disarm()
        for b in self.bound:
            b.release()

    def check(
        self,
        losses: Mapping[str, torch.Tensor] | None,
        total: Sequence[torch.Tensor] | None,
        optimizers: Sequence[torch.optim.Optimizer],
        when: str,
        *,
        state: bool,
    ) -> tuple[dict[str, int], list[IsolationError]]:
        """Run the clauses ``losses`` / ``total`` allow, the state clauses with ``state``, and
        report what closed windows found; return clauses checked per contract, and the
        violations (each also counted in :attr:`verdicts`).

        Raises:
            SpecError: a contract names a loss that ``losses`` lacks.
        """
        if losses is not None:
            missing = sorted(set(self.losses) - set(losses))
            if missing:
                raise SpecError(
                    f"{self.caller}: the contracts read the losses {missing}, but verify() got "
                    f"{sorted(losses)}; pass every loss the contracts name"
                )
        ctx = self._context(losses, total, optimizers, when)
        outcomes, self._pending = self._pending, []
        for b in self.bound:
            if losses is not None or total:
                outcomes += [(b, o) for o in b.graph(ctx)]
            if state:
                outcomes += [(b, o) for o in b.state(ctx)]
        if state:
            self._disarm()  # the step's graph checks are done
        return self._count(outcomes)

    def _context(
        self,
        losses: Mapping[str, torch.Tensor] | None,
        total: Sequence[torch.Tensor] | None,
        optimizers: Sequence[torch.optim.Optimizer],
        when: str,
    ) -> Context:
        names = Names.of(self.model)
        return Context(
            self.model, names, losses, total, optimizers, self._recorded, when, self.caller
        )

    def _close(self, step: int, when: str) -> None:
        due = [b for b in self.bound if b.due(step)]
        if due:
            ctx = self._context(None, None, (), when)
            self._pending += [(b, o) for b in due for o in b.close(ctx)]

    def _count(
        self, outcomes: Collection[tuple[Clauses, Outcome]]
    ) -> tuple[dict[str, int], list[IsolationError]]:
        counts: dict[str, int] = {}
        found: list[IsolationError] = []
        for b, (clause, error) in outcomes:
            name = b.contract.name
            counts[name] = counts.get(name, 0) + 1
            entry = self.verdicts[name]["clauses"][clause]  # every kind names its CLAUSES
            entry["checked"] += 1
            if error is not None:
                found.append(error)
                entry["violated"] += 1
                entry["first"] = entry["first"] or str(error)
        return counts, found

    def _arm(self) -> None:
        if self._hooks:
            return
        watched: dict[int, tuple[nn.Module, set[str]]] = {}
        for b in self.bound:
            for module, what in b.watch:
                watched.setdefault(id(module), (module, set()))[1].add(what)
        for key, (module, kinds) in watched.items():
            hook = self._hook(key, kinds)
            self._hooks.append(module.register_forward_hook(hook, with_kwargs=True))

    def _hook(self, key: int, what: set[str]) -> Any:
        recorded = self._recorded

        @recompute_safe
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if recomputing():  # an audit re-running a checkpointed segment, not the forward
                return
            if "inputs" in what:
                recorded.inputs.setdefault(key, []).extend(_tensors([args, kwargs]))
            if "outputs" in what:
                recorded.outputs.setdefault(key, []).extend(_tensors(output))
            if "training" in what:
                recorded.training.setdefault(key, []).append(module.training)

        return hook

    def _disarm(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._recorded.inputs.clear()
        self._recorded.outputs.clear()
        self._recorded.training.clear()
