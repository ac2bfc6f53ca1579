"""Seeing into reentrant checkpoints: re-running a segment the way backward does.

``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` runs ``fn`` under
``no_grad`` and leaves one node, ``CheckpointFunctionBackward``, whose edges go only to the
tensor arguments; the parameters ``fn`` uses appear nowhere in the graph. Its backward runs
``fn`` again with grad enabled and backpropagates through that fresh graph. This module does
the same when an audit asks: :func:`recompute` rebuilds a segment's graph for a walk, and
:func:`differentiate` computes ``torch.autograd.grad`` through such nodes (which torch itself
refuses: "incompatible with .grad()"), with the gradients of parameters used inside the
segments returned like any other.

A re-run replays what backward replays: the forward's RNG state (so dropout draws the same
mask), its autocast state, and the saved arguments. It leaves the program as it found it:
the global RNG is forked, and buffers of the modules the segment's function holds (a
BatchNorm's running statistics) get their values back.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import types
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node
from torch.utils.checkpoint import CheckpointFunction, detach_variable, set_device_states

from isolate._rerun_safety import compiles, hooks_allow_fake, modules_in, restore, state_of
from isolate.errors import BlindSpotError

__all__ = [
    "Segment",
    "arguments_kept",
    "differentiate",
    "is_reentrant",
    "keep_arguments",
    "recompute",
    "recomputing",
    "shared_reruns",
]

Edge = tuple[Node | None, int]

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "isolate_recomputing", default=False
)


def recomputing() -> bool:
    """Whether an audit is re-running a checkpointed segment right now (hooks that record
    the user's forward should ignore what runs then)."""
    return _RECOMPUTING.get()


def is_reentrant(node: Node) -> bool:
    """Whether ``node`` is the backward of a reentrant ``torch.utils.checkpoint``."""
    return getattr(node, "_forward_cls", None) is CheckpointFunction


def _describe(node: Node) -> str:
    fn = getattr(node, "run_function", None)
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"the reentrant checkpoint of {name}"


@contextlib.contextmanager
def _buffers_kept(fn: object) -> Iterator[None]:
    """Give every buffer of the modules ``fn`` holds its value (and its slot) back on exit.

    A re-run in train mode updates BatchNorm statistics a second time; backward does that
    too, but an audit must not. Every buffer is copied back, changed or not: kernels update
    running statistics without bumping the version counter, so a changed one cannot be told
    cheaply. The copy goes through ``.data``, which leaves the version counter alone.
    """
    kept: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    for root in modules_in(fn):
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name, buf in module._buffers.items():
                if buf is not None:
                    kept.append((module, name, buf, buf.detach().clone()))
    try:
        yield
    finally:
        for module, name, buf, value in kept:
            module._buffers[name] = buf
            buf.data.copy_(value)


@contextlib.contextmanager
def _replay(node: Any) -> Iterator[None]:
    """The state a reentrant checkpoint's backward re-runs its segment in."""
    preserve = bool(node.preserve_rng_state)
    had_device = preserve and bool(getattr(node, "had_device_in_fwd", False))
    devices = list(node.fwd_devices) if had_device else []
    device_type = node.device_type
    token = _RECOMPUTING.set(True)
    try:
        with contextlib.ExitStack() as stack:
            # Forked even when the forward did not preserve the state: an audit must not
            # advance the program's random numbers.
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device_type))
            if preserve:
                torch.set_rng_state(node.fwd_cpu_state)
                if had_device:
                    set_device_states(devices, node.fwd_device_states, device_type=device_type)
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            if torch.amp.is_autocast_available(device_type):
                stack.enter_context(
                    torch.amp.autocast(device_type=device_type, **node.device_autocast_kwargs)
                )
            stack.enter_context(torch.amp.autocast("cpu", **node.cpu_autocast_kwargs))
            stack.enter_context(_buffers_kept(node.run_function))
            yield
    finally:
        _RECOMPUTING.reset(token)


_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


def _structure_only(t: torch.Tensor) -> torch.Tensor | None:
    """Pack hook of a re-run for a walk: keep no activation, only the arguments a nested
    reentrant checkpoint saves (the walk re-runs it from them)."""
    return t if sys._getframe(1).f_code.co_filename == _CHECKPOINT_FILE else None


def _never(packed: torch.Tensor | None) -> torch.Tensor:
    if packed is None:
        raise RuntimeError(
            "isolate re-ran this checkpointed segment only to walk its graph and kept none of "
            "its saved tensors; it cannot be backpropagated"
        )
    return packed


# reentrant node -> its saved arguments, read before a backward freed them (arguments_kept)
_KEPT: contextvars.ContextVar[Mapping[Node, tuple[torch.Tensor, ...]]] = contextvars.ContextVar(
    "isolate_kept_arguments", default=types.MappingProxyType({})
)


def keep_arguments(outputs: Sequence[torch.Tensor]) -> dict[Node, tuple[torch.Tensor, ...]]:
    """The saved arguments of every reentrant segment in the graphs of ``outputs``, read now.

    A backward without ``retain_graph=True`` frees them; a walk after it re-runs the
    segments from these inside :func:`arguments_kept`. Holding them costs what the
    checkpoints hold until backward (each segment's inputs), for as long as they are held.
    """
    found = _reentrant_in(outputs)
    return {node: tuple(node.saved_tensors) for node in found}  # type: ignore[attr-defined]


@contextlib.contextmanager
def arguments_kept(kept: Mapping[Node, tuple[torch.Tensor, ...]]) -> Iterator[None]:
    """Inside the block, a segment whose saved arguments a backward freed is re-run from
    ``kept`` (made by :func:`keep_arguments` before that backward)."""
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)


def _saved_arguments(node: Any, caller: str) -> tuple[torch.Tensor, ...]:
    try:
        return tuple(node.saved_tensors)
    except RuntimeError as error:
        kept = _KEPT.get().get(node)
        if kept is not None:
            return kept
        raise BlindSpotError(
            f"{caller}: cannot re-run {_describe(node)} to see which parameters it uses: its "
            f"saved arguments are gone ({error}). Fix: run the audit before backward, or "
            f"call backward(retain_graph=True)"
        ) from None


def _rerun(
    node: Any, caller: str, *, keep_saved: bool = True
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Run the segment of ``node`` again: (its detached arguments, its outputs).

    ``keep_saved=False`` drops what the new graph saves for backward: a walk needs only its
    structure, and holding every segment's activations at once would cost what
    checkpointing saves.
    """
    saved = _saved_arguments(node, caller)
    args = list(node.inputs)
    for i, index in enumerate(node.tensor_indices):
        args[index] = saved[i]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_replay(node))
        if not keep_saved:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_structure_only, _never))
        detached = detach_variable(tuple(args))
        try:
            outputs = node.run_function(*detached)
        except Exception as error:
            raise BlindSpotError(
                f"{caller}: re-running {_describe(node)}, as backward would, failed with "
                f"{type(error).__name__}: {error}; the parameters it uses cannot be seen. "
                f"Fix: use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), whose "
                f"graph shows them"
            ) from error
    return detached, (outputs if isinstance(outputs, tuple) else (outputs,))


def _rerun_structure(node: Any, caller: str) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """Run the segment of ``node`` again on fake tensors (shapes, no values, no arithmetic):
    the graph a walk needs, at a fraction of a forward's cost. None where the fake run cannot
    stand in for the real one (a value the code branches on, a module that kept something it
    computed, a forward hook not marked ``recompute_safe``, a process that has compiled
    code with torch.compile, whose compiled regions the walks must see as compiled): the
    caller then re-runs it for real. Modules are found as ``modules_in`` finds them (the
    function, its owner, a partial's arguments, a closure's cells).

    The graph is the real one's: autograd records each operation before the fake mode sees
    it, so the edges go to the real parameters; only the arithmetic is skipped.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if compiles() or not hooks_allow_fake(node.run_function):
        return None
    saved = _saved_arguments(node, caller)
    args = list(node.inputs)
    modules = state_of(node.run_function)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_replay(node))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_structure_only, _never))
            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            for i, index in enumerate(node.tensor_indices):
                fake = mode.from_tensor(saved[i].detach())
                args[index] = fake.requires_grad_(saved[i].requires_grad)
            outputs = node.run_function(*args)
    except Exception:  # any failure: the real re-run decides
        restore(modules)
        return None
    if restore(modules) or compiles():
        return None
    return tuple(args), (outputs if isinstance(outputs, tuple) else (outputs,))


def _edge(t: torch.Tensor) -> Edge:
    edge = torch.autograd.graph.get_gradient_edge(t)
    return edge.node, edge.output_nr


@dataclass
class Segment:
    """A reentrant segment re-run for a walk.

    Attributes:
        edges: where its backward starts: one edge per output that requires grad.
        bridges: id(detached argument) -> (that tensor, the node's edge to the original
            argument): a walk that reaches the detached argument continues there.
    """

    edges: list[Edge] = field(default_factory=list)
    bridges: dict[int, tuple[torch.Tensor, Edge]] = field(default_factory=dict)


# node -> its segment re-run, while shared_reruns() holds; None: every walk re-runs its own
_SHARED: contextvars.ContextVar[dict[Node, Segment] | None] = contextvars.ContextVar(
    "isolate_shared_reruns", default=None
)


@contextlib.contextmanager
def shared_reruns() -> Iterator[None]:
    """Re-run each reentrant segment at most once for every walk inside the block.

    The checks of one verification walk the same graph several times (the named losses,
    then the total's reach); a re-run costs the segment's forward where it cannot be done on
    fake tensors, and its graph's structure does not change between walks. What the re-runs
    built is let go on exit.
    """
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def recompute(node: Node, caller: str) -> Segment:
    """Re-run the segment of a reentrant checkpoint node, for a walk of its graph.

    Raises:
        BlindSpotError: the node's saved arguments were freed by a backward, or the segment
            fails when re-run.
    """
    shared = _SHARED.get()
    if shared is not None and node in shared:
        return shared[node]
    found = _rerun_structure(node, caller)
    detached, outputs = found if found is not None else _rerun(node, caller, keep_saved=False)
    segment = Segment(
        edges=[_edge(o) for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    )
    indices = node.tensor_indices  # type: ignore[attr-defined]
    for edge, index in zip(node.next_functions, indices, strict=True):
        arg = detached[index]
        if edge[0] is not None and arg.requires_grad:
            segment.bridges[id(arg)] = (arg, edge)
    if shared is not None:
        shared[node] = segment
    return segment


def _reentrant_in(outputs: Sequence[torch.Tensor]) -> list[Node]:
    """The reentrant checkpoint nodes in the graphs of ``outputs`` (not inside segments)."""
    queue: deque[Node] = deque(o.grad_fn for o in outputs if o.grad_fn is not None)
    seen = set(queue)
    found: list[Node] = []
    while queue:
        node = queue.popleft()
        if is_reentrant(node):
            found.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return found


_Grads = tuple[torch.Tensor | None, ...]


class _Session:
    """One :func:`differentiate` call: reentrant nodes answer through :meth:`_backward`,
    which adds what each segment gives the targets to ``inside``."""

    def __init__(self, targets: Sequence[torch.Tensor], caller: str) -> None:
        self.targets = list(targets)
        self.caller = caller
        self.inside: list[torch.Tensor | None] = [None] * len(self.targets)
        self.hooked: dict[Node, None] = {}

    def grad(
        self,
        outputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor] | None,
        extra: Sequence[torch.Tensor] = (),
    ) -> tuple[_Grads, _Grads]:
        """Gradients of ``outputs`` for the targets and for ``extra``."""
        nodes = _reentrant_in(outputs)
        for node in nodes:
            if node not in self.hooked:
                # PyNode::apply looks ``apply`` up on the node object, so an attribute set
                # on this one node replaces its backward, and only for this session.
                node.apply = functools.partial(self._backward, node)  # type: ignore[attr-defined]
                self.hooked[node] = None
        # A target used only inside segments is not in the graph: asking for the gradient
        # at every segment's arguments makes the engine run their nodes.
        forcing = [GradientEdge(c, nr) for n in nodes for c, nr in n.next_functions if c]
        # Tensors and edges mixed: the engine takes both (the annotation wants one kind).
        wanted: Any = [*self.targets, *extra, *forcing]
        got = torch.autograd.grad(
            outputs, wanted, grad_outputs, retain_graph=True, allow_unused=True
        )
        n, k = len(self.targets), len(extra)
        return tuple(got[:n]), tuple(got[n : n + k])

    def _backward(self, node: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        detached, outputs = _rerun(node, self.caller)
        pairs = [
            (o, torch.zeros_like(o) if g is None else g)
            for o, g in zip(outputs, grads, strict=False)
            if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        leaves = [d for d in detached if isinstance(d, torch.Tensor) and d.requires_grad]
        if not pairs:
            return (None, None, *([None] * len(detached)))
        mine, theirs = self.grad([o for o, _ in pairs], [g for _, g in pairs], leaves)
        for j, g in enumerate(mine):
            if g is not None:
                total = self.inside[j]
                self.inside[j] = g if total is None else total + g
        passed = iter(theirs)
        back = [
            next(passed) if isinstance(d, torch.Tensor) and d.requires_grad else None
            for d in detached
        ]
        return (None, None, *back)

    def close(self) -> None:
        for node in self.hooked:
            with contextlib.suppress(AttributeError):
                del node.apply  # type: ignore[attr-defined]
        self.hooked.clear()


def differentiate(
    loss: torch.Tensor, inputs: Sequence[torch.Tensor], caller: str
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)``, through
    reentrant checkpoints too: a parameter used inside a segment gets the gradient a real
    backward would write to its ``.grad``.

    Raises:
        BlindSpotError: a segment cannot be re-run (see :func:`recompute`), part of the
            graph was freed by a backward, or a tensor it saved was changed in place.
    """
    try:
        if not _reentrant_in([loss]):
            return torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
        session = _Session(inputs, caller)
        try:
            outside, _ = session.grad([loss], None)
        finally:
            session.close()
    except RuntimeError as error:
        if "modified by an inplace operation" in str(error):
            raise BlindSpotError(
                f"{caller}: a tensor the loss's graph saved was changed in place since the "
                f"forward (an optimizer.step(), an in-place operation), so its gradients cannot "
                f"be computed: {str(error).partition(' Hint:')[0]} Fix: run the audit before "
                f"the optimizer step, or on the loss of a new forward"
            ) from error
        if "backward through the graph a second time" not in str(error):
            raise
        raise BlindSpotError(
            f"{caller}: part of the loss's graph was freed by an earlier backward, so its "
            f"gradients cannot be computed (the backward of a reentrant checkpoint frees the "
            f"graph behind tensors its segment closes over, even under retain_graph=True). "
            f"Fix: run the audit before backward"
        ) from error
    return tuple(
        b if a is None else a if b is None else a + b
        for a, b in zip(outside, session.inside, strict=True)
    )
