"""The thaw groups of an applied spec: which are thawed, since when, and how to undo each.

A thaw flips its group's flags through a :class:`~isolate.freezing.FreezeHandle` built from
the plan's resolved parameters (no selector is resolved again) and joins the group to its
optimizer through the :class:`~isolate.spec.optimizers.OptimizerLink`, by identity, once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from isolate._compiled import forget_compiled
from isolate._sharding import settle
from isolate._text import shown
from isolate.errors import CheckpointMismatchError, SpecError
from isolate.freezing import FreezeHandle
from isolate.spec.clock import Phases
from isolate.spec.identity import require_held
from isolate.spec.optimizers import OptimizerLink
from isolate.spec.plan import Plan
from isolate.spec.thaw import check_lr

__all__ = ["Thaws"]


class Thaws:
    """What the schedule has thawed, in order, with the epoch and step of each thaw."""

    def __init__(self, plan: Plan, link: OptimizerLink, caller: str) -> None:
        self.plan = plan
        self.link = link
        self.caller = caller
        self.applied: dict[str, dict[str, int]] = {}  # group -> {"epoch", "global_step"}
        self.phases = Phases(plan.spec.thaw)
        self._handles: dict[str, FreezeHandle] = {}

    def thaw(
        self,
        name: str,
        optimizer: object,
        lr: float | None,
        position: Mapping[str, int],
        *,
        resumed: bool = False,
    ) -> dict[str, Any] | None:
        """Flip group ``name`` and join it to its optimizer; undone whole if joining fails.
        ``resumed``: a group a saved state had thawed, before any optimizer is attached (it
        joins the optimizers when they are).

        Raises:
            SpecError: no such group, it is thawed already, ``lr`` is not a finite number
                > 0, or no optimizer is attached (the parameters would get gradients and never
                move). Nothing has changed then.
            ReplacedParameterError: a parameter the spec applies to was replaced since it was
                applied: the thaw would flip the old object, and the group would never train.
        """
        where = f"{self.caller}.thaw({name!r})"
        check_lr(lr, where)
        g = self.plan.group(name)  # an unknown name is named before anything else
        if not self.link.optimizers and not resumed:
            raise SpecError(
                f"{where}: no optimizer is attached, so the thawed parameters would require "
                f"grad and get gradients but never move; call handle.attach(optimizer, "
                f"schedulers) once after apply (or apply(model, optimizer)), before training"
            )
        if name in self.applied:
            raise SpecError(
                f"{self.caller}: thaw group {name!r} was thawed already (at "
                f"{self.applied[name]}); a group is thawed once: check handle.thawed before "
                f"thawing, or give the other parameters a thaw step of their own"
            )
        frozen, opts = self.frozen_parameters(), self.link.optimizers
        require_held(self.plan, frozen, opts, f"before thawing {name!r}", self.caller)
        settle(self.plan.model)  # FSDP2: a flag set on an unsharded temporary is lost
        self._handles[name] = FreezeHandle(
            self.plan.model,
            f"{self.caller}(thaw {name!r})",
            g.params,
            dict(g.norms),
            True,
            g.thaw.bn,
        )
        # Dynamo's guards may not see the flags (a guard filter that skips nn modules): a
        # region compiled before the thaw would run on with no gradient for the group.
        forget_compiled()
        self.applied[name] = dict(position)
        try:
            return self.link.join(g, optimizer, lr, self.applied[name])
        except BaseException:
            self.unthaw(name)
            raise

    def unthaw(self, name: str) -> None:
        """Take back one thaw (a thaw, or a load, that could not complete)."""
        self._handles.pop(name).restore()
        del self.applied[name]
        self.link.unjoin(name)

    def due(self, *, epoch: int, step: int) -> list[str]:
        """The groups not yet thawed that are due: by epoch first, then by step, then the
        ``monitor`` thaws whose metric stopped improving, each in schedule order."""
        pending = [t for t in self.plan.spec.thaw if t.name not in self.applied]
        now = [t for t in pending if t.due(epoch=epoch, step=step)]
        by_epoch = [t for t in now if t.epoch is not None]
        by_step = [t for t in now if t.epoch is None]
        due = [str(t.name) for t in [*by_epoch, *by_step]]
        due += [n for n in self.phases.due(list(self.applied)) if n not in due]
        return [n for n in due if self._spaced(n, epoch)]

    def _spaced(self, name: str, epoch: int) -> bool:
        """Whether ``after_previous`` lets group ``name`` thaw at ``epoch``."""
        order = [str(t.name) for t in self.plan.spec.thaw]
        gap = self.plan.spec.thaw[order.index(name)].after_previous
        if not gap or order.index(name) == 0:
            return True
        before = self.applied.get(order[order.index(name) - 1])
        return before is not None and epoch >= before["epoch"] + gap

    def thawed_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for g in self.applied for n, p in self.plan.group(g).params.items()}

    def frozen_parameters(self) -> dict[str, nn.Parameter]:
        thawed = {id(p) for n in self.applied for p in self.plan.group(n).params.values()}
        return {n: p for n, p in self.plan.frozen.items() if id(p) not in thawed}

    def frozen_norms(self) -> dict[str, nn.Module]:
        thawed = {id(m) for n in self.applied for m in self.plan.group(n).norms.values()}
        return {n: m for n, m in self.plan.norms.items() if id(m) not in thawed}

    def load(self, entries: list[dict[str, Any]], frozen: list[str]) -> None:
        """Thaw the saved ``entries`` at their saved positions; check that what stays frozen
        is what the save says. On any error, the thaws of this call are undone."""
        done: list[str] = []
        try:
            for entry in entries:
                if entry["name"] in self.applied:
                    continue
                at = {"epoch": entry["epoch"], "global_step": entry["global_step"]}
                self.thaw(entry["name"], None, None, at, resumed=True)
                done.append(entry["name"])
            now = list(self.frozen_parameters())
            if now != frozen:
                raise CheckpointMismatchError(
                    f"{self.caller}: the checkpoint lists {shown(frozen)} as frozen, but its "
                    f"schedule leaves {shown(now)} frozen; it is inconsistent"
                )
        except BaseException:
            for name in reversed(done):
                self.unthaw(name)
            raise

    def check_restore(self, then: FreezeHandle | None) -> None:
        """Raise what :meth:`restore`, then restoring ``then``, would raise; change nothing."""
        order = [h for h in reversed(self._handles.values()) if h.active]
        order += [then] if then is not None and then.active else []
        for i, handle in enumerate(order):
            handle.check_restore(first=order[:i])

    def restore(self) -> None:
        """Freeze every thawed group again, newest first (flags and modes as recorded)."""
        for handle in reversed(list(self._handles.values())):
            if handle.active:
                handle.restore()
        self._handles.clear()
