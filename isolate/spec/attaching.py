"""What ties an applied spec to the run around it: the optimizers it is attached to, and the
saved state a checkpoint carries to resume it.

:class:`Attachment` is the resuming room of :class:`~isolate.spec.handle.IsolationHandle`: the
two meet in the order thawed groups join the optimizers. Groups a loaded state thawed join the
optimizers attached later at once, in their saved order; groups thawed after attaching join as
they thaw; the saved state records the optimizers' layout by parameter name. The handle checks
it is active, then delegates here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from isolate._text import shown
from isolate.errors import CheckpointMismatchError
from isolate.spec.cadence import StepGuard
from isolate.spec.identity import require_held
from isolate.spec.lr_schedulers import as_schedulers
from isolate.spec.optimizers import OptimizerLink, Optimizers, as_optimizers
from isolate.spec.plan import Plan
from isolate.spec.state import check_state, saved_state
from isolate.spec.thawing import Thaws
from isolate.spec.verifier import Verifier

__all__ = ["Attachment"]


class Attachment:
    """The optimizers and the saved state of one applied spec, over the parts its handle holds."""

    def __init__(
        self,
        plan: Plan,
        thaws: Thaws,
        link: OptimizerLink,
        verifier: Verifier,
        step_guard: StepGuard,
        *,
        caller: str,
    ) -> None:
        self.plan, self.thaws, self.link = plan, thaws, link
        self.verifier, self.step_guard, self.caller = verifier, step_guard, caller

    def attach(
        self, optimizers: Optimizers, schedulers: Sequence[Any], *, built_before_apply: bool
    ) -> None:
        """Take frozen parameters out of ``optimizers`` and plan where thawed groups go (see
        :meth:`IsolationHandle.attach <isolate.spec.handle.IsolationHandle.attach>`)."""
        opts = as_optimizers(optimizers, f"{self.caller}.attach()")
        scheds = as_schedulers(schedulers, f"{self.caller}.attach()")
        self.plan.check_norms_present(self.caller)
        require_held(self.plan, self.thaws.frozen_parameters(), opts, "at attach", self.caller)
        self.link.attach(
            self.plan,
            opts,
            scheds,
            dict(self.thaws.applied),
            self.thaws.frozen_parameters(),
            warn=not built_before_apply,
        )
        self.step_guard.watch(self.link.optimizers)
        self.verifier.watch()

    def state_dict(self) -> dict[str, Any]:
        """Where the spec stands, by parameter name, in plain types."""
        return saved_state(
            self.plan,
            tuple(self.thaws.frozen_parameters()),
            self.thaws.applied,
            self.thaws.phases.state_dict(),
            self.link.optimizers,
            self.caller,
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Thaw what the saved state had thawed; on failure the thaw clock is put back."""
        entries = check_state(self.plan.record(), state, self.plan.group_names, self.caller)
        saved = {entry["name"] for entry in entries}
        ahead = [name for name in self.thaws.applied if name not in saved]
        if ahead:
            raise CheckpointMismatchError(
                f"{self.caller}: this handle has thawed {shown(ahead)}, which the state had "
                f"not thawed (it was saved earlier in the run); load_state_dict thaws what the "
                f"state thawed and freezes nothing again. Load it into a handle that has not "
                f"thawed more: apply the spec to the model and optimizer the checkpoint is "
                f"loaded into, then call load_state_dict before training"
            )
        phases = self.thaws.phases.state_dict()
        self.thaws.phases.load_state_dict(state.get("phases"), self.caller)
        try:
            self.thaws.load(entries, list(state["frozen"]))
        except BaseException:
            self.thaws.phases.load_state_dict(phases, self.caller)
            raise
        self.verifier.renew()
