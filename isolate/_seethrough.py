"""The edges a backward really follows from a node, for the audits' graph walk.

For most nodes these are ``node.next_functions``. Two kinds of node hide what backward does:

- a reentrant checkpoint (``CheckpointFunctionBackward``) runs its segment again in
  backward, through parameters the graph does not show: its edges are those of the
  re-run segment (:mod:`isolate._checkpointing`), and the segment's detached arguments
  lead back to the node's own edges;
- a compiled region (``CompiledFunctionBackward``) has an edge to every parameter it reads,
  used or not: only the edges along which gradient flows from the region's outputs that
  the loss reaches count (:mod:`isolate._compiled`). A walk may reach another output of a
  region it has expanded already: :meth:`SeeThrough.arrive` says so, and the region is then
  expanded again, for the edges that output adds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import Node

from isolate._checkpointing import is_reentrant, recompute
from isolate._compiled import is_compiled, live_edges

__all__ = ["SeeThrough"]

Edge = tuple[Node | None, int]
_ACCUMULATE = "torch::autograd::AccumulateGrad"


class SeeThrough:
    """The edges of each node for one walk; holds the segments re-run so far.

    >>> x = torch.ones(2, requires_grad=True)
    >>> y = (x * 2).sum()
    >>> [child.name() for child, _ in SeeThrough("doc").edges(y.grad_fn)]
    ['MulBackward0']
    """

    def __init__(self, caller: str) -> None:
        self.caller = caller
        # id(detached argument of a re-run segment) -> (the tensor, kept alive so that its id
        # stays unique; the checkpoint node's edge to the original argument)
        self._bridges: dict[int, tuple[torch.Tensor, Edge]] = {}
        # compiled region -> the outputs reached so far, and the edges already given out
        self._outputs: dict[Node, set[int]] = {}
        self._given: dict[Node, set[Edge]] = {}

    def arrive(self, node: Node, output: int) -> bool:
        """Note that the walk reaches output ``output`` of ``node``; True when ``node`` is a
        compiled region already expanded, for which that output is new."""
        if not is_compiled(node):
            return False
        outputs = self._outputs.setdefault(node, set())
        if output in outputs:
            return False
        outputs.add(output)
        return node in self._given

    def edges(self, node: Node) -> Sequence[Edge]:
        """Where gradient goes from ``node``: its edges as backward follows them (for a
        compiled region expanded again, only the edges not given before)."""
        if is_reentrant(node):
            segment = recompute(node, self.caller)
            self._bridges.update(segment.bridges)
            raw: Sequence[Edge] = segment.edges
        elif is_compiled(node):
            given = self._given.setdefault(node, set())
            live = live_edges(node, self._outputs.get(node, set()), self.caller)
            raw = [edge for edge in live if edge not in given]
            given.update(raw)
        else:
            raw = node.next_functions
        if not self._bridges:
            return raw
        return [self._across(edge) for edge in raw]

    def _across(self, edge: Edge) -> Edge:
        """A detached argument of a re-run segment stands for the checkpoint's argument."""
        child = edge[0]
        while child is not None and child.name() == _ACCUMULATE:
            bridge = self._bridges.get(id(getattr(child, "variable", None)))
            if bridge is None:
                break
            edge = bridge[1]
            child = edge[0]
        return edge
