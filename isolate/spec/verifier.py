"""What an applied spec's ``verify`` runs on: the handle's parts, the drift snapshot of what is
frozen now, and the tally of what clean checks verified.

:class:`Verifier` is the checking room of :class:`~isolate.spec.handle.IsolationHandle`: the
handle changes the model (freeze, thaw, attach, load) and tells the verifier when what is
frozen changed (:meth:`Verifier.renew`); the verifier runs
:func:`~isolate.spec.checks.run_checks` and decides, by ``on_violation``, whether a violation
raises or warns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal

import torch

from isolate.drift import Snapshot
from isolate.errors import SpecError
from isolate.spec.branches import Branches
from isolate.spec.cadence import CHECKS
from isolate.spec.checks import Tally, Verification, run_checks, watch
from isolate.spec.contract_checks import ContractWatch
from isolate.spec.optimizers import OptimizerLink
from isolate.spec.plan import Plan
from isolate.spec.thawing import Thaws

__all__ = ["Verifier"]


class Verifier:
    """The checks of one applied spec, over the parts its handle changes.

    Attributes:
        drift: how frozen tensors are watched: ``"fingerprint"`` or ``"copy"``.
        tally: what every verification that found nothing checked, added up.
    """

    def __init__(
        self,
        plan: Plan,
        thaws: Thaws,
        link: OptimizerLink,
        branches: Branches,
        contracts: ContractWatch,
        position: Mapping[str, int],
        *,
        caller: str,
        warn: Callable[[str], None],
    ) -> None:
        self.plan, self.thaws, self.link = plan, thaws, link
        self.branches, self.contracts, self.position = branches, contracts, position
        self.caller, self.warn = caller, warn
        self.drift: Literal["fingerprint", "copy"] = "fingerprint"
        self.tally = Tally()
        self.watched: Snapshot | None = None

    def watch(self) -> None:
        """Watch what is frozen now for drift (from its values now)."""
        self.watched = watch(
            self.plan,
            self.thaws.frozen_parameters(),
            self.thaws.frozen_norms(),
            drift=self.drift,
        )

    def renew(self) -> None:
        """What is frozen changed (a thaw, a load): watch it anew, if watching."""
        if self.watched is not None:
            self.watch()

    def stop(self) -> None:
        """Watch nothing any more (the handle was restored)."""
        self.watched = None

    def verify(
        self,
        losses: Mapping[str, torch.Tensor] | None,
        *,
        total: torch.Tensor | Sequence[torch.Tensor] | None,
        expected_unused: Sequence[str],
        checks: Collection[str],
        on_violation: Literal["raise", "warn"],
        when: str | None,
    ) -> Verification:
        """What :meth:`IsolationHandle.verify <isolate.spec.handle.IsolationHandle.verify>`
        does (see there)."""
        unknown = sorted(set(checks) - set(CHECKS))
        if unknown:
            raise SpecError(f"{self.caller}.verify(): unknown checks {unknown}; use {list(CHECKS)}")
        when = when or f"at epoch {self.position['epoch']}, step {self.position['global_step']}"
        verification, found, self.watched = run_checks(
            self.plan,
            self.thaws.frozen_parameters(),
            losses,
            (total, tuple(expected_unused)),
            self.branches,
            self.watched,
            self.link.optimizers,
            checks,
            when,
            self.caller,
            self.thaws.thawed_parameters(),
            self.contracts,
        )
        if found and on_violation == "raise":
            raise found[0]
        for error in found:
            self.warn(str(error))
        if not found:
            self.tally.add(verification, checks)
        return verification
