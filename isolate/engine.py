"""The handle of an applied spec: thaw, step, verify, save, and undo exactly.

:meth:`IsolationSpec.apply <isolate.spec.IsolationSpec.apply>` returns an
:class:`IsolationHandle`. A plain PyTorch loop, a Lightning Fabric loop and the Lightning
callback all drive the same handle; the engine itself imports neither Lightning nor Fabric.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from isolate._tree import iter_tensors
from isolate._wrapping import Wrapper
from isolate.checks import DriftWatch, Verification, check_flags, check_losses, check_optimizers
from isolate.cloning import Cloned
from isolate.detaching import Detached
from isolate.distributed import check_ranks, world_size
from isolate.errors import (
    CheckpointMismatchError,
    IsolationError,
    IsolationTypeError,
    IsolationWarning,
    SpecError,
)
from isolate.freezing import FreezeHandle
from isolate.optimizers import (
    Optimizers,
    Placement,
    add_group,
    as_optimizers,
    place,
    risk,
    take_out,
)
from isolate.plan import Group, Names, Plan, resolve, shown
from isolate.spec import IsolationSpec
from isolate.state import FORMAT, check_state, plain

__all__ = ["CHECKS", "IsolationHandle", "Optimizers"]

CHECKS = ("losses", "drift", "flags", "optimizers", "ranks")
"""What :meth:`IsolationHandle.verify` can check."""

_RECORD_LIMIT = 64  # calls of one detach branch recorded between two step() calls


def _warn(message: str) -> None:
    warnings.warn(message, IsolationWarning, stacklevel=4)


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

    >>> from isolate.spec import Thaw
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
        self, plan: Plan, *, caller: str = "IsolationHandle", warn: Callable[[str], None] = _warn
    ) -> None:
        self.plan = plan
        self._caller = caller
        self._warn = warn
        self._freeze: FreezeHandle | None = None
        self._thaws: dict[str, FreezeHandle] = {}
        self._thawed: dict[str, dict[str, int]] = {}  # group -> {"epoch", "global_step"}, in order
        self._wraps: list[tuple[nn.Module, str, nn.Module, Wrapper]] = []
        self._hooks: list[RemovableHandle] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []
        self._placements: dict[str, Placement] = {}
        self._added: dict[str, tuple[torch.optim.Optimizer, dict[str, Any]]] = {}
        self._groups_before: list[tuple[torch.optim.Optimizer, list[list[nn.Parameter]]]] = []
        self._watch: DriftWatch | None = None
        self._inputs: dict[str, list[torch.Tensor]] = {}
        self._overflow: set[str] = set()
        self.recording = True
        self.position = {"epoch": 0, "global_step": 0}
        self._active = False

    # ---------------------------------------------------------------- apply and restore

    @classmethod
    def apply(
        cls,
        spec: IsolationSpec,
        model: nn.Module,
        optimizer: Optimizers = None,
        *,
        caller: str = "IsolationSpec",
        warn: Callable[[str], None] = _warn,
    ) -> IsolationHandle:
        """Resolve ``spec`` on ``model``, check it whole, then change (``IsolationSpec.apply``)."""
        if not isinstance(spec, IsolationSpec):
            raise IsolationTypeError(f"{caller}: spec must be an IsolationSpec, got {type(spec)}")
        plan = resolve(spec, model, caller)
        optimizers = as_optimizers(optimizer, caller)
        if optimizers:
            place(plan, optimizers, set(), caller)  # only to refuse before anything changes
        handle = cls(plan, caller=caller, warn=warn)
        handle._apply()
        if optimizers:
            try:
                handle.attach(optimizers)
            except BaseException:
                handle.restore()
                raise
        return handle

    def _apply(self) -> None:
        plan = self.plan
        self._active = True
        try:
            if plan.frozen:
                self._freeze = FreezeHandle(
                    plan.model,
                    f"{self._caller}(freeze)",
                    plan.frozen,
                    dict(plan.norms),
                    False,
                    plan.spec.bn,
                )
            for w in plan.wraps:
                wrapper: Wrapper = (
                    Detached(w.child, name=w.name) if w.kind == "detach" else Cloned(w.child)
                )
                setattr(w.parent, w.leaf, wrapper)
                self._wraps.append((w.parent, w.leaf, w.child, wrapper))
                if isinstance(wrapper, Detached):
                    hook = wrapper.register_forward_pre_hook(
                        self._recorder(w.name), with_kwargs=True
                    )
                    self._hooks.append(hook)
        except BaseException:
            self.restore()
            raise

    def _recorder(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self.recording:
                return
            inputs = self._inputs.setdefault(name, [])
            if len(inputs) >= _RECORD_LIMIT:
                self._overflow.add(name)
                return
            inputs.extend(t for t in iter_tensors((args, kwargs)) if t.requires_grad)

        return record

    @property
    def active(self) -> bool:
        """Whether :meth:`restore` has yet to be called."""
        return self._active

    def restore(self, *, optimizers: bool = True) -> None:
        """Undo everything: thaws, wrappers, freezing, holds, and (with ``optimizers=True``)
        the optimizer surgery. Flags and modes go back to exactly what they were."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for handle in reversed(list(self._thaws.values())):
            if handle.active:
                handle.restore()
        self._thaws.clear()
        for parent, leaf, _, wrapper in reversed(self._wraps):
            if parent._modules.get(leaf) is wrapper:
                setattr(parent, leaf, wrapper.unwrap())
            else:
                wrapper.unwrap()
        self._wraps.clear()
        if self._freeze is not None and self._freeze.active:
            self._freeze.restore()
        if optimizers:
            for opt, groups in self._groups_before:
                del opt.param_groups[len(groups) :]
                for group, params in zip(opt.param_groups, groups, strict=True):
                    group["params"] = params
        self._groups_before.clear()
        self._inputs.clear()
        self._watch = None
        self._active = False

    # ---------------------------------------------------------------- optimizers

    def attach(self, optimizers: Optimizers, schedulers: Sequence[Any] = ()) -> None:
        """Take frozen parameters out of ``optimizers`` and plan where thawed groups go.

        Groups already thawed (by :meth:`load_state_dict`) join as new param groups at once,
        in the order they were thawed, so an optimizer state saved with them loads.

        Raises:
            SpecError: as :meth:`IsolationSpec.apply`, or held BatchNorm layers were replaced
                since (``sync_batchnorm``), which would drop the eval-mode hold.
        """
        self._require_active("attach")
        opts = as_optimizers(optimizers, f"{self._caller}.attach()")
        self._check_norms_present()
        held, placements = place(self.plan, opts, set(self._thawed), self._caller)
        self._groups_before = [(o, [list(g["params"]) for g in o.param_groups]) for o in opts]
        self._optimizers, self._schedulers = opts, list(schedulers)
        self._placements = placements
        frozen_ids = {id(p) for p in self.frozen_parameters().values()}
        exposed = [s for s in held if id(s.param) in frozen_ids]
        take_out(opts, held)
        if exposed:
            self._warn_removed(exposed)
        for name in self._thawed:
            self._join(self.plan.group(name), None, None)
        self._watch = self._new_watch()

    def _warn_removed(self, exposed: Sequence[Any]) -> None:
        by_group: dict[tuple[int, int], list[str]] = {}
        for s in exposed:
            by_group.setdefault((s.opt, s.group), []).append(self.plan.names.name(s.param))
        lines = [
            f"  optimizer {oi}, param group {gi} "
            f"({risk(self._optimizers[oi].param_groups[gi])}): {shown(names)}"
            for (oi, gi), names in by_group.items()
        ]
        self._warn(
            f"{self._caller}: took {len(exposed)} frozen parameters out of the optimizers, where "
            f"a zero gradient with weight decay or momentum could move them; a thaw step adds "
            f"them back as a new param group:\n"
            + "\n".join(lines)
            + "\nTo silence this, build the optimizer from trainable parameters only."
        )

    def _check_norms_present(self) -> None:
        if self.plan.spec.bn != "eval":
            return
        present = {id(m) for m in self.plan.model.modules()}
        gone = [n for n, m in self.plan.norms.items() if id(m) not in present]
        if gone:
            raise SpecError(
                f"{self._caller}: {len(gone)} frozen BatchNorm layers were replaced after the "
                f"spec was applied (sync_batchnorm, or a configure_model hook), so bn='eval' no "
                f"longer holds them: {shown(gone)}. Build the layers first, or use bn='train'"
            )

    def _join(self, g: Group, optimizer: object, lr: float | None) -> dict[str, Any] | None:
        if not self._optimizers:
            return None
        index = self._placements[g.name].optimizer_idx
        if optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)
            found = [i for i, o in enumerate(self._optimizers) if o is inner]
            index = optimizer if isinstance(optimizer, int) else (found[0] if found else -1)
            if not 0 <= index < len(self._optimizers):
                raise SpecError(
                    f"{self._caller}: thaw({g.name!r}, optimizer={optimizer!r}): not one of the "
                    f"{len(self._optimizers)} attached optimizers (an index or the object)"
                )
        options = dict(self._placements[g.name].options)
        if lr is not None:
            options["lr"] = float(lr)
        opt = self._optimizers[index]
        group = add_group(opt, list(g.params.values()), options, self._schedulers)
        self._added[g.name] = (opt, group)
        return group

    def _unthaw(self, name: str) -> None:
        """Take back a thaw that could not complete (restore's counterpart for one group)."""
        self._thaws.pop(name).restore()
        del self._thawed[name]
        added = self._added.pop(name, None)
        if added is not None:
            opt, group = added
            opt.param_groups[:] = [g for g in opt.param_groups if g is not group]

    # ---------------------------------------------------------------- the schedule

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
            The new param group, or ``None`` when no optimizer is attached.

        Raises:
            SpecError: no such group, or it is thawed already (a thaw is applied once; to
                thaw more parameters, give them a thaw step of their own).
        """
        self._require_active("thaw")
        g = self.plan.group(name)
        if name in self._thawed:
            raise SpecError(
                f"{self._caller}: thaw group {name!r} was thawed already (at "
                f"{self._thawed[name]}); a group is thawed once: check handle.thawed before "
                f"thawing, or give the other parameters a thaw step of their own"
            )
        self._thaws[name] = FreezeHandle(
            self.plan.model,
            f"{self._caller}(thaw {name!r})",
            g.params,
            dict(g.norms),
            True,
            g.thaw.bn,
        )
        self._thawed[name] = dict(self.position)
        try:
            group = self._join(g, optimizer, lr)
        except BaseException:
            self._unthaw(name)
            raise
        self._watch = self._new_watch() if self._watch is not None else None
        return group

    def step(self, *, epoch: int, step: int, record: bool = True) -> list[str]:
        """Start a training step: thaw the groups now due, and reset what branches recorded.

        Args:
            epoch: the current epoch, from 0.
            step: the number of optimizer steps taken so far.
            record: whether ``detach`` branches record their inputs this step, for the
                reachability check of :meth:`verify` (holding them costs their memory until the
                next step).

        Returns:
            The names of the groups thawed by this call, in schedule order.
        """
        self._require_active("step")
        self.position = {"epoch": int(epoch), "global_step": int(step)}
        self._inputs.clear()
        self._overflow.clear()
        self.recording = record
        due = self.due(epoch=epoch, step=step)
        for name in due:
            self.thaw(name)
        return due

    def due(self, *, epoch: int, step: int) -> list[str]:
        """The groups not yet thawed that are due at ``epoch`` after ``step`` optimizer steps:
        those due by epoch first, then those due by step, each in schedule order."""
        pending = [t for t in self.plan.spec.thaw if t.name not in self._thawed]
        by_epoch = [t for t in pending if t.epoch is not None and epoch >= t.epoch]
        by_step = [t for t in pending if t.step is not None and step >= t.step]
        return [str(t.name) for t in [*by_epoch, *by_step]]

    # ---------------------------------------------------------------- checks

    def verify(
        self,
        losses: Mapping[str, torch.Tensor] | None = None,
        *,
        checks: Collection[str] = CHECKS,
        on_violation: Literal["raise", "warn"] = "raise",
        when: str | None = None,
    ) -> Verification:
        """Prove the spec holds now: reach of the named losses, drift, flags, optimizers, ranks.

        Args:
            losses: loss name -> loss tensor, with its graph alive (before ``backward``). Each
                must reach no frozen parameter, and none of ``protect[name]`` (without
                ``protect``: nothing upstream of a ``detach`` branch).
            checks: which of :data:`CHECKS` to run (``"ranks"`` is a collective: every rank
                must call it).
            on_violation: ``"raise"`` the first violation, or ``"warn"`` about each.
            when: how messages say when this was (default: the epoch and step of the last
                :meth:`step`).

        Returns:
            A :class:`~isolate.checks.Verification` saying what was checked.

        Raises:
            GradientLeakError, DriftError, RankDivergenceError: a violation.
            SpecError: ``protect`` names a loss that is not in ``losses``, or a branch ran more
                often than recorded since the last :meth:`step`.
        """
        self._require_active("verify")
        unknown = sorted(set(checks) - set(CHECKS))
        if unknown:
            raise SpecError(
                f"{self._caller}.verify(): unknown checks {unknown}; use {list(CHECKS)}"
            )
        when = when or f"at epoch {self.position['epoch']}, step {self.position['global_step']}"
        frozen = self.frozen_parameters()
        found: list[IsolationError] = []
        counts: dict[str, int] = {}
        if "losses" in checks and losses is not None:
            counts, leaks = check_losses(
                self.plan, frozen, self._checked_losses(losses), self._inputs, when, self._caller
            )
            found += leaks
        drift = 0
        if "drift" in checks and self._watch is not None:
            drift = len(self._watch)
            found += self._watch.check(self.plan.model, when, self._caller)
            if found:
                self._watch = self._new_watch()  # with "warn", report each move once
        if "flags" in checks:
            found += check_flags(frozen, when, self._caller)
        if "optimizers" in checks:
            found += check_optimizers(frozen, self._optimizers, when, self._caller)
        ranks = world_size()
        if "ranks" in checks and ranks > 1:
            found += check_ranks(Names.of(self.plan.model).params, when, self._caller)
        if found and on_violation == "raise":
            raise found[0]
        for error in found:
            self._warn(str(error))
        return Verification(
            losses=counts,
            drift=drift,
            flags=len(frozen) if "flags" in checks else 0,
            optimizers=len(self._optimizers) if "optimizers" in checks else 0,
            ranks=ranks,
            violations=tuple(str(e) for e in found),
        )

    def _checked_losses(self, losses: object) -> Mapping[str, torch.Tensor]:
        if not isinstance(losses, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in losses.items()
        ):
            raise IsolationTypeError(
                f"{self._caller}.verify(): losses must be a dict of loss name -> loss tensor, "
                f"got {losses!r}"
            )
        if self.plan.protect is not None:
            missing = sorted(set(self.plan.protect) - set(losses))
            if missing:
                raise SpecError(
                    f"{self._caller}: protect names the losses {missing}, but verify() got "
                    f"{sorted(losses)}; pass every loss that protect names"
                )
        if self._overflow:
            raise SpecError(
                f"{self._caller}: the detach branches {sorted(self._overflow)} ran more than "
                f"{_RECORD_LIMIT} times since the last step(), so their inputs were not all "
                f"recorded and the check cannot see what is upstream of them; call "
                f"handle.step(epoch=..., step=...) at the start of every training step"
            )
        return losses

    def _new_watch(self) -> DriftWatch:
        norms = self.frozen_norms()
        buffers = (
            [
                self.plan.names.of_id[id(b)]
                for m in norms.values()
                for b in m.buffers(recurse=False)
                if id(b) in self.plan.names.of_id
            ]
            if self.plan.spec.bn == "eval"
            else []
        )
        return DriftWatch(self.plan.model, list(self.frozen_parameters()), buffers)

    # ---------------------------------------------------------------- state

    @property
    def frozen(self) -> tuple[str, ...]:
        """The names of the parameters frozen now, in model order."""
        return tuple(self.frozen_parameters())

    @property
    def thawed(self) -> tuple[str, ...]:
        """The thaw groups applied so far, in the order they were thawed."""
        return tuple(self._thawed)

    def frozen_parameters(self) -> dict[str, nn.Parameter]:
        """Name -> parameter of every parameter frozen now."""
        thawed = {id(p) for n in self._thawed for p in self.plan.group(n).params.values()}
        return {n: p for n, p in self.plan.frozen.items() if id(p) not in thawed}

    def frozen_norms(self) -> dict[str, nn.Module]:
        """Name -> BatchNorm layer held now."""
        thawed = {id(m) for n in self._thawed for m in self.plan.group(n).norms.values()}
        return {n: m for n, m in self.plan.norms.items() if id(m) not in thawed}

    def state_dict(self) -> dict[str, Any]:
        """Where the spec stands, by parameter name, in plain types (``weights_only`` loads it)."""
        state: dict[str, Any] = plain(
            {
                "format": FORMAT,
                "spec": self.plan.record(),
                "frozen": list(self.frozen),
                "thawed": [{"name": n, **at} for n, at in self._thawed.items()],
            },
            self._caller,
        )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Thaw what the saved state had thawed, without freezing anything again.

        Call it right after ``apply`` (before loading an optimizer's state: thawed groups join
        the attached optimizers here, in the saved order).

        Raises:
            CheckpointMismatchError: the state was written under another spec, or is
                malformed or inconsistent; the handle is left as it was.
        """
        self._require_active("load_state_dict")
        entries = check_state(self.plan.record(), state, self.plan.group_names, self._caller)
        done: list[str] = []
        try:
            for entry in entries:
                if entry["name"] in self._thawed:
                    continue
                self.position = {"epoch": entry["epoch"], "global_step": entry["global_step"]}
                self.thaw(entry["name"])
                done.append(entry["name"])
            if list(self.frozen) != list(state["frozen"]):
                raise CheckpointMismatchError(
                    f"{self._caller}: the checkpoint lists {shown(state['frozen'])} as frozen, "
                    f"but its schedule leaves {shown(self.frozen)} frozen; it is inconsistent"
                )
        except BaseException:
            for name in reversed(done):
                self._unthaw(name)
            raise

    def _require_active(self, what: str) -> None:
        if not self._active:
            raise SpecError(
                f"{self._caller}.{what}(): the handle was restored; apply the spec again"
            )

    def __repr__(self) -> str:
        state = "active" if self._active else "restored"
        return (
            f"IsolationHandle({type(self.plan.model).__name__}: {len(self.frozen)} frozen, "
            f"{len(self.plan.wraps)} branches, thawed {list(self._thawed)}, {state})"
        )
