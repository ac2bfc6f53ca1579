"""A spec resolved against one model: every selector turned into parameters, once.

:func:`resolve` checks the whole :class:`~isolate.spec.IsolationSpec` against a model and
changes nothing; the :class:`Plan` it returns is what the engine applies, thaws, verifies and
saves. Parameters are named by their ``state_dict`` keys (no wrapper ``module.`` infix), so
names stay the same whether or not the model is wrapped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from isolate._selectors import describe, is_float, select
from isolate._text import shown
from isolate._walker import Names
from isolate._wrapping import Wrapper
from isolate.errors import IsolationTypeError, SelectorError, SpecError, WrappingError
from isolate.spec.contract_checks import bind
from isolate.spec.contract_clauses import Clauses
from isolate.spec.data import SpecData
from isolate.spec.thaw import Thaw

__all__ = ["Group", "Plan", "Wrap", "resolve"]


@dataclass
class Wrap:
    """A ``detach`` / ``clone`` branch: which child of which parent gets which wrapper."""

    kind: Literal["detach", "clone"]
    name: str
    parent: nn.Module
    leaf: str
    child: nn.Module


@dataclass
class Group:
    """A thaw step resolved against the model."""

    thaw: Thaw
    params: dict[str, nn.Parameter]  # state_dict key -> parameter, model order
    norms: dict[str, nn.Module]  # the layers whose mode it sets: BatchNorm, or with mode= all

    @property
    def name(self) -> str:
        return str(self.thaw.name)


@dataclass
class Plan:
    """What a spec means for one model; nothing in the model has changed yet."""

    spec: SpecData
    model: nn.Module
    names: Names
    frozen: dict[str, nn.Parameter]
    norms: dict[str, nn.Module]  # held layers: BatchNorm, or with mode= every mode-dependent one
    wraps: list[Wrap]
    groups: list[Group]
    protect: dict[str, dict[str, nn.Parameter]] | None
    contracts: list[Clauses] = field(default_factory=list)

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise SpecError(
            f"IsolationHandle: no thaw group {name!r}; the groups are {self.group_names}"
        )

    @property
    def moving(self) -> set[str]:
        """Tensors a contract says move by a rule of their own (an EMA target), by key: the
        spec may freeze them (to gradients) and hold them in eval mode, but does not watch
        them for drift."""
        return {n for c in self.contracts for n in c.moving}

    def expectations(
        self, frozen: Mapping[str, nn.Parameter], thawed: Sequence[str]
    ) -> dict[str, str]:
        """Parameter key -> what the spec expects of it, given what is ``frozen`` now and the
        groups ``thawed`` so far: ``"still"`` (``"still until epoch 2"`` for a group that
        waits for its thaw), ``"EMA of <online>"``, or ``"moves"``."""
        out = dict.fromkeys(self.names.params, "moves")
        waiting = {n: g.thaw.when for g in self.groups if g.name not in thawed for n in g.params}
        for name in frozen:
            out[name] = f"still until {waiting[name]}" if name in waiting else "still"
        for clauses in self.contracts:
            contract = clauses.contract
            if contract.kind == "teacher":
                out.update(dict.fromkeys(clauses.params, "still"))
            elif contract.kind == "ema":
                for name in clauses.moving:
                    if name in out:
                        out[name] = f"EMA of {contract.online}"
        return out

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    def check_norms_present(self, caller: str) -> None:
        """Refuse when held BatchNorm layers were replaced since the plan was made
        (``sync_batchnorm``, a ``configure_model`` hook): ``bn="eval"`` no longer holds them."""
        present = {id(m) for m in self.model.modules()}
        gone = [n for n, m in self.norms.items() if id(m) not in present]
        if gone and self.spec.policy == "eval":
            raise SpecError(
                f"{caller}: {len(gone)} frozen BatchNorm layers were replaced after the spec was "
                f"applied (sync_batchnorm, or a configure_model hook), so bn='eval' no longer "
                f"holds them: {shown(gone)}. Build the layers first, or use bn='train'"
            )

    def held_buffers(self) -> list[str]:
        """Names of the buffers of the layers ``bn="eval"`` (or ``mode="eval"``) holds."""
        if self.spec.policy != "eval":
            return []
        return sorted(
            self.names.of_id[id(b)]
            for m in self.norms.values()
            for b in m.buffers(recurse=False)
            if id(b) in self.names.of_id
        )

    def record(self) -> dict[str, Any]:
        """The resolved spec as plain data: what a checkpoint is checked against."""
        return {
            "freeze": list(self.frozen),
            **({"mode": self.spec.mode} if self.spec.mode else {}),  # older states still match
            "bn": self.spec.bn,
            "bn_held": self.held_buffers(),
            "detach": list(self.spec.detach),
            "clone": list(self.spec.clone),
            "thaw": [
                {
                    "name": g.name,
                    "params": list(g.params),
                    "epoch": g.thaw.epoch,
                    "step": g.thaw.step,
                    "lr": g.thaw.lr,
                    "optimizer_idx": g.thaw.optimizer_idx,
                    "bn": g.thaw.bn,
                    **g.thaw.extras(),  # only what is set: older checkpoints still match
                }
                for g in self.groups
            ],
        }


def resolve(spec: SpecData, model: nn.Module, caller: str = "IsolationSpec") -> Plan:
    """Resolve every selector of ``spec`` against ``model`` once; change nothing.

    Raises:
        IsolationTypeError: ``model`` is not a module.
        SelectorError: a selector matches nothing, or a branch is not a submodule.
        SpecError, WrappingError: the spec cannot work on this model (a thaw group that is not
            frozen, two groups that overlap, a branch already wrapped or registered twice).
    """
    if not isinstance(model, nn.Module):
        raise IsolationTypeError(
            f"{caller}: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    names = Names.of(model)
    frozen: dict[str, nn.Parameter] = {}
    norms: dict[str, nn.Module] = {}
    whole = spec.mode is not None
    if spec.freeze:
        selection = select(model, spec.freeze, f"{caller}(freeze)", modes=whole)
        frozen = {names.of_id[id(p)]: p for p in selection.params.values()}
        norms = dict(selection.modes if whole else selection.norms)
    wraps = _wraps(spec, model, caller)
    groups = _groups(spec, model, names, frozen, caller)
    protect: dict[str, dict[str, nn.Parameter]] | None = None
    if spec.protect is not None:
        protect = {}
        for loss, selectors in spec.protect.items():
            chosen = select(model, selectors, f"{caller}(protect[{loss!r}])")
            protect[loss] = {names.of_id[id(p)]: p for p in chosen.params.values()}
    contracts = bind(spec.contracts, model, caller)
    return Plan(spec, model, names, frozen, norms, wraps, groups, protect, contracts)


def _wraps(spec: SpecData, model: nn.Module, caller: str) -> list[Wrap]:
    aliases: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(name)
    wraps: list[Wrap] = []
    kinds: list[tuple[Literal["detach", "clone"], str]] = [
        *(("detach", n) for n in spec.detach),
        *(("clone", n) for n in spec.clone),
    ]
    for kind, name in kinds:
        where = f"{caller}({kind})"
        try:
            child = model.get_submodule(name)
        except AttributeError:
            raise SelectorError(
                f"{where}: {name!r} is not a submodule of {describe(model)}; name a "
                f"submodule with its dotted path, e.g. 'heads.aux'"
            ) from None
        if child is model:
            raise SpecError(f"{where}: {name!r} names the model itself; name a submodule")
        if isinstance(child, Wrapper):
            raise WrappingError(
                f"{where}: {name!r} is already a {type(child).__name__}; drop it from "
                f"{kind}, or unwrap it in the model code"
            )
        registered = aliases.get(id(child), [])
        if not registered:
            raise SelectorError(
                f"{where}: {name!r} reaches a module the model does not register (a property "
                f"or a plain attribute returns it), so a wrapper put there would never be "
                f"called; name the registered submodule it stands for"
            )
        if len(registered) > 1:
            raise WrappingError(
                f"{where}: {name!r} is registered under {len(registered)} names {registered}; "
                f"only one of them can be replaced, and calls through the others would bypass "
                f"the wrapper. Keep a single attribute for the branch"
            )
        same = next((w for w in wraps if w.child is child), None)
        if same is not None:
            raise SpecError(
                f"{where}: {name!r} and {same.kind} {same.name!r} are one module, registered "
                f"as {registered[0]!r}; name it once"
            )
        # Replaced where it is registered, whatever path reached it (a property returning
        # it, the module inside torch.compile's wrapper), so every call finds the wrapper and
        # restore finds it there.
        parent_name, _, leaf = registered[0].rpartition(".")
        parent = model.get_submodule(parent_name)
        wraps.append(Wrap(kind, name, parent, leaf, child))
    return wraps


def _groups(
    spec: SpecData,
    model: nn.Module,
    names: Names,
    frozen: dict[str, nn.Parameter],
    caller: str,
) -> list[Group]:
    groups: list[Group] = []
    frozen_ids = {id(p) for p in frozen.values()}
    owner: dict[int, str] = {}
    for thaw in spec.thaw:
        name = str(thaw.name)
        where = f"{caller}(thaw {name!r})"
        selection = select(model, thaw.selectors, where, modes=spec.mode is not None)
        params = {names.of_id[id(p)]: p for p in selection.params.values()}
        if any(id(p) not in frozen_ids for p in params.values()):
            # A thaw takes the frozen part of what it selects ("backbone" after freezing the
            # backbone but its norms); a selector with no frozen part at all is a mistake.
            _check_thaw_selectors(model, thaw.selectors, names, frozen_ids, name, where, caller)
            params = {n: p for n, p in params.items() if id(p) in frozen_ids}
            if not params:
                raise SpecError(
                    f"{caller}: thaw group {name!r} keeps no parameter that freeze freezes "
                    f"(its exclusions take out every frozen one), so it would thaw nothing; "
                    f"fix its select"
                )
        covered = selection.modes if spec.mode is not None else selection.norms
        norms: dict[str, nn.Module] = {
            n: m
            for n, m in covered.items()
            if all(id(p) in frozen_ids for p in m.parameters(recurse=False))
        }
        twice = [n for n, p in params.items() if id(p) in owner]
        if twice:
            first = owner[id(params[twice[0]])]
            earlier = next(g for g in groups if g.name == first)
            raise SpecError(
                f"{caller}: thaw groups {first!r} and {name!r} both select {shown(twice)}; a "
                f"parameter can be thawed once: "
                + _overlap_fix(model, earlier, Group(thaw, params, {}), frozen_ids)
            )
        integral = [n for n, p in params.items() if not is_float(p)]
        if integral:
            raise SpecError(
                f"{caller}: thaw group {name!r} selects parameters {shown(integral)} that are "
                f"not floating point and can never require grad; leave them out"
            )
        for p in params.values():
            owner[id(p)] = name
        groups.append(Group(thaw, params, norms))
    return groups


def _overlap_fix(model: nn.Module, a: Group, b: Group, frozen_ids: set[int]) -> str:
    """The exclusion that separates two overlapping thaw groups, checked on the model: the
    wider group without the narrower one's selectors (or without the shared parameters)."""
    a_ids, b_ids = ({id(p) for p in g.params.values()} for g in (a, b))
    candidates: list[tuple[Group, list[str], set[int]]] = []
    for wide, narrow, other in ((a, b, b_ids), (b, a, a_ids)):
        if not any(s.startswith("!") for s in narrow.thaw.selectors):
            exclude = [f"!{s}" for s in narrow.thaw.selectors]
            candidates.append((wide, [*wide.thaw.selectors, *exclude], other))
        shared = [n for n, p in wide.params.items() if id(p) in other]
        candidates.append((wide, [*wide.thaw.selectors, *(f"!{n}" for n in shared)], other))
    for group, selectors, other in candidates:
        try:
            picked = select(model, tuple(selectors), "overlap").params.values()
        except SelectorError:
            continue
        ids = {id(p) for p in picked} & frozen_ids
        if ids and not ids & other:
            fix = f"select: {selectors} for {group.name!r}"
            return f"take them out of one group with an exclusion, {fix}"
    return f"they select the same parameters; drop {b.name!r} or {a.name!r}"


def _check_thaw_selectors(
    model: nn.Module,
    selectors: tuple[str, ...],
    names: Names,
    frozen_ids: set[int],
    group: str,
    where: str,
    caller: str,
) -> None:
    """Refuse a thaw selector that picks only parameters the spec does not freeze."""
    for selector in selectors:
        if selector.startswith("!"):
            continue
        picked = select(model, (selector,), where).params.values()
        if not any(id(p) in frozen_ids for p in picked):
            trainable = [names.name(p) for p in picked]
            raise SpecError(
                f"{caller}: thaw group {group!r}: {selector!r} selects {len(trainable)} "
                f"parameters that freeze does not freeze: {shown(trainable)}; they are "
                f"trainable already, so thawing them would do nothing (Lightning's "
                f"BackboneFinetuning warns and skips them; a spec refuses, since this is "
                f"usually a typo). Fix: add them to freeze if they should wait for this thaw, "
                f"or drop {selector!r} from the thaw's select"
            )
