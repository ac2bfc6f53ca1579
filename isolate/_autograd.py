"""The walk of an autograd graph every audit shares: one queue, each node and edge once.

Nothing is computed and nothing is freed: the graph stays intact for the real backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn
from torch.autograd.graph import Node

from isolate._checkpointing import differentiate
from isolate._compiled import compiled_in
from isolate._seethrough import SeeThrough
from isolate._sharding import check_leaves, is_flat_parameter, sharded_view
from isolate.errors import BlindSpotError, IsolationTypeError, ShardedGraphError

__all__ = [
    "Losses",
    "Walk",
    "check_loss_mapping",
    "check_losses",
    "check_real",
    "check_scalar",
    "gradients_of",
    "graph_inputs",
    "node_name",
    "refuse_raising",
    "walk",
]

T = TypeVar("T", bound=torch.Tensor)

Losses = torch.Tensor | Sequence[torch.Tensor]
"""One output tensor, or several (a list or tuple of tensors)."""

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


# Nodes whose backward only raises: a Function marked ``@once_differentiable`` differentiated
# again (its edges go to stand-in leaves, not to what the backward used), or a derivative
# torch does not implement.
_STAND_INS = "torch::autograd::Error"
_RAISING = frozenset({_STAND_INS, "torch::autograd::NotImplemented"})


def node_name(node: Node) -> str:
    return node.name().removeprefix("torch::autograd::")


@dataclass
class Walk:
    """What one walk of an autograd graph found, keyed on tensor identity."""

    # id(leaf tensor) -> the leaf; leaves that are outputs themselves have no node.
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)
    # id(leaf tensor) -> the nodes that feed gradient into its AccumulateGrad node.
    consumers: dict[int, list[Node]] = field(default_factory=dict)
    # every node seen -> the node it was first reached from (None for the outputs' own nodes).
    # Holding the node objects also keeps their Python wrappers alive, so identity is stable.
    parent: dict[Node, Node | None] = field(default_factory=dict)
    # nodes whose backward raises, in the order found
    raising: list[Node] = field(default_factory=list)

    def path(self, node: Node) -> list[str]:
        """Node names from an output down to ``node`` along the first-found route."""
        names: list[str] = []
        cur: Node | None = node
        while cur is not None:
            names.append(node_name(cur))
            cur = self.parent[cur]
        return names[::-1]

    def connecting_ops(self, tensor: torch.Tensor) -> list[str]:
        """The operations that consume ``tensor``, looking through layout-only nodes."""
        ops: list[str] = []
        for consumer in self.consumers.get(id(tensor), []):
            through: list[str] = []
            cur: Node | None = consumer
            while cur is not None and node_name(cur) in _LAYOUT_OPS:
                through.append(node_name(cur))
                cur = self.parent[cur]
            if cur is None:
                text = " <- ".join(through)
            elif through:
                text = f"{node_name(cur)} (through {' <- '.join(through)})"
            else:
                text = node_name(cur)
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


def check_losses(losses: object, caller: str) -> list[torch.Tensor]:
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


def check_loss_mapping(losses: Mapping[str, object], caller: str) -> list[torch.Tensor]:
    """The losses of a mapping, refusing one that is not a tensor by its key."""
    bad = [(key, type(t).__name__) for key, t in losses.items() if not torch.is_tensor(t)]
    if bad:
        raise IsolationTypeError(
            f"{caller}: every loss must be a torch.Tensor; got {bad[0][1]} under "
            f"{bad[0][0]!r}; pass only the loss tensors (not metrics, not loss.item())"
        )
    return list(losses.values())  # type: ignore[arg-type]


def check_real(what: str, loss: torch.Tensor, caller: str) -> None:
    """Refuse a complex loss: autograd differentiates real losses only."""
    if loss.is_complex():
        raise IsolationTypeError(
            f"{caller}: {what} must be a real scalar tensor, got a {str(loss.dtype)[6:]} "
            f"scalar; take its real part or its absolute value first (e.g. .abs())"
        )


def check_scalar(what: str, loss: object, caller: str) -> None:
    """Refuse a loss that is not a real scalar tensor."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if torch.is_tensor(loss) else type(loss).__name__
        raise IsolationTypeError(
            f"{caller}: {what} must be a scalar tensor, got {got}; reduce it first (e.g. .mean())"
        )
    check_real(what, loss, caller)


def walk(
    outputs: Sequence[torch.Tensor],
    caller: str,
    *,
    stop: Callable[[Node], bool] | None = None,
) -> Walk:
    """Walk every node reachable from ``outputs`` once, with a queue (no recursion).

    Breadth-first rather than depth-first: the cost is the same (each node and edge once),
    and the first route recorded to each node is a shortest one, which is the route a leak
    message should show. Edges are taken as backward follows them (:class:`SeeThrough`):
    a reentrant checkpoint's segment is re-run to show what it uses, and a compiled region
    only leads to the inputs its backward graph sends gradient to.

    Raises:
        BlindSpotError: a reentrant segment cannot be re-run, or a compiled region's
            backward graph cannot be read.
    A node for which ``stop`` is true is recorded but not walked through: what lies only
    behind it counts as not reached (a route through a module that is allowed, a gradient
    scale).
    """
    found = Walk()
    see = SeeThrough(caller)
    queue: deque[Node] = deque()
    for out in outputs:
        if out.grad_fn is not None:
            see.arrive(out.grad_fn, out.output_nr)
            if out.grad_fn not in found.parent:
                found.parent[out.grad_fn] = None
                queue.append(out.grad_fn)
        elif out.requires_grad:  # a leaf that is its own output reaches itself
            found.leaves[id(out)] = out
    while queue:
        node = queue.popleft()
        variable = _accumulated(node)
        if variable is not None:  # the end of a path
            found.leaves[id(variable)] = variable
            continue
        if node.name() in _RAISING:
            found.raising.append(node)
        if stop is not None and stop(node):
            continue
        for child, output in see.edges(node):
            if child is None:
                continue
            leaf = _accumulated(child)
            if leaf is not None:
                found.consumers.setdefault(id(leaf), []).append(node)
            widened = see.arrive(child, output)
            if child not in found.parent:
                found.parent[child] = node
                queue.append(child)
            elif widened:  # a compiled region reached through another of its outputs
                queue.append(child)
    return found


def refuse_raising(found: Walk, caller: str, *, walk_only: bool = False) -> None:
    """Refuse a graph that runs through a node whose backward raises.

    A real backward of the loss fails there, and ``autograd.grad`` returns the other paths'
    part of a gradient as if it were all of it. With ``walk_only=True`` (an audit that only
    walks the graph) a derivative torch does not implement passes, since its edges are
    those of the operation; a ``@once_differentiable`` Function's do not: they go to
    stand-in leaves, and what lies behind it looks unreached.

    Raises:
        BlindSpotError: naming the node and the operation it is reached from.
    """
    nodes = [n for n in found.raising if not walk_only or n.name() == _STAND_INS]
    if not nodes:
        return
    node = nodes[0]
    before = found.parent[node]
    consumer = f" (consumed by {node_name(before)})" if before is not None else ""
    raise BlindSpotError(
        f"{caller}: the loss's graph runs through {node.name()}{consumer}, whose backward "
        f"raises (a Function marked @once_differentiable, differentiated again, or a "
        f"derivative torch does not implement): a real backward fails there, and what lies "
        f"behind it cannot be measured. Fix: give the Function a backward that is itself "
        f"differentiable, or leave its gradient out of the loss (no create_graph=True "
        f"through it)"
    )


def graph_inputs(
    losses: Sequence[torch.Tensor],
    roots: Sequence[nn.Module],
    params: Sequence[T],
    caller: str,
) -> list[T]:
    """The tensors to differentiate ``losses`` with respect to, one per parameter of
    ``params``: its FSDP2 unsharded temporary where it has one, else the parameter.

    Walks the losses' graphs first (far cheaper than the gradients) and refuses, like
    :func:`check_leaves`, leaves that stand for parameters but cannot be mapped; without
    that, ``autograd.grad(..., allow_unused=True)`` would return ``None`` for every sharded
    parameter, and a report would read "not reached" where the loss does reach.

    Raises:
        ShardedGraphError: as :func:`check_leaves`.
        BlindSpotError: the graph runs through a node whose backward raises: a real backward
            fails there, and ``autograd.grad`` returns the other paths' part only.
    """
    view = sharded_view(roots, caller)
    flat_model = any(is_flat_parameter(p) for r in roots for p in r.parameters())
    outputs = [t for t in losses if t.requires_grad]
    if outputs:
        found = walk(outputs, caller)
        refuse_raising(found, caller)
        check_leaves(found, roots, caller, view=view, tensors=params)
    if flat_model:
        raise ShardedGraphError(
            f"{caller}: the model holds FSDP1 FlatParameters (FullyShardedDataParallel): the "
            f"gradient of one parameter is a slice of a flat gradient that autograd cannot "
            f"return alone; compute the report on the model before wrapping it, or shard it "
            f"with fully_shard (FSDP2)"
        )
    return [view.leaf(p) for p in params]


def gradients_of(
    loss: torch.Tensor, inputs: Sequence[torch.Tensor], caller: str
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of a scalar loss, ``None`` for every input it does not reach.

    Reentrant checkpoints are seen through (:func:`differentiate`). A compiled region's
    backward sends a zero gradient back from an output the loss does not use, where eager
    autograd sends none: the walk of the graph, which gives the eager answer, says which
    inputs are reached.

    Raises:
        BlindSpotError: a segment cannot be re-run, part of the graph was freed, or a
            compiled region's backward cannot run on a kept graph (donated buffers).
    """
    compiled = compiled_in([loss], caller)
    grads = differentiate(loss.reshape(()), inputs, caller)
    if not compiled:
        return grads
    reached = walk([loss], caller).leaves
    return tuple(g if id(t) in reached else None for g, t in zip(grads, inputs, strict=True))
