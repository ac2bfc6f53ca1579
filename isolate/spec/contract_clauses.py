"""The clauses of each contract kind, bound to one model, checked with the toolkit's audits.

Each kind is a class over :class:`Clauses`: built from a :class:`~isolate.spec.contracts.
Contract` and the model (every selector resolved once, before anything changes), it answers
three questions, each as a list of outcomes ``(clause, violation or None)``:

* :meth:`Clauses.graph`: what the named losses and the loss backpropagated reach, from a walk
  of their graphs (:mod:`isolate._autograd`), or, for a reversal (in
  :mod:`isolate.spec.reversal`), their gradients;
* :meth:`Clauses.state`: what the optimizers hold, which modes the modules run in, what moved
  (:mod:`isolate.drift`);
* :meth:`Clauses.close`: what happened over a window of optimizer steps opened by
  :meth:`Clauses.open` (a tensor that must change; the EMA, in :mod:`isolate.spec.ema`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import Node

from isolate._autograd import refuse_raising, walk
from isolate._holding import held_policy
from isolate._selectors import describe, select
from isolate._sharding import check_leaves
from isolate._text import shown
from isolate._walker import Names
from isolate.drift import Snapshot, snapshot
from isolate.errors import BlindSpotError, ContractError, IsolationError, SelectorError
from isolate.spec.contracts import Contract

__all__ = [
    "Clauses",
    "Context",
    "MustMove",
    "Outcome",
    "Recorded",
    "Window",
    "module_of",
    "no_loss_reaches",
    "no_optimizer_holds",
    "params_of",
    "reached_names",
]

Outcome = tuple[str, IsolationError | None]
"""One clause checked: its name, and the violation (``None`` when it holds)."""


@dataclass
class Recorded:
    """What the modules a contract watches received and returned during one forward."""

    inputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    training: dict[int, list[bool]] = field(default_factory=dict)  # the flag each forward ran with

    def of(self, module: nn.Module, what: str) -> list[torch.Tensor]:
        return (self.inputs if what == "inputs" else self.outputs).get(id(module), [])


@dataclass
class Context:
    """What one check sees: the model, the losses with their graphs, the optimizers, what the
    watched modules recorded; walks of the graphs are shared by every contract."""

    model: nn.Module
    names: Names
    losses: Mapping[str, torch.Tensor] | None
    total: Sequence[torch.Tensor] | None
    optimizers: Sequence[torch.optim.Optimizer]
    recorded: Recorded
    when: str
    caller: str
    _walks: dict[object, dict[int, torch.Tensor]] = field(default_factory=dict)

    def leaves(
        self, key: object, outputs: Sequence[torch.Tensor], stop: Callable[[Node], bool] | None
    ) -> dict[int, torch.Tensor]:
        """The leaves ``outputs`` reach (FSDP2 temporaries mapped to their parameters)."""
        if key not in self._walks:
            found = walk([t for t in outputs if t.requires_grad], self.caller, stop=stop)
            refuse_raising(found, self.caller, walk_only=True)
            check_leaves(found, [self.model], self.caller)
            self._walks[key] = found.leaves
        return self._walks[key]

    def loss_of(self, contract: Contract) -> torch.Tensor | None:
        """The named loss ``contract`` reads, if this check was given it."""
        if self.losses is None or contract.loss not in self.losses:
            return None
        return self.losses[str(contract.loss)]

    def reached_by(self, loss: str) -> dict[int, torch.Tensor]:
        assert self.losses is not None  # every caller checks first
        return self.leaves(loss, [self.losses[loss]], None)

    def reached_by_total(self) -> dict[int, torch.Tensor]:
        return self.leaves(("total",), list(self.total or ()), None)

    def sources(self) -> list[tuple[str, dict[int, torch.Tensor]]]:
        """Every named loss and the loss backpropagated, with what each reaches."""
        out = [(f"loss {n!r}", self.reached_by(n)) for n in self.losses or {}]
        if self.total:
            out.append(("the loss backpropagated", self.reached_by_total()))
        return out

    def fail(self, contract: Contract, clause: str, detail: str) -> ContractError:
        return ContractError(
            f"{self.caller}: {self.when}, contract {contract.name!r} ({contract.kind}) breaks "
            f"its clause '{clause}': {detail}"
        )

    def blind(self, contract: Contract, clause: str, detail: str) -> BlindSpotError:
        return BlindSpotError(
            f"{self.caller}: {self.when}, contract {contract.name!r} ({contract.kind}) cannot "
            f"check its clause '{clause}': {detail}"
        )


def module_of(model: nn.Module, name: str, where: str) -> nn.Module:
    """The submodule ``name`` of ``model``, or a :class:`SelectorError` naming its children."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise SelectorError(
            f"{where}: {name!r} is not a submodule of {describe(model)}; name a submodule with "
            f"its dotted path"
        ) from None


def params_of(
    model: nn.Module, names: Names, selectors: Sequence[str], where: str
) -> dict[str, nn.Parameter]:
    """The parameters ``selectors`` pick, by ``state_dict`` key."""
    picked = select(model, tuple(selectors), where).params.values()
    return {names.of_id[id(p)]: p for p in picked}


def in_optimizers(
    params: Mapping[str, torch.Tensor], optimizers: Sequence[torch.optim.Optimizer]
) -> list[str]:
    """Which of ``params`` any optimizer holds, as ``name (optimizer i, group g)``."""
    ids = {id(p): n for n, p in params.items()}
    return [
        f"{ids[id(p)]} (optimizer {oi}, group {gi})"
        for oi, opt in enumerate(optimizers)
        for gi, group in enumerate(opt.param_groups)
        for p in group["params"]
        if id(p) in ids
    ]


class Window:
    """Fingerprints of named tensors from the start of a window of optimizer steps."""

    def __init__(self) -> None:
        self.start: int | None = None
        self._snap: Snapshot | None = None

    def open(self, step: int, model: nn.Module, names: Iterable[str]) -> None:
        if self.start is None:
            self.start, self._snap = step, snapshot(model, names=list(names), drift="fingerprint")

    def due(self, step: int, within: int) -> bool:
        return self.start is not None and step - self.start >= within

    def close(self) -> tuple[int, Snapshot]:
        assert self.start is not None and self._snap is not None  # due() was true
        start, snap = self.start, self._snap
        self.start, self._snap = None, None
        return start, snap


class Clauses:
    """A contract bound to a model: its clauses, checked on demand."""

    CLAUSES: tuple[str, ...] = ()

    def __init__(self, contract: Contract, model: nn.Module, names: Names, caller: str) -> None:
        self.contract = contract
        self.where = f"{caller}(contract {contract.name!r})"
        self.watch: list[tuple[nn.Module, str]] = []  # modules whose inputs/outputs to record
        self.moving: frozenset[str] = frozenset()  # keys that move by a rule of their own
        self.params: dict[str, nn.Parameter] = {}  # the parameters it is about, by key

    @property
    def losses(self) -> tuple[str, ...]:
        """The named losses the contract reads."""
        return (self.contract.loss,) if self.contract.loss else ()

    def graph(self, ctx: Context) -> list[Outcome]:
        return []

    def state(self, ctx: Context) -> list[Outcome]:
        return []

    def open(self, step: int, model: nn.Module) -> None:
        """Start a window at the beginning of optimizer step ``step``."""

    def due(self, step: int) -> bool:
        return False

    def close(self, ctx: Context) -> list[Outcome]:
        return []

    def release(self) -> None:
        """Drop what the clauses keep between checks (snapshots hold weak references, which
        keep FSDP2 from swapping the parameters when the model moves after training)."""


def reached_names(
    ctx: Context, params: Mapping[str, nn.Parameter], leaves: Mapping[int, object]
) -> list[str]:
    """The names of ``params`` among the ``leaves`` of a walk (the parameters it reaches)."""
    return [n for n, p in params.items() if id(p) in leaves]


def no_loss_reaches(
    ctx: Context, contract: Contract, clause: str, params: Mapping[str, nn.Parameter]
) -> list[Outcome]:
    """The clause "no loss reaches these parameters", over every loss the check was given."""
    sources = ctx.sources()
    if not sources:
        return []
    for source, leaves in sources:
        hit = reached_names(ctx, params, leaves)
        if hit:
            return [(clause, ctx.fail(contract, clause, f"{source} reaches {shown(hit)}"))]
    return [(clause, None)]


def no_optimizer_holds(
    ctx: Context, contract: Contract, clause: str, params: Mapping[str, nn.Parameter]
) -> list[Outcome]:
    """The clause "no optimizer holds these parameters", over every attached optimizer."""
    if not ctx.optimizers:
        return [
            (
                clause,
                ctx.blind(
                    contract,
                    clause,
                    "no optimizer is attached, so none can be searched; pass optimizer= to "
                    "apply() or call handle.attach(optimizer)",
                ),
            )
        ]
    held = in_optimizers(params, ctx.optimizers)
    if held:
        return [(clause, ctx.fail(contract, clause, f"an optimizer holds {shown(held)}"))]
    return [(clause, None)]


class Teacher(Clauses):
    """``{kind: teacher, select}``: a fixed network other parts learn from."""

    CLAUSES = ("no loss reaches it", "in no optimizer", "in eval mode", "bitwise still")

    def __init__(self, contract: Contract, model: nn.Module, names: Names, caller: str) -> None:
        super().__init__(contract, model, names, caller)
        selection = select(model, contract.select, self.where, modes=True, holders=True)
        self.params = {names.of_id[id(p)]: p for p in selection.params.values()}
        self.modes = dict(selection.modes)
        self.watch += [(m, "training") for m in self.modes.values()]
        # The buffers of every module the selection covers (a selected layer's, a constant
        # table's under a selected network) and of its mode-dependent layers.
        buffers = list(
            dict.fromkeys(
                names.of_id[id(b)]
                for m in [*selection.holders.values(), *self.modes.values()]
                for b in m.buffers(recurse=False)
                if id(b) in names.of_id
            )
        )
        self.snap: Snapshot | None = snapshot(
            model, names=[*self.params, *buffers], drift="fingerprint"
        )

    def graph(self, ctx: Context) -> list[Outcome]:
        return no_loss_reaches(ctx, self.contract, "no loss reaches it", self.params)

    def release(self) -> None:
        self.snap = None

    def state(self, ctx: Context) -> list[Outcome]:
        out = no_optimizer_holds(ctx, self.contract, "in no optimizer", self.params)
        training = [
            n
            for n, m in self.modes.items()
            if (m.training and held_policy(m) != "eval")
            or any(ctx.recorded.training.get(id(m), ()))
        ]
        clause = "in eval mode"
        out.append(
            (
                clause,
                ctx.fail(
                    self.contract,
                    clause,
                    f"{shown(training)} run in train mode (their forward reads .training); "
                    f"hold them with freeze(..., mode='eval') or the spec's mode: eval, which "
                    f"survive model.train()",
                )
                if training
                else None,
            )
        )
        if self.snap is None:
            return out
        moved = self.snap.changed()
        clause = "bitwise still"
        if moved:
            kinds = self.snap.kinds
            listed = [f"{n} ({kinds[n]})" for n in moved]
            self.snap = self.snap.renewed()  # each move is reported once
            out.append((clause, ctx.fail(self.contract, clause, f"{shown(listed)} changed")))
        else:
            out.append((clause, None))
        return out


class StopGradient(Clauses):
    """``{kind: stop_gradient, loss, blocked, through}``: a loss that must not reach a side."""

    CLAUSES = ("does not reach the blocked side", "the blocked side is still reached")

    def __init__(self, contract: Contract, model: nn.Module, names: Names, caller: str) -> None:
        super().__init__(contract, model, names, caller)
        self.blocked = params_of(model, names, contract.blocked, self.where)
        self.through = module_of(model, contract.through, self.where) if contract.through else None
        if self.through is not None:
            self.watch.append((self.through, "outputs"))

    def graph(self, ctx: Context) -> list[Outcome]:
        contract, out = self.contract, list[Outcome]()
        clause = "does not reach the blocked side"
        loss = ctx.loss_of(contract)
        if loss is not None:
            stop = None
            route = ""
            if self.through is not None:
                nodes = {t.grad_fn for t in ctx.recorded.of(self.through, "outputs")} - {None}
                if not nodes:
                    return [
                        (
                            clause,
                            ctx.blind(
                                contract,
                                clause,
                                f"{contract.through!r} did not run while the check recorded "
                                f"(call handle.step(..., record=True) before the forward)",
                            ),
                        )
                    ]
                stop, route = nodes.__contains__, f" outside the route through {contract.through!r}"
            leaves = ctx.leaves((contract.loss, "stop", id(self)), [loss], stop)
            hit = reached_names(ctx, self.blocked, leaves)
            out.append(
                (
                    clause,
                    ctx.fail(
                        contract, clause, f"loss {contract.loss!r} reaches {shown(hit)}{route}"
                    )
                    if hit
                    else None,
                )
            )
        if ctx.total:
            clause = "the blocked side is still reached"
            reached = set(ctx.reached_by_total())
            for _, leaves in ctx.sources():
                reached |= set(leaves)
            cut = [n for n, p in self.blocked.items() if p.requires_grad and id(p) not in reached]
            detail = f"no loss reaches {shown(cut)}: they are cut off, not only blocked"
            out.append((clause, ctx.fail(contract, clause, detail) if cut else None))
        return out


class MustMove(Clauses):
    """Clauses over the parameters ``select`` picks that must change within ``within``
    optimizer steps: a window opens at a step, and closes (:meth:`still`) once it is due."""

    def __init__(self, contract: Contract, model: nn.Module, names: Names, caller: str) -> None:
        super().__init__(contract, model, names, caller)
        self.params = params_of(model, names, contract.select, self.where)
        self.window = Window()

    def open(self, step: int, model: nn.Module) -> None:
        self.window.open(step, model, self.params)

    def due(self, step: int) -> bool:
        return self.window.due(step, self.contract.steps)

    def release(self) -> None:
        self.window = Window()

    def still(self) -> tuple[int, list[str]]:
        """The window's first step, and the parameters that did not change over it."""
        start, snap = self.window.close()
        moved = snap.changed()
        return start, [n for n in snap.names if n not in moved]


class Probe(MustMove):
    """``{kind: probe, select, loss, within}``: an online probe on frozen-for-it features."""

    CLAUSES = (
        "its loss reaches only the probe",
        "no other loss reaches the probe",
        "the probe moves",
    )

    def __init__(self, contract: Contract, model: nn.Module, names: Names, caller: str) -> None:
        super().__init__(contract, model, names, caller)
        self._named: set[Node] | None = None  # the named losses' nodes, for the totals after

    def graph(self, ctx: Context) -> list[Outcome]:
        contract, out = self.contract, list[Outcome]()
        hits: list[tuple[str, list[str]]] = []
        if ctx.losses is not None:
            nodes = {t.grad_fn for t in ctx.losses.values() if t.grad_fn is not None}
            self._named = (self._named or set()) | nodes  # every micro-batch's, until the total
        if ctx.loss_of(contract) is not None:
            ids = {id(p) for p in self.params.values()}
            own = ctx.reached_by(str(contract.loss))
            outside = [n for n, p in ctx.names.params.items() if id(p) in own and id(p) not in ids]
            clause = "its loss reaches only the probe"
            detail = f"loss {contract.loss!r} also reaches {shown(outside)}"
            out.append((clause, ctx.fail(contract, clause, detail) if outside else None))
            others = [n for n in ctx.losses or {} if n != contract.loss]
            hits += [
                (f"loss {n!r}", reached_names(ctx, self.params, ctx.reached_by(n))) for n in others
            ]
        if ctx.total and self._named is not None:
            # The loss backpropagated, apart from the named losses summed into it: a loss left
            # unnamed (a task head that reads the probe's output) is another loss too.
            rest = ctx.leaves(("total", "unnamed"), ctx.total, self._named.__contains__)
            hits.append(
                (
                    "the loss backpropagated, apart from the named losses in it,",
                    reached_names(ctx, self.params, rest),
                )
            )
            self._named = None
        if ctx.loss_of(contract) is not None or hits:
            clause = "no other loss reaches the probe"
            hits = [(n, h) for n, h in hits if h]
            detail = "; ".join(f"{n} reaches {shown(h)}" for n, h in hits)
            out.append((clause, ctx.fail(contract, clause, detail) if hits else None))
        return out

    def release(self) -> None:
        super().release()
        self._named = None

    def close(self, ctx: Context) -> list[Outcome]:
        start, still = self.still()
        clause = "the probe moves"
        detail = (
            f"{shown(still)} did not change in the {self.contract.steps} optimizer step(s) "
            f"from step {start}"
        )
        return [(clause, ctx.fail(self.contract, clause, detail) if still else None)]


class Trains(MustMove):
    """``{kind: trains, select, within}``: parameters that must learn."""

    def __init__(self, contract: Contract, model: nn.Module, names: Names, caller: str) -> None:
        super().__init__(contract, model, names, caller)
        self.CLAUSES = ("reached by the loss", f"changes within {contract.steps} step(s)")

    def graph(self, ctx: Context) -> list[Outcome]:
        if not ctx.total:
            return []
        clause = "reached by the loss"
        leaves = ctx.reached_by_total()
        cut = [n for n, p in self.params.items() if id(p) not in leaves]
        detail = (
            f"the loss backpropagated does not reach {shown(cut)}; they keep their values "
            f"(isolate.cutoff.trace_forward tells why)"
        )
        return [(clause, ctx.fail(self.contract, clause, detail) if cut else None)]

    def close(self, ctx: Context) -> list[Outcome]:
        start, still = self.still()
        clause = self.CLAUSES[1]
        detail = (
            f"{shown(still)} did not change from step {start} to step {start + self.contract.steps}"
        )
        return [(clause, ctx.fail(self.contract, clause, detail) if still else None)]
