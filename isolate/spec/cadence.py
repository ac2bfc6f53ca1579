"""What an applied spec checks, and when: on demand, and on the schedule of a training loop.

:class:`Cadence` is the schedule any loop shares (a plain loop, Fabric, the Lightning
callback): every ``every`` optimizer steps the named losses are checked before backward and
reach, params, drift, flags, optimizers and ranks after the step; a group thawed at a step must
be reached on that step, whatever ``every`` says; before a thaw no parameter of the spec may be
replaced; the ranks agree after every thaw. It holds the state of one step between the loop's
three calls (``begin``, ``before_backward``, ``end``).

Behind reentrant checkpoints the reach check after backward re-runs each segment as backward
did; backward freed the segments' arguments, so a step whose reach is checked keeps them from
``before_backward`` to its end (what the checkpoints held until backward: each segment's
inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from isolate._checkpointing import arguments_kept, keep_arguments
from isolate.errors import IsolationTypeError, SpecError
from isolate.spec._fields import string_list
from isolate.spec.ranks import world_size

__all__ = ["CHECKS", "Cadence", "Due", "Loop", "StepGuard"]

CHECKS = ("params", "losses", "reach", "drift", "flags", "optimizers", "ranks", "contracts")
"""What :meth:`~isolate.spec.handle.IsolationHandle.verify` can check."""


def many_ranks() -> tuple[str, ...]:
    """``("ranks",)`` under several processes: a check becomes a collective whose verdict
    every rank shares (a rank raising alone would leave the others waiting)."""
    return ("ranks",) if world_size() > 1 else ()


@dataclass(frozen=True)
class Due:
    """One verification the schedule asks for now: which checks, and how messages say when."""

    checks: tuple[str, ...]
    when: str
    total: tuple[torch.Tensor, ...] = ()
    kept: Mapping[Any, tuple[torch.Tensor, ...]] = field(default_factory=dict)


@dataclass
class Cadence:
    """The check schedule of a loop, and what the current step has seen.

    Attributes:
        every: check every ``every`` optimizer steps (step 0 included); ``0``: only the
            checks a thaw needs (reach on its first step, ranks after it).
        expected_unused: selectors of parameters allowed to go unreached on a step.
        on_violation: ``"raise"`` the first violation, or ``"warn"`` about each.
        losses_hint: what went missing and the fix, when ``protect`` names losses that a
            check step never received (``{step}`` is replaced by the step).
    """

    every: int = 0
    expected_unused: tuple[str, ...] = ()
    on_violation: Literal["raise", "warn"] = "raise"
    losses_hint: str = (
        "no named losses were given at step {step}; pass them to "
        "before_backward(loss, losses={{'name': loss_tensor}})"
    )
    checking: bool = False
    _reach: bool = False
    _step: int = 0
    _check_step: int = -1
    _losses_seen: bool = False
    _totals: list[torch.Tensor] = field(default_factory=list)
    _kept: dict[Any, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    _after_thaw: str | None = None

    @classmethod
    def checked(
        cls, every: object, expected_unused: object, on_violation: object, caller: str
    ) -> Cadence:
        """A cadence from user input (``expected_unused``: selectors, a lone string is one),
        or the error that names the option.

        Raises:
            SpecError: an option has the wrong type or value.
        """
        cadence = cls(
            every,  # type: ignore[arg-type]
            string_list(expected_unused, "expected_unused", caller),
            on_violation,  # type: ignore[arg-type]
        )
        cadence.validate(caller)
        return cadence

    def validate(self, caller: str) -> None:
        """Refuse a schedule that cannot work, naming the option."""
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise SpecError(
                f"{caller}: verify_every_n_steps must be an integer >= 0 (0 turns checks off), "
                f"got {every!r}"
            )
        if self.on_violation not in ("raise", "warn"):
            raise SpecError(
                f"{caller}: on_violation must be 'raise' or 'warn', got {self.on_violation!r}"
            )

    def begin(self, step: int, thawed: Sequence[str], *, epoch: int) -> None:
        """Arm the checks of optimizer step ``step``; ``thawed``: the groups thawed for it."""
        self.checking = bool(self.every) and step % self.every == 0
        if self.checking and self._check_step != step:
            self._check_step = step
            self._losses_seen = False
        self._step = step
        # A thawed group must be reached on its first step: check reach then, whatever every.
        self._reach = self.checking or bool(thawed)
        self._totals, self._kept = [], {}
        if thawed:
            self._after_thaw = f"after thawing {list(thawed)} (epoch {epoch}, step {step})"

    def before_backward(self, loss: torch.Tensor, losses: Mapping[str, torch.Tensor] | None) -> Due:
        """Keep ``loss`` for the reach check; the check of ``losses`` due now, if any."""
        if self._reach:
            self._totals.append(loss)  # the walk works after backward too, and re-runs
            self._kept.update(keep_arguments([loss]))  # reentrant segments from these
        if not self.checking or not losses:
            return Due((), "")
        self._losses_seen = True
        return Due(("losses", "contracts", *many_ranks()), f"at step {self._step}")

    def end(
        self, protect: Mapping[str, object] | None, caller: str, contracts: Collection[str] = ()
    ) -> Due:
        """The checks due at the end of the step (one verification, so that with ``ranks``
        every rank reaches one verdict on all of it); the step's state is cleared.

        Raises:
            SpecError: ``protect`` or the ``contracts`` name losses, but this check step
                received none.
        """
        if self.checking and (protect or contracts) and not self._losses_seen:
            what = "protect names" if protect else "the contracts read"
            raise SpecError(
                f"{caller}: {what} the losses {sorted({*(protect or ()), *contracts})}, but "
                + self.losses_hint.format(step=self._check_step)
            )
        checks: tuple[str, ...] = ()
        when = f"at step {self._step}"
        if self._reach and self._totals:
            checks = ("reach", *many_ranks())
        if self.checking:
            checks = (*checks, "params", "drift", "flags", "optimizers", "contracts", "ranks")
            when = f"at step {self._check_step}"
        elif self._after_thaw is not None:
            when = when if checks else self._after_thaw  # reach on the thaw's step says so
            checks = (*checks, "ranks")
        due = Due(tuple(dict.fromkeys(checks)), when, tuple(self._totals), self._kept)
        self._reach, self._totals, self._kept, self._after_thaw = False, [], {}, None
        self.checking = False
        return due


class _Handle(Protocol):
    """What a :class:`Loop` needs of the handle it drives."""

    plan: Any
    caller: str
    contracts: Any
    position: dict[str, int]

    def due(self, *, epoch: int, step: int) -> list[str]: ...

    def step(self, *, epoch: int, step: int, record: bool = True) -> list[str]: ...

    @property
    def verify(self) -> Callable[..., Any]:
        """:meth:`IsolationHandle.verify <isolate.spec.handle.IsolationHandle.verify>`, whose
        signature is stated there only (the Loop passes keywords)."""


class Loop:
    """A training loop's calls into a handle, with the checks its schedule says are due.

    Made by :meth:`IsolationHandle.check_every <isolate.spec.handle.IsolationHandle.check_every>`.
    Each step: :meth:`begin_step` before the forward, :meth:`before_backward` before each
    ``backward``, :meth:`end_step` after the optimizer step; :meth:`finish` at the end. The
    Lightning callback calls exactly these from its hooks; a plain or Fabric loop calls them
    itself.

    >>> import torch
    >>> from torch import nn
    >>> from isolate import IsolationSpec, Thaw
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> handle = IsolationSpec(freeze=["0"], thaw=[Thaw("0", step=1)]).apply(model, opt)
    >>> loop = handle.check_every(1)
    >>> for step in range(2):
    ...     thawed = loop.begin_step(epoch=0, step=step)
    ...     loss = model(torch.randn(4, 2)).sum()
    ...     loop.before_backward(loss)
    ...     loss.backward()
    ...     opt.step()
    ...     opt.zero_grad()
    ...     loop.end_step()
    >>> handle.thawed
    ('0',)
    """

    def __init__(self, handle: _Handle, cadence: Cadence) -> None:
        self.handle = handle
        self.cadence = cadence
        self._thawed_unarmed: list[str] = []  # thawed since the last armed step

    @property
    def checking(self) -> bool:
        """Whether the step begun last is a check step."""
        return self.cadence.checking

    def begin_step(self, *, epoch: int, step: int, arm: bool = True) -> list[str]:
        """Start a training step: check params, drift and ranks before a thaw, thaw the groups due
        (:meth:`~isolate.spec.handle.IsolationHandle.step`), and arm this step's checks
        (``arm=False`` at an epoch's start, before its first step). Returns the groups
        thawed."""
        due = self.handle.due(epoch=epoch, step=step)
        if due:
            before = f"before thawing {due} (epoch {epoch}, step {step})"
            self._verify(("params", "drift", "ranks"), before)
        every = self.cadence.every
        checking = arm and bool(every) and step % every == 0
        thawed = self.handle.step(epoch=epoch, step=step, record=checking)
        if self.handle.contracts.pending:  # windows closed over the step before: report them
            self._verify(("contracts",), f"after step {step - 1}")
        self._thawed_unarmed += thawed
        if arm:
            self.cadence.begin(step, self._thawed_unarmed, epoch=epoch)
            self._thawed_unarmed = []
        return thawed

    def before_backward(
        self, loss: torch.Tensor, losses: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Before ``loss.backward()``: keep ``loss`` for the reach check, and check the named
        ``losses`` (graphs alive) on a check step.

        Raises:
            IsolationTypeError: ``loss`` is not a tensor, or ``losses`` is not a mapping of
                loss name -> loss tensor (a lone tensor would be read for its truth: a loss of
                0 skipped, a vector an error inside torch).
        """
        where = f"{self.handle.caller}: loop.before_backward(loss, losses)"
        if not isinstance(loss, torch.Tensor):
            raise IsolationTypeError(
                f"{where}: loss must be the loss tensor about to be backpropagated, got "
                f"{type(loss).__name__}"
            )
        if losses is not None and not (
            isinstance(losses, Mapping)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in losses.items())
        ):
            raise IsolationTypeError(
                f"{where}: losses must be a mapping of loss name -> loss tensor, got "
                f"{type(losses).__name__}; pass {{'name': loss_tensor, ...}}"
            )
        due = self.cadence.before_backward(loss, losses)
        if due.checks:
            self._verify(due.checks, due.when, losses=losses)

    def end_step(self) -> None:
        """After the optimizer step: the checks due now (reach, params, drift, flags,
        optimizers, contracts, ranks on a check step; reach on a thaw's first step; ranks after
        a thaw)."""
        due = self.cadence.end(
            self.handle.plan.spec.protect, self.handle.caller, self.handle.contracts.losses
        )
        if due.checks:
            with arguments_kept(due.kept):
                self._verify(due.checks, due.when, total=list(due.total) or None)

    def finish(self) -> None:
        """A last check of params, drift, contracts and ranks, at the end of training."""
        self.handle.contracts.finish(self.handle.position["global_step"] + 1)
        self._verify(("params", "drift", "contracts", "ranks"), "at the end of training")

    def _verify(
        self,
        checks: tuple[str, ...],
        when: str,
        *,
        losses: Mapping[str, torch.Tensor] | None = None,
        total: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.handle.verify(
            losses,
            total=total,
            expected_unused=self.cadence.expected_unused,
            checks=checks,
            on_violation=self.cadence.on_violation,
            when=when,
        )


class StepGuard:
    """Refuses an ``optimizer.step()`` while thaws are pending and the schedule was never
    driven (``handle.step()`` never ran): they would never thaw.

    Reads the spec's thaw steps and the handle's record of applied groups (a dict the handle
    updates in place); the handle sets :attr:`stepped` at its first step.
    """

    def __init__(self, caller: str, thaws: Sequence[Any], applied: Mapping[str, Any]) -> None:
        self.caller, self.thaws, self.applied = caller, thaws, applied
        self.stepped = False
        self._hooks: dict[int, RemovableHandle] = {}  # id(optimizer) -> its step pre-hook

    def watch(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Guard every step of ``optimizers`` (each once)."""
        for opt in optimizers:
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(self._check)

    def remove(self) -> None:
        """Take every guard off."""
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()

    def _check(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if self.stepped:
            return
        pending = [str(t.name) for t in self.thaws if t.name not in self.applied]
        if pending:
            raise SpecError(
                f"{self.caller}: {type(optimizer).__name__}.step() with thaw groups "
                f"{pending} pending, but handle.step() was never called, so they would never "
                f"thaw; call handle.step(epoch=..., step=...) at the start of every training "
                f"step, before the forward"
            )
