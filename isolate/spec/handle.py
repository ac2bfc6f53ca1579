"""The handle of an applied spec: thaw, step, verify, save, and undo exactly.

:meth:`IsolationSpec.apply <isolate.spec.IsolationSpec.apply>` returns an
:class:`IsolationHandle`. A plain PyTorch loop, a Lightning Fabric loop and the Lightning
callback all drive the same handle; the engine itself imports neither Lightning nor Fabric.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from isolate._sharding import settle
from isolate._text import warn_user
from isolate.errors import (
    SpecError,
)
from isolate.freezing import FreezeHandle
from isolate.spec.attaching import Attachment
from isolate.spec.branches import Branches
from isolate.spec.cadence import CHECKS, Cadence, Loop, StepGuard
from isolate.spec.checks import Tally, Verification
from isolate.spec.clock import require_forward
from isolate.spec.contract_checks import ContractWatch
from isolate.spec.optimizers import OptimizerLink, Optimizers
from isolate.spec.plan import Plan
from isolate.spec.thawing import Thaws
from isolate.spec.verifier import Verifier

__all__ = ["IsolationHandle", "Tally", "warn_user"]


class IsolationHandle:
    """An applied :class:`~isolate.spec.IsolationSpec`: the model is frozen and wrapped as the
    spec says until :meth:`restore`.

    Made by :meth:`IsolationSpec.apply <isolate.spec.IsolationSpec.apply>`. In a training loop,
    call :meth:`step` at the start of every training step (it runs the thaw schedule) and
    :meth:`verify` with the step's named losses whenever you want proof.

    Note:
        A model wrapped in ``DistributedDataParallel`` after ``apply`` syncs only the
        parameters that required grad when DDP was built: after a thaw, wrap it again (the
        Lightning callback does). ``restore`` puts parameters back into the optimizer groups
        they came from and removes the groups thawing added; optimizer state of thawed
        parameters stays in ``optimizer.state``.

    >>> from isolate.spec import IsolationSpec, Thaw
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> spec = IsolationSpec(freeze=["0"], thaw=[Thaw("0", epoch=1)])
    >>> handle = spec.apply(model, optimizer=opt)
    >>> handle.frozen, [len(g["params"]) for g in opt.param_groups]
    (('0.weight', '0.bias'), [2])
    >>> handle.step(epoch=1, step=10)
    ['0']
    >>> model[0].weight.requires_grad, [len(g["params"]) for g in opt.param_groups]
    (True, [2, 2])
    >>> handle.restore()
    >>> [len(g["params"]) for g in opt.param_groups]
    [4]
    """

    def __init__(
        self,
        plan: Plan,
        *,
        caller: str = "IsolationHandle",
        warn: Callable[[str], None] = warn_user,
    ) -> None:
        self.plan = plan
        self.caller = caller
        self._freeze: FreezeHandle | None = None
        self._branches = Branches()
        self.position = {"epoch": 0, "global_step": 0}  # updated in place: the link reads it
        self._link = OptimizerLink(caller, warn, self.position)
        self._thaws = Thaws(plan, self._link, caller)
        self._active = self._started = False
        self.contracts = ContractWatch(plan.contracts, plan.model, caller)
        self._verifier = Verifier(
            plan,
            self._thaws,
            self._link,
            self._branches,
            self.contracts,
            self.position,
            caller=caller,
            warn=warn,
        )
        self.loop = Loop(self, Cadence())
        self._step_guard = StepGuard(self.caller, plan.spec.thaw, self._thaws.applied)
        self._attachment = Attachment(
            plan, self._thaws, self._link, self._verifier, self._step_guard, caller=caller
        )

    @property
    def tally(self) -> Tally:
        """What every :meth:`verify` that found nothing checked, added up."""
        return self._verifier.tally

    @property
    def drift(self) -> Literal["fingerprint", "copy"]:
        """How :meth:`verify` watches frozen tensors: ``"fingerprint"`` or ``"copy"``."""
        return self._verifier.drift

    @drift.setter
    def drift(self, drift: Literal["fingerprint", "copy"]) -> None:
        self._verifier.drift = drift

    def start(self) -> None:
        """Freeze, hold and wrap as the plan says (undone by :meth:`restore`).

        Raises:
            SpecError: the handle is active already (a second freeze would record the
                frozen flags as the ones to restore).
        """
        if self._active:
            raise SpecError(f"{self.caller}.start(): the handle is active already; start once")
        plan = self.plan
        self._active = self._started = True
        try:
            if plan.frozen:
                self._freeze = FreezeHandle(
                    plan.model,
                    f"{self.caller}(freeze)",
                    plan.frozen,
                    dict(plan.norms),
                    False,
                    plan.spec.policy,
                )
            self._branches.wrap(plan.wraps)
            self._verifier.watch()
        except BaseException:
            self.restore()
            raise

    @property
    def active(self) -> bool:
        """Whether :meth:`restore` has yet to be called."""
        return self._active

    def restore(self, *, optimizers: bool = True) -> None:
        """Undo everything: thaws, wrappers, freezing, holds, and (with ``optimizers=True``)
        the optimizer surgery. Flags and modes go back to exactly what they were.

        Raises:
            RestoreError: a :func:`~isolate.freeze` made after :meth:`start` or after a thaw
                still holds parameters the spec froze or thawed (restore that first), or
                (with ``optimizers=True``) an attached optimizer lost param groups since
                :meth:`attach`; nothing was undone then.
        """
        self._thaws.check_restore(self._freeze)
        if optimizers:
            self._link.check_restore()
        settle(self.plan.model)
        self._step_guard.remove()
        self.contracts.restore()
        self._thaws.restore()
        self._branches.unwrap()
        if self._freeze is not None and self._freeze.active:
            self._freeze.restore()
        if optimizers:
            self._link.restore()
        else:
            self._link.release()
        self._verifier.stop()
        self._active = False

    def attach(
        self,
        optimizers: Optimizers,
        schedulers: Any = (),
        *,
        built_before_apply: bool = False,
    ) -> None:
        """Take frozen parameters out of ``optimizers`` and plan where thawed groups go.

        Groups already thawed (by :meth:`load_state_dict`) join as new param groups at once,
        in the order they were thawed, so an optimizer state saved with them loads.

        Frozen parameters found in an optimizer are taken out with an ``IsolationWarning``,
        unless ``built_before_apply``: the optimizers were built before the spec froze
        anything (as under Lightning's ``ModelParallelStrategy``) and cannot help holding them.

        ``optimizers`` and ``schedulers`` are each one object or a list of them. Attach once,
        with every optimizer and its schedulers (``apply(model, optimizer)``
        attaches). Attaching the same optimizers again only adds new schedulers; other
        optimizers are refused. While thaws are pending, an ``optimizer.step()`` before the
        first :meth:`step` raises: the schedule would never run.

        Raises:
            SpecError: as :meth:`IsolationSpec.apply`, held BatchNorm layers were replaced
                since (``sync_batchnorm``), which would drop the eval-mode hold, other
                optimizers are attached already, or (with thaw groups) a scheduler drives
                none of the optimizers (a config dict, ``None``, one built on another).
            IsolationTypeError: an optimizer is not one, or ``schedulers`` is neither a
                scheduler nor a list.
            ReplacedParameterError: a parameter the spec applies to was replaced since it was
                applied (a ``configure_model`` that builds layers again, a conversion).
        """
        self._require_active("attach")
        self._attachment.attach(optimizers, schedulers, built_before_apply=built_before_apply)

    def thaw(
        self, name: str, optimizer: object = None, lr: float | None = None
    ) -> dict[str, Any] | None:
        """Thaw group ``name`` now: its parameters require grad again and join their optimizer
        as one new param group (by identity, exactly once).

        Args:
            name: the thaw group (``Thaw.name``).
            optimizer: which attached optimizer receives the group (an index or the optimizer);
                by default the one the spec planned.
            lr: the group's learning rate, overriding the ``Thaw``'s.

        Returns:
            The new param group.

        Raises:
            SpecError: no such group, it is thawed already (a thaw is applied once; to thaw
                more parameters, give them a thaw step of their own), ``lr`` is not a finite
                number > 0, or no optimizer is attached (the parameters would get gradients
                and never move). Nothing has changed then.
            ReplacedParameterError: a parameter the spec applies to was replaced since it was
                applied: the thaw would flip the old object, and the group would never train.
        """
        self._require_active("thaw")
        group = self._thaws.thaw(name, optimizer, lr, self.position)
        self._verifier.renew()
        return group

    def step(self, *, epoch: int, step: int, record: bool = True) -> list[str]:
        """Start a training step: thaw the groups now due, and reset what branches recorded.

        Args:
            epoch: the current epoch, from 0.
            step: the number of optimizer steps taken so far.
            record: whether ``detach`` branches record their inputs this step, for the
                reachability check of :meth:`verify` (holding them costs their memory until the
                next step), and whether the contracts check this step: they open their windows
                (copies for an EMA) and record the modules they name.

        Returns:
            The names of the groups thawed by this call, in schedule order.

        Raises:
            SpecError: ``epoch`` or ``step`` is negative or lower than at the last call (a
                thaw is never undone: a count that goes back, such as the batch's index in
                its epoch, would thaw at the wrong time); nothing changes.
        """
        self._require_active("step")
        epoch, step = int(epoch), int(step)
        require_forward(self.position, epoch, step, self.caller)
        self._step_guard.stepped = True
        self.position.update(epoch=epoch, global_step=step)
        self.contracts.begin(step, record=record)
        self._branches.reset(record=record)
        due = self.due(epoch=epoch, step=step)
        for name in due:
            self.thaw(name)
        return due

    def due(self, *, epoch: int, step: int) -> list[str]:
        """The groups not yet thawed that are due at ``epoch`` after ``step`` optimizer steps:
        those due by epoch first, then those due by step, each in schedule order."""
        return self._thaws.due(epoch=epoch, step=step)

    def observe(self, metrics: Mapping[str, Any]) -> list[str]:
        """Take the metrics of a validation run: the ``monitor`` thaw watching now counts a
        check, and becomes due (thawed by the next :meth:`step`) once its metric stops
        improving (``patience``, ``min_delta``, ``mode``, as Lightning's ``EarlyStopping``).

        Returns:
            The groups that became due.

        Raises:
            SpecError: the watched metric is not in ``metrics``.
        """
        self._require_active("observe")
        return self._thaws.phases.observe(metrics, list(self._thaws.applied), self.caller)

    def verify(
        self,
        losses: Mapping[str, torch.Tensor] | None = None,
        *,
        total: torch.Tensor | Sequence[torch.Tensor] | None = None,
        expected_unused: Sequence[str] = (),
        checks: Collection[str] = CHECKS,
        on_violation: Literal["raise", "warn"] = "raise",
        when: str | None = None,
    ) -> Verification:
        """Prove the spec holds now: its parameters are the model's, reach of the named losses,
        drift, flags, optimizers, ranks, and the spec's contracts (:mod:`isolate.spec.contracts`).

        Args:
            losses: loss name -> loss tensor, graph alive. Each must reach no frozen parameter
                and none of ``protect[name]`` (without ``protect``: nothing upstream of a
                ``detach`` branch).
            total: the loss (or losses) the step backpropagates, graph alive: every trainable
                parameter must be reached by it, or match ``expected_unused`` (selectors).
            checks: which of :data:`~isolate.spec.cadence.CHECKS` to run. ``"ranks"`` is a
                collective with one verdict: a violation seen on one rank is raised on all.
            on_violation: ``"raise"`` the first violation, or ``"warn"`` about each.
            when: how messages say when (default: the position of the last :meth:`step`).

        Returns:
            A :class:`~isolate.spec.checks.Verification` saying what was checked.

        Raises:
            GradientLeakError, CutOffError, DriftError, RankDivergenceError, ContractError: a
                violation (a :class:`~isolate.errors.ContractError` names the contract, the
                clause and the tensors).
            ReplacedParameterError: (``"params"``) a parameter the spec applies to was
                replaced by a new object since it was applied (re-registered, converted,
                loaded with ``assign=True``); names each, with what changed.
            BlindSpotError: part of ``total``'s graph cannot be seen.
            SpecError: ``protect`` names a loss not in ``losses``, or a branch ran more often
                than recorded since the last :meth:`step`.
        """
        self._require_active("verify")
        return self._verifier.verify(
            losses,
            total=total,
            expected_unused=expected_unused,
            checks=checks,
            on_violation=on_violation,
            when=when,
        )

    def check_every(
        self,
        every: int,
        *,
        expected_unused: Sequence[str] = (),
        on_violation: Literal["raise", "warn"] = "raise",
        losses_hint: str | None = None,
    ) -> Loop:
        """Check on a schedule from now on: every ``every`` optimizer steps, and on the first
        step after a thaw. Returns the :class:`~isolate.spec.cadence.Loop` (also
        ``handle.loop``) whose ``begin_step`` / ``before_backward`` / ``end_step`` a training
        loop calls; see there.

        Raises:
            SpecError: ``every`` is not an integer >= 0, or ``on_violation`` is unknown.
        """
        cadence = Cadence(every, tuple(expected_unused), on_violation)
        if losses_hint is not None:
            cadence.losses_hint = losses_hint
        cadence.validate(self.caller)
        self.loop = Loop(self, cadence)
        return self.loop

    @property
    def frozen(self) -> tuple[str, ...]:
        """The names of the parameters frozen now, in model order."""
        return tuple(self.frozen_parameters())

    @property
    def thawed(self) -> tuple[str, ...]:
        """The thaw groups applied so far, in the order they were thawed."""
        return tuple(self._thaws.applied)

    @property
    def watching(self) -> str | None:
        """The ``monitor`` thaw group waiting now for its metric to stop improving, if any."""
        return self._thaws.phases.watching(list(self._thaws.applied))

    def expectations(self, model: nn.Module | None = None) -> dict[str, str]:
        """Parameter key -> what the spec expects of it now (``"still"``, ``"still until
        epoch 2"``, ``"EMA of <online>"``, ``"moves"``): the ``expects`` column of
        :func:`isolate.ledger.ledger` when the handle is given as ``spec=``."""
        return self.plan.expectations(self.frozen_parameters(), self.thawed)

    def frozen_parameters(self) -> dict[str, nn.Parameter]:
        """Name -> parameter of every parameter frozen now."""
        return self._thaws.frozen_parameters()

    def frozen_norms(self) -> dict[str, nn.Module]:
        """Name -> BatchNorm layer held now."""
        return self._thaws.frozen_norms()

    def state_dict(self) -> dict[str, Any]:
        """Where the spec stands, by parameter name, in plain types (``weights_only`` loads it)."""
        return self._attachment.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Thaw what the saved state had thawed, without freezing anything again.

        Call it right after ``apply`` (before loading an optimizer's state: thawed groups join
        the attached optimizers here, in the saved order).

        Raises:
            CheckpointMismatchError: the state was written under another spec, is malformed
                or inconsistent, or was saved before a thaw this handle has made; the handle is
                left as it was.
        """
        self._require_active("load_state_dict")
        self._attachment.load_state_dict(state)

    def _require_active(self, what: str) -> None:
        if not self._active:
            why = "was restored; apply the spec again"
            if not self._started:
                why = "was never started; call start() first (spec.apply() does)"
            raise SpecError(f"{self.caller}.{what}(): the handle {why}")

    def __repr__(self) -> str:
        state = "active" if self._active else "restored"
        return (
            f"IsolationHandle({type(self.plan.model).__name__}: {len(self.frozen)} frozen, "
            f"{len(self.plan.wraps)} branches, thawed {list(self._thaws.applied)}, {state})"
        )
