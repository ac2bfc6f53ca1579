"""Proving where gradient can go, without running a backward pass.

:func:`reachable_parameters` walks the autograd graph of a loss and names the parameters it
can send gradient to; :func:`assert_isolated` turns that into an assertion that names every
leak and the operation behind it. :func:`gradient_report` and :func:`gradient_invariance`
measure the gradients themselves (with ``torch.autograd.grad``, never touching ``.grad``).
"""

from __future__ import annotations

import json
import math
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
from torch import nn
from torch.autograd.graph import Node

from isolate._selectors import check_module, describe, select
from isolate.drift import max_abs_diff
from isolate.errors import GradientLeakError, IsolationTypeError, IsolationWarning, SelectorError

__all__ = [
    "GradientInvariance",
    "GradientReport",
    "GroupStats",
    "Losses",
    "Protected",
    "assert_isolated",
    "gradient_invariance",
    "gradient_report",
    "reachable_parameters",
]

Losses = torch.Tensor | Sequence[torch.Tensor]
"""One output tensor, or several (a list or tuple of tensors)."""

_Item = (
    nn.Module | torch.Tensor | str | tuple[str, torch.Tensor] | Callable[[str, nn.Parameter], bool]
)
Protected = _Item | Mapping[str, torch.Tensor] | Iterable[_Item]
"""Which parameters to check.

* a module (all its parameters), or several modules;
* a mapping of names to parameters, or ``(name, parameter)`` pairs such as
  ``model.encoder.named_parameters()``;
* parameters, or an iterable of them such as ``model.encoder.parameters()``;
* with ``model=``: module names, globs over parameter names (``"encoder.*"``) and predicates
  ``fn(name, parameter) -> bool``, as in :func:`isolate.freeze`.

With ``model=`` every parameter is named by its qualified name in ``model`` (all names of a
tied parameter); without it, by its name in the module or pair that holds it.
"""

# Backward nodes that only change a tensor's layout: when naming the operation that connects
# a parameter to the loss, these are looked through (``weight.t()`` feeds ``addmm``).
_LAYOUT_OPS = frozenset(
    {
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "SelectBackward0",
        "SliceBackward0",
        "AsStridedBackward0",
        "AliasBackward0",
        "CloneBackward0",
        "ToCopyBackward0",
        "UnbindBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
    }
)

# Nodes that use parameters the graph does not show: the reentrant checkpoint re-runs its
# function in backward, so whatever that function touches is invisible to the walk.
_OPAQUE_OPS = frozenset({"CheckpointFunctionBackward"})


def _node_name(node: Node) -> str:
    return node.name().removeprefix("torch::autograd::")


# --------------------------------------------------------------------------------------------
# The walk


@dataclass
class _Walk:
    """What one walk of an autograd graph found, keyed on tensor identity."""

    # id(leaf tensor) -> the leaf; leaves that are outputs themselves have no node.
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)
    # id(leaf tensor) -> the nodes that feed gradient into its AccumulateGrad node.
    consumers: dict[int, list[Node]] = field(default_factory=dict)
    # every node seen -> the node it was first reached from (None for the outputs' own nodes).
    # Holding the node objects also keeps their Python wrappers alive, so identity is stable.
    parent: dict[Node, Node | None] = field(default_factory=dict)
    opaque: list[str] = field(default_factory=list)

    def path(self, node: Node) -> list[str]:
        """Node names from an output down to ``node`` along the first-found route."""
        names: list[str] = []
        cur: Node | None = node
        while cur is not None:
            names.append(_node_name(cur))
            cur = self.parent[cur]
        return names[::-1]

    def connecting_ops(self, tensor: torch.Tensor) -> list[str]:
        """The operations that consume ``tensor``, looking through layout-only nodes."""
        ops: list[str] = []
        for consumer in self.consumers.get(id(tensor), []):
            through: list[str] = []
            cur: Node | None = consumer
            while cur is not None and _node_name(cur) in _LAYOUT_OPS:
                through.append(_node_name(cur))
                cur = self.parent[cur]
            if cur is None:
                text = " <- ".join(through)
            elif through:
                text = f"{_node_name(cur)} (through {' <- '.join(through)})"
            else:
                text = _node_name(cur)
            if text not in ops:
                ops.append(text)
        return ops


def _accumulated(node: Node) -> torch.Tensor | None:
    """The leaf an ``AccumulateGrad`` node writes to; ``None`` for every other node.

    Checked by name, not by a ``variable`` attribute alone: the node of a custom
    ``autograd.Function`` is its ``ctx``, where user code may store anything under any name.
    """
    if node.name() != "torch::autograd::AccumulateGrad":
        return None
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def _check_losses(losses: object, caller: str) -> list[torch.Tensor]:
    if isinstance(losses, torch.Tensor):
        return [losses]
    if isinstance(losses, Sequence) and not isinstance(losses, str):
        bad = [(i, type(t).__name__) for i, t in enumerate(losses) if not torch.is_tensor(t)]
        if not bad:
            return list(losses)
        raise IsolationTypeError(
            f"{caller}: every output must be a torch.Tensor; got {bad[0][1]} at index "
            f"{bad[0][0]}; pass the loss tensor itself (not loss.item())"
        )
    raise IsolationTypeError(
        f"{caller}: loss must be a torch.Tensor or a sequence of tensors, got "
        f"{type(losses).__name__}; pass the loss tensor itself (not loss.item())"
    )


def _walk(outputs: Sequence[torch.Tensor], caller: str) -> _Walk:
    """Walk every node reachable from ``outputs`` once, with a queue (no recursion).

    Breadth-first rather than depth-first: the cost is the same (each node and edge once),
    and the first route recorded to each node is a shortest one, which is the route a leak
    message should show.
    """
    walk = _Walk()
    queue: deque[Node] = deque()
    for out in outputs:
        if out.grad_fn is not None:
            if out.grad_fn not in walk.parent:
                walk.parent[out.grad_fn] = None
                queue.append(out.grad_fn)
        elif out.requires_grad:  # a leaf that is its own output reaches itself
            walk.leaves[id(out)] = out
    while queue:
        node = queue.popleft()
        variable = _accumulated(node)
        if variable is not None:  # the end of a path
            walk.leaves[id(variable)] = variable
            continue
        if _node_name(node) in _OPAQUE_OPS:
            walk.opaque.append(_node_name(node))
        for child, _ in node.next_functions:
            if child is None:
                continue
            leaf = _accumulated(child)
            if leaf is not None:
                walk.consumers.setdefault(id(leaf), []).append(node)
            if child not in walk.parent:
                walk.parent[child] = node
                queue.append(child)
    if walk.opaque:
        warnings.warn(
            f"{caller}: the graph holds {sorted(set(walk.opaque))}, which re-runs code in "
            f"backward; parameters used only inside it are invisible to the graph walk. "
            f"Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) to make them "
            f"visible",
            IsolationWarning,
            stacklevel=3,
        )
    return walk


def reachable_parameters(loss: Losses, model: nn.Module) -> tuple[str, ...]:
    """The names of the parameters of ``model`` that ``loss`` can send gradient to.

    Walks the autograd graph from ``loss.grad_fn`` through ``next_functions`` down to the
    ``AccumulateGrad`` nodes of the parameters. Nothing is computed and nothing is freed: the
    graph stays intact for the real backward, and the walk costs far less than one backward
    pass (each node is visited once, iteratively, so deep graphs are fine).

    Args:
        loss: a tensor, or a sequence of tensors (all their graphs are walked together).
        model: the module whose parameters are looked for.

    Returns:
        A tuple of parameter names in the order of ``model.named_parameters()``. A tied
        parameter appears under every one of its names. A loss without ``grad_fn`` (computed
        under ``no_grad``, or detached) reaches nothing: the tuple is empty.

    Raises:
        IsolationTypeError: ``loss`` is not a tensor or a sequence of tensors, or ``model``
            is not a module.

    Warns:
        IsolationWarning: the graph holds a reentrant checkpoint, whose insides it cannot see.

    Note:
        Reachability is structural: an edge in the graph counts even when the gradient along
        it is always zero (``p * 0``) or when a custom ``autograd.Function`` returns ``None``
        for that input. So the answer is an upper bound of where a backward can write, and a
        parameter *not* in it provably gets no gradient from ``loss``. The one blind spot is
        code that re-runs in backward and uses parameters that are not inputs of the node:
        ``torch.utils.checkpoint`` with ``use_reentrant=True`` (warned about) and custom
        Functions that close over parameters.

    >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    >>> x = torch.randn(2, 3)
    >>> reachable_parameters(model(x).sum(), model)
    ('0.weight', '0.bias', '1.weight', '1.bias')
    >>> reachable_parameters(model[1](model[0](x).detach()).sum(), model)
    ('1.weight', '1.bias')
    """
    caller = "reachable_parameters()"
    outputs = _check_losses(loss, caller)
    check_module(model, caller)
    walk = _walk(outputs, caller)
    return tuple(
        name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in walk.leaves
    )


# --------------------------------------------------------------------------------------------
# Naming what is protected


@dataclass(frozen=True)
class _Named:
    name: str
    tensor: torch.Tensor
    owner: str | None  # "'encoder.0' (Linear)" when it can be told


def _owner(root: nn.Module | None, name: str, prefix: str = "") -> str | None:
    if root is None:
        return None
    module_name = name.removeprefix(prefix).rpartition(".")[0]
    try:
        module = root.get_submodule(module_name)
    except AttributeError:
        return None
    shown = (prefix + module_name).rstrip(".") or "<root>"
    return f"{shown!r} ({type(module).__name__})"


def _split_items(target: object, caller: str) -> list[object]:
    if isinstance(target, (nn.Module, torch.Tensor, str)) or callable(target):
        return [target]
    if isinstance(target, Mapping):
        return list(target.items())
    if _is_pair(target):
        return [target]
    if isinstance(target, Iterable):
        return list(target)
    raise IsolationTypeError(
        f"{caller}: cannot tell which parameters {type(target).__name__} means; pass a "
        f"module, parameters, (name, parameter) pairs, or selector strings with model="
    )


def _is_pair(obj: object) -> TypeGuard[tuple[str, torch.Tensor]]:
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and isinstance(obj[0], str)
        and isinstance(obj[1], torch.Tensor)
    )


def _resolve(target: object, model: nn.Module | None, caller: str) -> list[_Named]:
    """Turn a :data:`Protected` value into named tensors, every alias listed, no repeats."""
    if model is not None:
        check_module(model, caller)
    items = _split_items(target, caller)
    names_of: dict[int, list[str]] = {}
    if model is not None:
        for name, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
    several_modules = sum(isinstance(item, nn.Module) for item in items) > 1
    out: dict[str, _Named] = {}

    def add(name: str, tensor: torch.Tensor, owner: str | None) -> None:
        out.setdefault(name, _Named(name, tensor, owner))

    for index, item in enumerate(items):
        if isinstance(item, nn.Module):
            if model is not None:
                prefixes = [n for n, m in model.named_modules(remove_duplicate=False) if m is item]
                if not prefixes:
                    raise SelectorError(
                        f"{caller}: the {type(item).__name__} passed is not a submodule of "
                        f"{describe(model)}; pass one of its own modules, or leave out model="
                    )
                prefix = prefixes[0] + "." if prefixes[0] else ""
                for name, p in item.named_parameters(remove_duplicate=False):
                    for full in names_of.get(id(p), [prefix + name]):
                        add(full, p, _owner(model, full))
            else:
                prefix = f"[{index}]." if several_modules else ""
                for name, p in item.named_parameters(remove_duplicate=False):
                    add(prefix + name, p, _owner(item, prefix + name, prefix))
        elif isinstance(item, torch.Tensor):
            known = names_of.get(id(item))
            if known:
                for full in known:
                    add(full, item, _owner(model, full))
            else:
                add(f"<tensor #{index}, shape {tuple(item.shape)}>", item, None)
        elif _is_pair(item):
            name, tensor = item
            known = names_of.get(id(tensor), [])
            add(name, tensor, _owner(model, name) if name in known else None)
        elif isinstance(item, str) or callable(item):
            if model is None:
                raise IsolationTypeError(
                    f"{caller}: the selector {item!r} needs the model to resolve against; "
                    f"pass model=, or pass the module or parameters themselves"
                )
            selection = select(model, (item,), caller)
            for p in selection.params.values():
                for full in names_of[id(p)]:
                    add(full, p, _owner(model, full))
        else:
            raise IsolationTypeError(
                f"{caller}: item {index} is a {type(item).__name__}; expected a module, a "
                f"parameter, a (name, parameter) pair, or a selector string with model="
            )
    if not out:
        raise SelectorError(
            f"{caller}: {type(target).__name__} names no parameter to check, so the check "
            f"would pass whatever the loss does; pass modules that hold parameters, and "
            f"lists rather than generators (a generator is empty the second time)"
        )
    return list(out.values())


# --------------------------------------------------------------------------------------------
# assert_isolated


def _short_path(path: list[str], keep: int = 3) -> str:
    if len(path) > 2 * keep + 1:
        path = [*path[:keep], f"... {len(path) - 2 * keep} more ...", *path[-keep:]]
    return " -> ".join(path)


def assert_isolated(loss: Losses, protected: Protected, *, model: nn.Module | None = None) -> None:
    """Raise if ``loss`` can send gradient to any protected parameter.

    Uses the same graph walk as :func:`reachable_parameters`: no backward pass, and the graph
    stays intact.

    Args:
        loss: a tensor or a sequence of tensors.
        protected: the parameters that must get no gradient from ``loss``; see
            :data:`Protected` (a module, modules, parameters, named parameters, or with
            ``model=`` selector strings).
        model: the whole model, to name parameters by their qualified names and to resolve
            selector strings.

    Raises:
        GradientLeakError: ``loss`` reaches protected parameters; the message lists every one
            with its owning module, the operation that consumes it (e.g. ``AddmmBackward0``)
            and a route from the loss.
        IsolationTypeError: an argument has the wrong type.
        SelectorError: a selector matched nothing, a module is not part of ``model``, or
            ``protected`` names no parameter at all (an exhausted generator, say).

    Note:
        A loss without ``grad_fn`` passes trivially: check that it was not computed under
        ``torch.no_grad()`` by mistake. Frozen parameters (``requires_grad=False``) pass too,
        but BatchNorm running statistics still move in train mode and optimizers still move
        parameters whose ``.grad`` is a zero tensor; use :func:`isolate.snapshot` for those.

    >>> encoder, head = nn.Linear(4, 4), nn.Linear(4, 1)
    >>> x = torch.randn(2, 4)
    >>> assert_isolated(head(encoder(x).detach()).sum(), encoder)
    >>> assert_isolated(head(encoder(x)).sum(), encoder)
    Traceback (most recent call last):
    ...
    isolate.errors.GradientLeakError: assert_isolated(): the loss reaches 2 of 2 protected ...
    """
    caller = "assert_isolated()"
    outputs = _check_losses(loss, caller)
    named = _resolve(protected, model, caller)
    walk = _walk(outputs, caller)
    leaked = [entry for entry in named if id(entry.tensor) in walk.leaves]
    if not leaked:
        return
    width = max(len(entry.name) for entry in leaked)
    lines = []
    routes: list[tuple[int, str, list[str]]] = []
    for entry in leaked:
        ops = walk.connecting_ops(entry.tensor)
        facts = []
        if entry.owner:
            facts.append(f"in {entry.owner}")
        if ops:
            facts.append(f"consumed by {', '.join(ops)}")
        lines.append(f"  {entry.name:<{width}}  {'; '.join(facts)}".rstrip())
        consumers = walk.consumers.get(id(entry.tensor))
        if consumers:
            path = [*walk.path(consumers[0]), "AccumulateGrad"]
            routes.append((len(path), entry.name, path))
    if routes:
        # The shortest route shows where the loss's graph enters the protected parameters.
        _, name, path = min(routes, key=lambda route: route[0])
        lines.append(f"Shortest route, to {name}: {_short_path(path, keep=5)}")
    raise GradientLeakError(
        f"{caller}: the loss reaches {len(leaked)} of {len(named)} protected parameters:\n"
        + "\n".join(lines)
        + "\nFix: cut the path where the branch starts (isolate.stop_gradient(features) or "
        "isolate.Detached(module)), or freeze the protected parameters (isolate.freeze)"
    )


# --------------------------------------------------------------------------------------------
# gradient_report


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
            group; ``None`` when either is missing or zero.
    """

    name: str
    parameters: tuple[str, ...]
    numel: int
    norms: Mapping[str, float | None]
    shares: Mapping[str, float | None]
    cosines: Mapping[tuple[str, str], float | None]

    def to_dict(self) -> dict[str, Any]:
        """Plain Python data; cosines are keyed ``"a|b"``."""
        return {
            "parameters": list(self.parameters),
            "numel": self.numel,
            "norm": dict(self.norms),
            "share": dict(self.shares),
            "cosine": {f"{a}|{b}": c for (a, b), c in self.cosines.items()},
        }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


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
            row = [stats.name, str(stats.numel)]
            for loss in self.losses:
                share = stats.shares[loss]
                row += [
                    _fmt(stats.norms[loss], ".3e"),
                    "-" if share is None else f"{100 * share:.1f}%",
                ]
            row += [_fmt(stats.cosines[pair], "+.3f") for pair in pairs]
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


def _group_members(
    model: nn.Module, groups: object, caller: str
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Group name -> (name, parameter) of every trainable parameter in it, model order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if groups is None:
        out: dict[str, list[tuple[str, nn.Parameter]]] = {}
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


@dataclass
class _Grams:
    """Per parameter, the K x K Gram matrix of the K losses' gradients, and which
    losses reach it: one matmul per parameter instead of K + K^2 / 2 reductions."""

    losses: tuple[str, ...]
    grams: dict[int, torch.Tensor]
    reached: dict[int, tuple[bool, ...]]

    @classmethod
    def of(
        cls, losses: tuple[str, ...], params: list[nn.Parameter], grads: list[Sequence[Any]]
    ) -> _Grams:
        grams: dict[int, torch.Tensor] = {}
        reached: dict[int, tuple[bool, ...]] = {}
        for j, p in enumerate(params):
            column = [grads[k][j] for k in range(len(losses))]
            hit = tuple(g is not None for g in column)
            if not any(hit):
                continue
            rows = torch.stack(
                [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g in column]
            )
            # One matmul in the gradients' own precision (a cast of every gradient to float64
            # would cost more than the products), summed up in float64 from there.
            grams[id(p)] = (rows @ rows.T).double()
            reached[id(p)] = hit
        return cls(losses, grams, reached)

    def total(self, ids: Iterable[int]) -> tuple[torch.Tensor | None, list[bool]]:
        gram: torch.Tensor | None = None
        hit = [False] * len(self.losses)
        for i in ids:
            if i in self.grams:
                gram = self.grams[i] if gram is None else gram + self.grams[i]
                hit = [a or b for a, b in zip(hit, self.reached[i], strict=True)]
        return gram, hit


def _stats(
    name: str,
    members: list[tuple[str, nn.Parameter]],
    grams: _Grams,
    totals: Mapping[str, float],
) -> GroupStats:
    unique = {id(p): p for _, p in members}
    gram, hit = grams.total(unique)
    values = gram.tolist() if gram is not None else None
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
            if values is None or not norm_a or not norm_b:
                cosines[(a, b)] = None
                continue
            cosines[(a, b)] = values[k][m] / (norm_a * norm_b)
    return GroupStats(
        name=name,
        parameters=tuple(n for n, _ in members),
        numel=sum(p.numel() for p in unique.values()),
        norms=norms,
        shares=shares,
        cosines=cosines,
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
    own backward can follow.

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
        IsolationTypeError: a loss is not a scalar tensor, or an argument has the wrong type.
        SelectorError: a group's selector matches no parameter.

    Note:
        Shares are of the *squared* norm, so they add up to 1 over non-overlapping groups. A
        norm of ``0.0`` (a path exists, the gradient along it is zero) and ``-`` (no path at
        all) are different answers: only the second one is isolation. Products are taken in
        the gradients' own precision (one K x K matmul per parameter) and summed in float64,
        so float32 gradients give norms and cosines to about 7 significant digits; for
        exact comparisons use :func:`gradient_invariance`.

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
    members = _group_members(model, groups, caller)
    everything = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = list({id(p): p for _, p in everything}.values())
    computed: list[Sequence[torch.Tensor | None]] = []
    for loss in losses.values():
        if params and loss.requires_grad:
            computed.append(
                torch.autograd.grad(loss.reshape(()), params, retain_graph=True, allow_unused=True)
            )
        else:
            computed.append([None] * len(params))
    names = tuple(losses)
    grams = _Grams.of(names, params, computed)
    whole, _ = grams.total(grams.grams)
    diagonal = whole.diagonal().tolist() if whole is not None else [0.0] * len(names)
    totals = dict(zip(names, diagonal, strict=True))
    return GradientReport(
        losses=names,
        groups={name: _stats(name, group, grams, totals) for name, group in members.items()},
        total=_stats("total", everything, grams, totals),
    )


# --------------------------------------------------------------------------------------------
# gradient_invariance


@dataclass(frozen=True)
class GradientInvariance:
    """How much the auxiliary losses change the main loss's gradients.

    Attributes:
        deltas: parameter name -> max |grad(total) - grad(main)| over its elements; exactly
            ``0.0`` for every parameter the auxiliary losses do not reach.
        max_delta: the largest of ``deltas`` (``0.0`` when there are none).
    """

    deltas: Mapping[str, float]
    max_delta: float

    @property
    def isolated(self) -> bool:
        """Whether every delta is exactly zero."""
        return self.max_delta == 0.0

    def changed(self, *, atol: float = 0.0) -> dict[str, float]:
        """The parameters whose delta exceeds ``atol``, largest first."""
        hits = {name: d for name, d in self.deltas.items() if not d <= atol}
        return dict(sorted(hits.items(), key=lambda item: -item[1]))


def _grad_delta(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is not None and b is not None:
        return max_abs_diff(a, b)
    if a is not None:
        return max_abs_diff(a, torch.zeros_like(a))
    if b is not None:
        return max_abs_diff(torch.zeros_like(b), b)
    return 0.0


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
    ``torch.autograd.grad(..., retain_graph=True, allow_unused=True)`` calls; ``.grad`` is
    never touched.

    Args:
        main_loss: the scalar loss the protected parameters should learn from.
        total_loss: the scalar objective; it must contain ``main_loss`` with weight 1.
        protected: the parameters to compare; see :data:`Protected`.
        model: the whole model, to name parameters and resolve selector strings.

    Returns:
        A :class:`GradientInvariance` with the per-name and overall max |delta|.

    Raises:
        IsolationTypeError: a loss is not a scalar tensor, or an argument has the wrong type.
        SelectorError: ``protected`` names no parameter, or a selector matches nothing.

    Note:
        ``total = 0.5 * main + aux`` changes every gradient by a factor of 0.5, so the deltas
        are not zero even when the isolation holds: weight the auxiliary terms, not the main
        loss. Frozen parameters get no gradient either way and report ``0.0``.

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
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss)
            raise IsolationTypeError(
                f"{caller}: {what} must be a scalar tensor, got {got}; reduce it first "
                f"(e.g. .mean())"
            )
    named = _resolve(protected, model, caller)
    trainable = list({id(e.tensor): e.tensor for e in named if e.tensor.requires_grad}.values())

    def grads(loss: torch.Tensor) -> dict[int, torch.Tensor | None]:
        if not trainable or not loss.requires_grad:
            return {}
        computed = torch.autograd.grad(
            loss.reshape(()), trainable, retain_graph=True, allow_unused=True
        )
        return {id(p): g for p, g in zip(trainable, computed, strict=True)}

    before, after = grads(main_loss), grads(total_loss)
    deltas = {e.name: _grad_delta(before.get(id(e.tensor)), after.get(id(e.tensor))) for e in named}
    values = list(deltas.values())
    overall = math.nan if any(map(math.isnan, values)) else max(values, default=0.0)
    return GradientInvariance(deltas=deltas, max_delta=overall)
