"""Seeing into ``torch.compile``: which inputs of a compiled region get a gradient.

AOTAutograd runs a compiled region's forward as one autograd node, ``CompiledFunctionBackward``,
whose edges go to every tensor input that requires grad: every parameter the region reads,
even one it reads only through ``.detach()``. The edges alone would make every such parameter
look reached. The region's backward graph (kept by AOTAutograd to compile backward lazily)
says more: its output for an input is ``None`` when no gradient flows to it, and otherwise
depends on the gradients ("tangents") of some of the region's outputs. A walk that knows
which outputs the loss reaches keeps only the inputs those outputs send gradient to: the
eager answer. (A compiled backward materialises a zero gradient for an output the loss does
not use, and writes zeros to the ``.grad`` of what only that output reaches, where eager
autograd writes nothing.)

A region is compiled for the ``requires_grad`` of its inputs at the time. Dynamo's guards
normally see a flipped flag and compile again, but a ``guard_filter_fn`` that drops the guards
of nn modules (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``) lets the old region run:
after a thaw its backward has no gradient for the thawed parameters. The walk names such a
region (:class:`~isolate.errors.StaleCompileError`), and :func:`forget_compiled` makes dynamo
compile every region again.

Nothing here imports ``torch._dynamo`` (:func:`forget_compiled` uses it only when something
imported it already): a compiled node carries everything that is read.
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import Node

from isolate.errors import BlindSpotError, StaleCompileError

__all__ = ["compiled_in", "forget_compiled", "is_compiled", "live_edges"]

_COMPILED = "CompiledFunctionBackward"
# The output kinds whose gradients reach backward as tangents (AOTAutograd's backward
# prologue); other outputs are regenerated as views outside the region.
_DIFFERENTIABLE = frozenset({"non_alias", "unsafe_view_alias", "custom_function_view"})


def is_compiled(node: object) -> bool:
    """Whether ``node`` is the backward of a region that AOTAutograd compiled (by class
    name first: the walk asks this of every edge)."""
    return type(node).__name__ == _COMPILED and hasattr(
        getattr(node, "_forward_cls", None), "metadata"
    )


def _donates(forward_cls: Any) -> bool:
    """Whether the region's backward is compiled to reuse the memory of saved tensors, which
    torch refuses under ``retain_graph=True``. A backward not compiled yet is compiled
    without that when its first run keeps the graph."""
    from torch._functorch import config

    return bool(
        config.donated_buffer
        and getattr(forward_cls.metadata, "bw_donated_idxs", None)
        and getattr(forward_cls, "compiled_bw", None) is not None
    )


def compiled_in(outputs: Sequence[torch.Tensor], caller: str) -> bool:
    """Whether the graphs of ``outputs`` hold a compiled region.

    Raises:
        BlindSpotError: a region's backward reuses ("donates") the memory of tensors it
            saved, so it cannot run while the graph is kept for the training step's own
            backward, as ``torch.autograd.grad(..., retain_graph=True)`` needs.
    """
    queue = deque(o.grad_fn for o in outputs if o.grad_fn is not None)
    seen = set(queue)
    found = False
    while queue:
        node = queue.popleft()
        if is_compiled(node):
            found = True
            forward_cls = node._forward_cls  # type: ignore[attr-defined]
            if _donates(forward_cls):
                raise BlindSpotError(
                    f"{caller}: the backward of {_region_name(forward_cls)} reuses the memory "
                    f"of tensors it saved (donated buffers), so it cannot run while the graph "
                    f"is kept for the training step's backward. Fix: set "
                    f"torch._functorch.config.donated_buffer = False before compiling, or "
                    f"measure gradients on the model before torch.compile"
                )
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return found


@dataclass(frozen=True)
class _Region:
    """What a compiled region's backward graph says, per forward argument and output.

    Attributes:
        masks: per forward argument (tensors and symbolic sizes), ``None`` when backward
            returns no gradient for it, else a bit mask of the tangents it depends on.
        slots: per tangent, the region's output (the node's gradient input) it belongs to.
    """

    masks: tuple[int | None, ...]
    slots: tuple[int, ...]


# compiled region (its autograd.Function class) -> what its backward graph says
_REGIONS: weakref.WeakKeyDictionary[Any, _Region] = weakref.WeakKeyDictionary()


def _backward_graph(forward_cls: Any) -> Any:
    """The region's backward FX graph, kept to compile backward lazily (as a graph module,
    or serialized when the compile came from AOTAutograd's cache)."""
    info = getattr(forward_cls, "_lazy_backward_info", None)
    module = getattr(info, "bw_module", None)
    if module is None and callable(getattr(info, "bw_module_fn", None)):
        module = info.bw_module_fn()  # type: ignore[union-attr]
    return getattr(module, "graph", None)


def _tangent_slots(metadata: Any) -> tuple[int, ...]:
    """The output each tangent belongs to, in the order AOTAutograd's backward prologue
    passes them: mutated inputs, then plain outputs, then intermediate bases."""
    inputs = metadata.input_info
    mutated = list(metadata.mutated_inp_runtime_indices)
    slots = [i for i, k in enumerate(mutated) if inputs[k].mutates_data and inputs[k].requires_grad]
    for i, info in enumerate(metadata.output_info):
        if (
            info.output_type.name in _DIFFERENTIABLE
            and issubclass(info.raw_type, torch.Tensor)
            and info.requires_grad_for_backward
        ):
            slots.append(len(mutated) + i)
    start = len(mutated) + metadata.num_outputs
    slots.extend(range(start, start + metadata.num_intermediate_bases))
    return tuple(slots)


def _read(forward_cls: Any) -> _Region | None:
    """Read a region's backward graph once (``None`` when it is not there to read)."""
    if forward_cls in _REGIONS:
        return _REGIONS[forward_cls]
    graph = _backward_graph(forward_cls)
    if graph is None or getattr(forward_cls, "maybe_subclass_metadata", None) is not None:
        return None
    try:
        slots = _tangent_slots(forward_cls.metadata)
    except (AttributeError, TypeError):
        return None
    depends: dict[Any, int] = {}
    tangents = 0
    returned: Any = None
    for fx_node in graph.nodes:
        if fx_node.op == "placeholder":
            is_tangent = str(fx_node.target).startswith("tangents")
            depends[fx_node] = 1 << tangents if is_tangent else 0
            tangents += is_tangent
        elif fx_node.op == "output":
            returned = fx_node.args[0]
        else:
            mask = 0
            for parent in fx_node.all_input_nodes:
                mask |= depends.get(parent, 0)
            depends[fx_node] = mask
    if tangents != len(slots) or not isinstance(returned, (tuple, list)):
        return None
    region = _Region(
        masks=tuple(None if out is None else depends.get(out, 0) for out in returned),
        slots=slots,
    )
    _REGIONS[forward_cls] = region
    return region


def _region_name(forward_cls: Any) -> str:
    """How a message names a compiled region: the code torch.compile traced, and its id."""
    compile_id = getattr(getattr(forward_cls, "metadata", None), "compile_id_str", None)
    info = getattr(forward_cls, "_lazy_backward_info", None)
    codes = getattr(getattr(info, "saved_context", None), "traced_code", None) or []
    shown = "a torch.compile region"
    if codes:
        code = codes[0]
        name = getattr(code, "co_qualname", code.co_name)
        shown = f"the torch.compile region {name} ({code.co_filename}:{code.co_firstlineno})"
    return f"{shown}, graph {compile_id}" if compile_id else shown


def live_edges(node: Node, outputs: Collection[int], caller: str) -> list[tuple[Node | None, int]]:
    """The edges of a compiled region's node along which gradient flows from ``outputs``
    (the region's outputs the loss reaches, as indices of the node's gradient inputs).

    The backward graph has one output per forward argument (tensors and symbolic sizes);
    the node has one edge per tensor argument, ``None`` for those that do not require grad.
    ``needs_input_grad`` (one flag per argument) lines the two up: the k-th argument that
    requires grad is the k-th edge that is not ``None``.

    Raises:
        BlindSpotError: the region's backward graph is not kept (a backend that compiles
            backward ahead of time without it), or it does not line up with the node
            (tensor subclasses, a layout this torch version changed).
    """
    forward_cls = node._forward_cls  # type: ignore[attr-defined]
    region = _read(forward_cls)
    needs = tuple(getattr(node, "needs_input_grad", ()))
    edges = [edge for edge in node.next_functions if edge[0] is not None]
    if region is None or len(region.masks) != len(needs) or sum(needs) != len(edges):
        raise BlindSpotError(
            f"{caller}: cannot see which inputs of {_region_name(forward_cls)} get a "
            f"gradient: its backward graph is not available in a form isolate can read "
            f"(torch {torch.__version__}), and the node's edges list every parameter the "
            f"region reads, used or not. Fix: run the audit on the model before "
            f"torch.compile (same forward, same answer), or compile with the 'inductor' or "
            f"'aot_eager' backend"
        )
    _refuse_stale(node, needs, caller)
    reached = 0
    for k, slot in enumerate(region.slots):
        if slot in outputs:
            reached |= 1 << k
    live: list[tuple[Node | None, int]] = []
    flags = iter(edges)
    for needed, mask in zip(needs, region.masks, strict=True):
        if not needed:
            continue
        edge = next(flags)
        # A gradient that depends on no tangent (a constant) flows whenever the region does.
        if mask is not None and (mask & reached or (mask == 0 and outputs)):
            live.append(edge)
    return live


def _refuse_stale(node: Node, needs: Sequence[bool], caller: str) -> None:
    """Raise when the region runs with inputs that require grad now but did not when it was
    compiled: its backward graph has no output for them, whatever the loss reaches.

    Raises:
        StaleCompileError: such inputs exist, named by the tensors their edges accumulate into.
        BlindSpotError: the region's record of its inputs does not line up with the node.
    """
    forward_cls = node._forward_cls  # type: ignore[attr-defined]
    inputs = getattr(forward_cls.metadata, "input_info", None)
    if inputs is None or len(inputs) != len(needs):
        raise BlindSpotError(
            f"{caller}: cannot tell which inputs of {_region_name(forward_cls)} required grad "
            f"when it was compiled (torch {torch.__version__}). Fix: run the audit on the "
            f"model before torch.compile (same forward, same answer)"
        )
    edges = iter(edge for edge in node.next_functions if edge[0] is not None)
    stale: list[torch.Tensor] = []
    for needed, info in zip(needs, inputs, strict=True):
        if not needed:
            continue
        child = next(edges)[0]
        if not info.requires_grad:
            variable = getattr(child, "variable", None)
            if isinstance(variable, torch.Tensor):
                stale.append(variable)
    if stale:
        shapes = ", ".join(str(tuple(t.shape)) for t in stale)
        error = StaleCompileError(
            f"{caller}: {_region_name(forward_cls)} was compiled while {len(stale)} of its "
            f"inputs (shapes {shapes}) did not require grad, and runs now that they do: its "
            f"backward has no gradient for them, so they never learn (dynamo's guards did not "
            f"see the flip, as under a guard_filter_fn that skips nn-module or parameter "
            f"guards). "
            f"Fix: thaw through the spec (IsolationSpec thaws make dynamo compile again), call "
            f"torch._dynamo.reset_code_caches() after flipping flags by hand, or compile "
            f"without the guard filter"
        )
        error.tensors = tuple(stale)
        raise error


def forget_compiled() -> int:
    """Make dynamo compile every region again at its next call; return how many code objects
    it had compiled (0 when nothing was compiled: torch's compiler is not even imported).

    A flag flip that dynamo's guards do not see (see the module's docstring) would otherwise
    leave regions compiled for the old flags running. Dropping them costs one compile each;
    the regions that read a flipped parameter would compile again anyway under torch's
    default guards.

    >>> forget_compiled() >= 0
    True
    """
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo import convert_frame, reset_code_caches

    compiled = [ref() for ref in convert_frame.input_codes.seen]
    count = sum(code is not None for code in compiled)
    if count:
        reset_code_caches()
    return count
