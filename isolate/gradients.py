"""Measuring gradients per parameter group and per loss, without touching ``.grad``.

:func:`gradient_report` gives each loss's gradient norm, share and cosine per group;
:func:`gradient_invariance` proves, number for number, that auxiliary losses leave the main
loss's gradients unchanged. Both use ``torch.autograd.grad`` and keep the graph.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from isolate._autograd import check_real, check_scalar, gradients_of, graph_inputs
from isolate._delta import max_abs_diff
from isolate._protected import Protected, resolve_named
from isolate._selectors import check_module, select
from isolate._sharding import roots_of
from isolate._text import formatted
from isolate.errors import IsolationTypeError

__all__ = [
    "GradientInvariance",
    "GradientReport",
    "GroupStats",
    "gradient_invariance",
    "gradient_report",
]


@dataclass(frozen=True)
class GroupStats:
    """Gradient statistics of one parameter group, one entry per loss.

    Attributes:
        name: the group's name.
        parameters: the names of the trainable parameters in the group, in model order.
        numel: how many trainable scalars the group holds (tied parameters counted once).
        norms: loss name -> L2 norm of that loss's gradient on the group; ``None`` when the
            loss does not reach the group at all (``0.0`` means reached with a zero gradient).
        shares: loss name -> the fraction of that loss's squared gradient norm (over the whole
            model) that falls in this group; ``None`` when not reached or the total is zero.
        cosines: ``(loss_a, loss_b)`` -> cosine between the two losses' gradients on the
            group; ``None`` (undefined) when no parameter of the group is reached by both,
            or either gradient is zero.
        frozen: the names of the group's frozen parameters (``requires_grad=False``), which
            no loss can reach; a group of frozen parameters only is not an empty selection.
        frozen_numel: how many frozen scalars the group holds.
    """

    name: str
    parameters: tuple[str, ...]
    numel: int
    norms: Mapping[str, float | None]
    shares: Mapping[str, float | None]
    cosines: Mapping[tuple[str, str], float | None]
    frozen: tuple[str, ...] = ()
    frozen_numel: int = 0

    @property
    def size(self) -> str:
        """The group's size as the table shows it: ``"frozen"`` when nothing in it trains."""
        if not self.frozen_numel:
            return str(self.numel)
        if not self.numel:
            return f"frozen ({self.frozen_numel})"
        return f"{self.numel} (+{self.frozen_numel} frozen)"

    def to_dict(self) -> dict[str, Any]:
        """Plain Python data; cosines are keyed ``"a|b"``."""
        return {
            "parameters": list(self.parameters),
            "numel": self.numel,
            "frozen": list(self.frozen),
            "frozen_numel": self.frozen_numel,
            "norm": dict(self.norms),
            "share": dict(self.shares),
            "cosine": {f"{a}|{b}": c for (a, b), c in self.cosines.items()},
        }


@dataclass(frozen=True)
class GradientReport:
    """Per-group gradient norms, shares and cosines of several losses.

    ``str(report)`` is an aligned text table; ``report["encoder"]`` is one
    :class:`GroupStats`; ``report.total`` covers every trainable parameter.

    Attributes:
        losses: the loss names, in the order given.
        groups: group name -> :class:`GroupStats`, in the order of the groups.
        total: the same statistics over the whole model.
    """

    losses: tuple[str, ...]
    groups: Mapping[str, GroupStats]
    total: GroupStats

    def __getitem__(self, group: str) -> GroupStats:
        return self.groups[group]

    def to_dict(self) -> dict[str, Any]:
        """Plain Python data (``None`` where a value is undefined), ready for ``json``."""
        return {
            "losses": list(self.losses),
            "groups": {name: stats.to_dict() for name, stats in self.groups.items()},
            "total": self.total.to_dict(),
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The :meth:`to_dict` data as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        pairs = list(self.total.cosines)
        header = ["group", "params"]
        for loss in self.losses:
            header += [f"|g| {loss}", f"share {loss}"]
        header += [f"cos({a},{b})" for a, b in pairs]
        rows = [header]
        for stats in [*self.groups.values(), self.total]:
            row = [stats.name, stats.size]
            for loss in self.losses:
                share = stats.shares[loss]
                row += [
                    formatted(stats.norms[loss], ".3e"),
                    "-" if share is None else f"{100 * share:.1f}%",
                ]
            row += [formatted(stats.cosines[pair], "+.3f") for pair in pairs]
            rows.append(row)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                for i, cell in enumerate(row)
            ).rstrip()
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        return "\n".join(lines)


_Members = list[tuple[str, nn.Parameter]]


def _group_members(model: nn.Module, groups: object, caller: str) -> dict[str, _Members]:
    """Group name -> (name, parameter) of every parameter in it, model order; frozen ones are
    kept too, so that a frozen group reads as frozen, not as empty."""
    named = list(model.named_parameters())
    if groups is None:
        out: dict[str, _Members] = {}
        for name, p in named:
            head = name.partition(".")[0] if "." in name else "(root)"
            out.setdefault(head, []).append((name, p))
        return out
    if isinstance(groups, str):
        spec: dict[str, tuple[Any, ...]] = {groups: (groups,)}
    elif isinstance(groups, Mapping):
        spec = {}
        for key, value in groups.items():
            if not isinstance(key, str):
                raise IsolationTypeError(f"{caller}: group names must be strings, got {key!r}")
            is_many = isinstance(value, (list, tuple))
            spec[key] = tuple(value) if is_many else (value,)
    elif isinstance(groups, (list, tuple)):
        spec = {}
        for item in groups:
            if not isinstance(item, str):
                raise IsolationTypeError(
                    f"{caller}: a list of groups must hold selector strings, got "
                    f"{type(item).__name__}; use a mapping {{name: selector}} for other selectors"
                )
            spec[item] = (item,)
    else:
        raise IsolationTypeError(
            f"{caller}: groups must be None, a list of selector strings or a mapping "
            f"{{name: selector(s)}}, got {type(groups).__name__}"
        )
    out = {}
    covered: set[int] = set()
    for key, selectors in spec.items():
        chosen = {id(p) for p in select(model, selectors, caller).params.values()}
        covered |= chosen
        out[key] = [(n, p) for n, p in named if id(p) in chosen]
    rest = [(n, p) for n, p in named if id(p) not in covered]
    if rest:
        out["(rest)"] = rest
    return out


def _dense_rows(column: list[torch.Tensor | None], p: nn.Parameter) -> torch.Tensor:
    """The K gradients of one parameter as K flat rows of one dense tensor.

    Sparse gradients (``nn.Embedding(sparse=True)``) are made dense, which costs what the
    parameter itself costs; half-precision ones are widened to float32, where their products
    are exact and their sums cannot overflow. A complex one is its real and imaginary parts.
    """
    flat = []
    for g in column:
        if g is None:
            g = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif g.layout != torch.strided:
            g = g.to_dense()
        flat.append(torch.view_as_real(g.resolve_conj()) if g.is_complex() else g)
    rows = torch.stack(flat).reshape(len(flat), -1)
    if rows.dtype in (torch.float16, torch.bfloat16):
        rows = rows.float()
    return rows


@dataclass
class _Grams:
    """Per parameter, the K x K Gram matrix of the K losses' gradients, and which
    losses reach it: one matmul per parameter instead of K + K^2 / 2 reductions."""

    losses: tuple[str, ...]
    grams: dict[int, torch.Tensor]
    reached: dict[int, int]  # bit k set: loss k reaches the parameter

    @classmethod
    def of(
        cls, losses: tuple[str, ...], params: list[nn.Parameter], grads: list[Sequence[Any]]
    ) -> _Grams:
        grams: dict[int, torch.Tensor] = {}
        reached: dict[int, int] = {}
        for j, p in enumerate(params):
            column = [grads[k][j] for k in range(len(losses))]
            mask = sum(1 << k for k, g in enumerate(column) if g is not None)
            if not mask:
                continue
            rows = _dense_rows(column, p)
            # One matmul in the gradients' own precision (float32 for half types): a cast of
            # every gradient to float64 would cost more than the products. Sums of squares
            # beyond the float32 range come out inf: only then redo it in float64.
            gram = rows @ rows.T
            if not bool(torch.isfinite(gram).all()) and bool(torch.isfinite(rows).all()):
                rows = rows.double()
                gram = rows @ rows.T
            grams[id(p)] = gram.double()
            reached[id(p)] = mask
        return cls(losses, grams, reached)

    def total(self, ids: Iterable[int]) -> tuple[torch.Tensor | None, set[int]]:
        """The summed Gram matrix of ``ids`` and the distinct reach masks among them."""
        gram: torch.Tensor | None = None
        masks: set[int] = set()
        for i in ids:
            if i in self.grams:
                gram = self.grams[i] if gram is None else gram + self.grams[i]
                masks.add(self.reached[i])
        return gram, masks


def _stats(name: str, members: _Members, grams: _Grams, totals: Mapping[str, float]) -> GroupStats:
    unique = {id(p): p for _, p in members if p.requires_grad}
    frozen = {id(p): p for _, p in members if not p.requires_grad}
    gram, masks = grams.total(unique)
    values = gram.tolist() if gram is not None else None
    hit = [any(mask >> k & 1 for mask in masks) for k in range(len(grams.losses))]
    norms: dict[str, float | None] = {}
    shares: dict[str, float | None] = {}
    for k, loss in enumerate(grams.losses):
        if values is None or not hit[k]:
            norms[loss] = shares[loss] = None
            continue
        squared = values[k][k]
        norms[loss] = math.sqrt(squared)
        shares[loss] = squared / totals[loss] if totals[loss] > 0 else None
    cosines: dict[tuple[str, str], float | None] = {}
    for k, a in enumerate(grams.losses):
        for m in range(k + 1, len(grams.losses)):
            b = grams.losses[m]
            norm_a, norm_b = norms[a], norms[b]
            pair = 1 << k | 1 << m
            shared = any(mask & pair == pair for mask in masks)
            if values is None or not shared or not norm_a or not norm_b:
                cosines[(a, b)] = None  # undefined: no common parameter, or a zero gradient
                continue
            cosines[(a, b)] = values[k][m] / (norm_a * norm_b)
    return GroupStats(
        name=name,
        parameters=tuple(n for n, p in members if p.requires_grad),
        numel=sum(p.numel() for p in unique.values()),
        norms=norms,
        shares=shares,
        cosines=cosines,
        frozen=tuple(n for n, p in members if not p.requires_grad),
        frozen_numel=sum(p.numel() for p in frozen.values()),
    )


def gradient_report(
    losses: Mapping[str, torch.Tensor],
    model: nn.Module,
    *,
    groups: Mapping[str, Any] | Sequence[str] | None = None,
) -> GradientReport:
    """Where each loss sends gradient: norm, share and cosine per parameter group.

    One ``torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)`` call per
    loss. ``.grad`` is never read or written and the graph is kept, so the training step's
    own backward can follow. Reentrant checkpoints are seen through (each segment re-run, as
    backward does); under ``torch.compile`` the answer is eager's.

    Args:
        losses: loss name -> scalar loss tensor.
        model: the module whose trainable parameters are measured.
        groups: ``None`` groups parameters by top-level child module (``"(root)"`` for the
            model's own parameters). A list of selector strings (module names or globs over
            parameter names, as in :func:`isolate.freeze`) makes one group per string; a
            mapping ``{group name: selector or list of selectors}`` names them. Groups may
            overlap; parameters in no group are gathered under ``"(rest)"``.

    Returns:
        A :class:`GradientReport`; ``print(report)`` shows the table.

    Raises:
        IsolationTypeError: a loss is not a real scalar tensor, or an argument has the wrong type.
        SelectorError: a group's selector matches no parameter.
        BlindSpotError: a checkpointed segment cannot be re-run, the graph was freed or
            changed in place, a compiled backward reuses its saved buffers (torch refuses to
            keep the graph), or a node of it raises in backward (``@once_differentiable``).

    Note:
        Shares are of the *squared* norm, so they add up to 1 over non-overlapping groups. A
        norm of ``0.0`` (a path exists, the gradient along it is zero) and ``-`` (no path at
        all) are different answers: only the second one is isolation. A cosine is ``None``
        (``-``) unless some parameter of the group is reached by both losses. Products are taken
        in one K x K matmul per parameter, in float32 for float16/bfloat16 gradients (exact
        products, no overflow), in float64 where float32 would overflow, and summed in float64:
        norms and cosines are good to about 7 significant digits; for exact comparisons use
        :func:`gradient_invariance`. Sparse gradients (``nn.Embedding(sparse=True)``) are made
        dense one parameter at a time; a complex gradient counts as its real and imaginary
        parts, as a vector of twice the length. Frozen parameters are listed under ``frozen``,
        so a frozen group prints ``frozen (n)``.

    >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    >>> x = torch.randn(4, 3)
    >>> features = model[0](x)
    >>> losses = {"main": model[1](features).pow(2).mean(), "decay": model[1].weight.pow(2).sum()}
    >>> report = gradient_report(losses, model, groups={"encoder": "0", "head": "1"})
    >>> report["encoder"].norms["decay"] is None, report["head"].norms["decay"] > 0
    (True, True)
    >>> print(str(report).splitlines()[0])
    group    params   |g| main  share main  |g| decay  share decay  cos(main,decay)
    """
    caller = "gradient_report()"
    check_module(model, caller)
    if not isinstance(losses, Mapping) or not losses:
        raise IsolationTypeError(
            f"{caller}: losses must be a non-empty mapping of names to scalar loss tensors, got "
            f"{type(losses).__name__}; e.g. gradient_report({{'main': loss, 'aux': aux}}, model)"
        )
    for key, loss in losses.items():
        if not isinstance(key, str) or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = type(loss).__name__
            if isinstance(loss, torch.Tensor):
                got = f"a tensor of shape {tuple(loss.shape)}"
            raise IsolationTypeError(
                f"{caller}: loss {key!r} must be a scalar tensor, got {got}; reduce it first "
                f"(e.g. .mean())"
            )
        check_real(f"loss {key!r}", loss, caller)
    members = _group_members(model, groups, caller)
    everything = list(model.named_parameters())
    params = list({id(p): p for _, p in everything if p.requires_grad}.values())
    # Under FSDP2 the graph holds unsharded temporaries, not the sharded parameters.
    inputs = graph_inputs(list(losses.values()), [model], params, caller)
    computed: list[Sequence[torch.Tensor | None]] = []
    for loss in losses.values():
        if params and loss.requires_grad:
            computed.append(gradients_of(loss, inputs, caller))
        else:
            computed.append([None] * len(params))
    names = tuple(losses)
    grams = _Grams.of(names, inputs, computed)
    param_of = {id(i): id(p) for i, p in zip(inputs, params, strict=True)}
    grams = _Grams(
        names,
        {param_of[k]: v for k, v in grams.grams.items()},
        {param_of[k]: v for k, v in grams.reached.items()},
    )
    whole, _ = grams.total(grams.grams)
    diagonal = whole.diagonal().tolist() if whole is not None else [0.0] * len(names)
    totals = dict(zip(names, diagonal, strict=True))
    return GradientReport(
        losses=names,
        groups={name: _stats(name, group, grams, totals) for name, group in members.items()},
        total=_stats("total", everything, grams, totals),
    )


@dataclass(frozen=True)
class GradientInvariance:
    """How much the auxiliary losses change the main loss's gradients.

    Attributes:
        deltas: parameter name -> max |grad(total) - grad(main)| over its elements; exactly
            ``0.0`` for every parameter the auxiliary losses do not reach.
        max_delta: the largest of ``deltas`` (``0.0`` when there are none).
        trainable: how many protected parameters require grad (have gradients to compare).
    """

    deltas: Mapping[str, float]
    max_delta: float
    trainable: int = 0

    @property
    def isolated(self) -> bool:
        """Whether every delta is exactly zero (on this batch: see :func:`gradient_invariance`)."""
        return self.max_delta == 0.0

    def changed(self, *, atol: float = 0.0) -> dict[str, float]:
        """The parameters whose delta exceeds ``atol``, largest first."""
        hits = {name: d for name, d in self.deltas.items() if not d <= atol}
        return dict(sorted(hits.items(), key=lambda item: -item[1]))


def _grad_delta(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    # Sparse gradients (nn.Embedding(sparse=True)) are compared dense: two sparse tensors
    # with the same values can differ in their indices' order and duplicates.
    a = a.to_dense() if a is not None and a.layout != torch.strided else a
    b = b.to_dense() if b is not None and b.layout != torch.strided else b
    if a is None or b is None:
        only = a if b is None else b
        return 0.0 if only is None else max_abs_diff(only, torch.zeros_like(only))
    return max_abs_diff(a, b)


def gradient_invariance(
    main_loss: torch.Tensor,
    total_loss: torch.Tensor,
    protected: Protected,
    *,
    model: nn.Module | None = None,
) -> GradientInvariance:
    """Compare the gradients of ``main_loss`` and ``total_loss`` on protected parameters.

    ``total_loss`` is the objective actually trained, ``main_loss`` plus auxiliary losses.
    When no auxiliary loss reaches a protected parameter, both gradients on it are the same
    numbers, bit for bit, and its delta is exactly ``0.0``. Uses two
    ``torch.autograd.grad(..., retain_graph=True, allow_unused=True)`` calls (through
    reentrant checkpoints too, as :func:`gradient_report`); ``.grad`` is never touched.

    Args:
        main_loss: the scalar loss the protected parameters should learn from.
        total_loss: the scalar objective; it must contain ``main_loss`` with weight 1.
        protected: the parameters to compare; see :data:`Protected`.
        model: the whole model, to name parameters and resolve selector strings.

    Returns:
        A :class:`GradientInvariance` with the per-name and overall max |delta|.

    Raises:
        IsolationTypeError: a loss is not a real scalar tensor, or an argument has the wrong type.
        SelectorError: ``protected`` names no parameter, or a selector matches nothing.
        BlindSpotError: as :func:`gradient_report`.

    Note:
        ``total = 0.5 * main + aux`` changes every gradient by a factor of 0.5, so the deltas
        are not zero even when the isolation holds: weight the auxiliary terms, not the main
        loss. Frozen parameters, and a branch dead on this batch (a ReLU), give ``0.0``:
        :func:`~isolate.reachability.assert_isolated` proves isolation for every input.

    >>> encoder, head, probe = nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(3, 2)
    >>> features = encoder(torch.randn(4, 3))
    >>> main = head(features).mean()
    >>> gradient_invariance(main, main + probe(features.detach()).mean(), encoder).max_delta
    0.0
    >>> gradient_invariance(main, main + probe(features).mean(), encoder).isolated
    False
    """
    caller = "gradient_invariance()"
    for what, loss in (("main_loss", main_loss), ("total_loss", total_loss)):
        check_scalar(what, loss, caller)
    named = resolve_named(protected, model, caller)
    trainable = list({id(e.tensor): e.tensor for e in named if e.tensor.requires_grad}.values())
    losses = [main_loss, total_loss]  # FSDP2: differentiate the unsharded temporaries
    inputs = graph_inputs(losses, roots_of(protected, model), trainable, caller)

    def grads(loss: torch.Tensor) -> dict[int, torch.Tensor | None]:
        if not trainable or not loss.requires_grad:
            return {}
        computed = gradients_of(loss, inputs, caller)
        return {id(p): g for p, g in zip(trainable, computed, strict=True)}

    before, after = grads(main_loss), grads(total_loss)
    deltas = {e.name: _grad_delta(before.get(id(e.tensor)), after.get(id(e.tensor))) for e in named}
    values = list(deltas.values())
    overall = math.nan if any(map(math.isnan, values)) else max(values, default=0.0)
    return GradientInvariance(deltas=deltas, max_delta=overall, trainable=len(trainable))
