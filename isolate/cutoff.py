"""Isolation the other way round: the trainable parameters that no loss reaches.

:func:`cut_off_parameters` walks the same autograd graph as
:func:`isolate.reachability.reachable_parameters` and names every trainable parameter that no
given loss
can send gradient to, with the reason where it can be told; :func:`assert_reached` turns that
into an assertion. Run the forward inside :func:`trace_forward` to learn *why* a parameter is
cut off (its module did not run, ran under ``no_grad``, ran inside a reentrant checkpoint
whose inputs do not require grad, or its output was detached on the way to the loss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.utils.checkpoint import CheckpointFunction

from isolate._autograd import Losses, Walk, check_loss_mapping, check_losses, refuse_raising, walk
from isolate._checkpointing import recomputing
from isolate._rerun_safety import recompute_safe
from isolate._selectors import Selector, check_module, select
from isolate._sharding import check_leaves
from isolate.errors import CutOffError, IsolationTypeError, SelectorError

__all__ = ["CutOff", "ForwardTrace", "assert_reached", "cut_off_parameters", "trace_forward"]

# The frames of a reentrant checkpoint: its forward runs the segment under no_grad, its
# backward runs it again with grad. The node of a Python autograd Function is its ``ctx``.
_CHECKPOINT_CODES: frozenset[CodeType] = frozenset(
    {CheckpointFunction.forward.__code__, CheckpointFunction.backward.__code__}
)

_FIX_CHECKPOINT = (
    "make the segment's input require grad (x.requires_grad_(); in transformers, "
    "model.enable_input_require_grads()) or use torch.utils.checkpoint.checkpoint(..., "
    "use_reentrant=False)"
)


@dataclass
class _Call:
    """One call of one module, as the hooks of :func:`trace_forward` saw it."""

    order: int
    grad_enabled: bool
    input_has_graph: bool
    # The CheckpointFunctionBackward node of the reentrant checkpoint the call ran inside,
    # and whether that checkpoint's inputs required grad.
    checkpoint: Node | None = None
    checkpoint_inputs_grad: bool = False
    outputs: list[Node | torch.Tensor] = field(default_factory=list)
    returned_tensors: bool = False  # any tensor found in the output, with a graph or not

    def reaches(self, found: Walk) -> bool:
        return any(
            (o in found.parent) if isinstance(o, Node) else (id(o) in found.leaves)
            for o in self.outputs
        )


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's inputs or outputs, as far as plain containers go, in order.

    Lenient on purpose, unlike ``isolate._tree``: the trace runs inside the user's forward
    and must never break it. What it misses only makes a reason vaguer; which parameters
    are cut off comes from the graph walk alone. Iterative, each container once: any depth,
    and a container that holds itself ends.
    """
    stack, seen = [obj], set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
            continue
        if id(item) in seen:
            continue
        if isinstance(item, (list, tuple)):
            inside = list(item)
        elif isinstance(item, Mapping):
            inside = list(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            inside = [getattr(item, f.name, None) for f in dataclasses.fields(item)]
        else:
            continue
        seen.add(id(item))
        stack.extend(reversed(inside))


def _enclosing_checkpoint() -> tuple[Node | None, bool]:
    """The reentrant checkpoint node whose forward is on the stack, if any."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _CHECKPOINT_CODES:
            ctx = frame.f_locals.get("ctx")
            args = frame.f_locals.get("args", ())
            inputs_grad = any(t.requires_grad for t in _tensors(args))
            return (ctx if isinstance(ctx, Node) else None), inputs_grad
        frame = frame.f_back  # type: ignore[assignment]
    return None, False


class ForwardTrace:
    """Which modules of a model ran, how, and what they returned; see :func:`trace_forward`.

    Holding a trace keeps the graph nodes of the traced outputs alive: drop it after the
    check.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.calls: dict[int, list[_Call]] = {}
        self._pending: dict[int, list[_Call]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._count = 0
        self._watched = {id(m) for m in model.modules()}

    @recompute_safe
    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if recomputing():  # an audit re-running a checkpointed segment, not the forward
            return
        grad = torch.is_grad_enabled()
        tensors = [*_tensors(args), *_tensors(kwargs)]
        call = _Call(
            order=self._count,
            grad_enabled=grad,
            input_has_graph=any(t.requires_grad for t in tensors),
        )
        self._count += 1
        if not grad:  # a reentrant checkpoint runs its segment under no_grad
            call.checkpoint, call.checkpoint_inputs_grad = _enclosing_checkpoint()
        self._pending.setdefault(id(module), []).append(call)

    @recompute_safe
    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        pending = self._pending.get(id(module))
        if not pending:
            return
        call = pending.pop()
        for t in _tensors(output):
            call.returned_tensors = True
            if t.grad_fn is not None:
                call.outputs.append(t.grad_fn)
            elif t.requires_grad:
                call.outputs.append(t)
        self.calls.setdefault(id(module), []).append(call)

    def watches(self, module: nn.Module) -> bool:
        """Whether the trace has hooks (or had, before :meth:`remove`) on ``module``."""
        return id(module) in self._watched

    def ran(self, module: nn.Module) -> bool:
        """Whether ``module`` was called while the trace was recording."""
        return bool(self.calls.get(id(module)))

    def remove(self) -> None:
        """Remove the hooks; what was recorded stays readable."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@contextlib.contextmanager
def trace_forward(model: nn.Module) -> Iterator[ForwardTrace]:
    """Record which modules of ``model`` run in the block, so a cut-off can be explained.

    Registers a forward pre-hook and a forward hook on every module of ``model`` and removes
    them on exit, also when the block raises. Pass the trace to :func:`cut_off_parameters` or
    :func:`assert_reached` as ``trace=``.

    Args:
        model: the module whose submodules are watched.

    Yields:
        A :class:`ForwardTrace`.

    Raises:
        IsolationTypeError: ``model`` is not a module.

    Note:
        The hooks cost a few microseconds per module call: trace the step you check, not
        every step. Modules called only through ``module.forward(...)`` (not ``module(...)``)
        skip hooks and read as "did not run".

    >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    >>> with trace_forward(model) as trace:
    ...     loss = model[1](model[0](torch.randn(2, 3)).detach()).sum()
    >>> cut = cut_off_parameters(loss, model, trace=trace)
    >>> list(cut.parameters)
    ['0.weight', '0.bias']
    >>> cut.parameters["0.weight"].split(":")[0]
    "'0' (Linear) ran, but its output does not reach the loss"
    """
    check_module(model, "trace_forward()")
    trace = ForwardTrace(model)
    try:
        for module in model.modules():
            trace._handles.append(module.register_forward_pre_hook(trace._pre, with_kwargs=True))
            trace._handles.append(module.register_forward_hook(trace._post, with_kwargs=True))
        yield trace
    finally:
        trace.remove()


@dataclass(frozen=True)
class CutOff:
    """The trainable parameters that no loss reaches; see :func:`cut_off_parameters`.

    Attributes:
        parameters: parameter name -> why it is cut off (with the fix where one is known),
            in model order. A tied parameter appears under every one of its names.
        expected_unused: parameters declared unused with ``expected_unused=`` that no loss
            reached; they are not cut off.
        trainable: how many trainable parameter names were checked.
    """

    parameters: Mapping[str, str]
    expected_unused: tuple[str, ...] = ()
    trainable: int = 0

    @property
    def clean(self) -> bool:
        """True when every trainable parameter is reached or expected to be unused."""
        return not self.parameters

    def __str__(self) -> str:
        lines = [
            f"{len(self.parameters)} of {self.trainable} trainable parameters get no gradient "
            f"from any loss" + (":" if self.parameters else "")
        ]
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.parameters.items():
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            lines.append(f"  {', '.join(names)}: {reason}")
        if self.expected_unused:
            lines.append(f"expected unused: {', '.join(self.expected_unused)}")
        return "\n".join(lines)


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """id(parameter) -> every (module name, module) that holds it directly."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append((name, module))
    return owners


def _shown(name: str, module: nn.Module) -> str:
    return f"{name or '<root>'!r} ({type(module).__name__})"


_GENERIC = (
    "no path from any loss in the autograd graph (its module did not run, ran under "
    "no_grad or inside a reentrant checkpoint whose inputs do not require grad, or its "
    "output was detached); run the forward inside isolate.cutoff.trace_forward(model) and pass "
    "trace= to be told which"
)

_NO_GRAPH = (
    "no loss has a graph (computed under torch.no_grad(), detached, or from frozen parameters only)"
)


def _diagnose(
    owners: list[tuple[str, nn.Module]],
    trace: ForwardTrace | None,
    found: Walk,
    entries: list[tuple[int, str]],
) -> str:
    """Why the parameters held by ``owners`` are cut off, as far as the trace tells."""
    traced = [(n, m, trace.calls.get(id(m), [])) for n, m in owners if trace and trace.watches(m)]
    if not traced:
        return _GENERIC
    ran = [(name, module, calls) for name, module, calls in traced if calls]
    if not ran:
        name, module, _ = traced[0]
        return (
            f"{_shown(name, module)} did not run in the traced forward (a branch or group the "
            f"forward skips on this path)"
        )
    name, module, calls = ran[0]
    shown = _shown(name, module)
    in_checkpoint = [c for c in calls if c.checkpoint is not None]
    if in_checkpoint:
        if not any(c.checkpoint_inputs_grad for c in in_checkpoint):
            return (
                f"{shown} ran inside a reentrant checkpoint whose inputs do not require grad, "
                f"so the segment's output carries no graph. Fix: {_FIX_CHECKPOINT}"
            )
        return f"{shown} ran inside a reentrant checkpoint whose output does not reach the loss"
    if not any(c.grad_enabled for c in calls):
        return (
            f"{shown} ran with gradient tracking off (torch.no_grad(), inference_mode), so "
            f"its output carries no graph. Fix: run it with grad enabled"
        )
    if any(c.reaches(found) for c in calls):
        return (
            f"{shown} ran and its output reaches the loss, but not through this parameter "
            f"(read through .detach() or .data, or not used in forward)"
        )
    if all(c.returned_tensors and not c.outputs for c in calls):
        return (
            f"{shown} ran with grad enabled, but its output carries no graph: its forward "
            f"does not use this parameter, reads it through .detach() or .data, or detaches "
            f"what it returns"
        )
    text = (
        f"{shown} ran, but its output does not reach the loss: it is detached "
        f"(stop_gradient, .detach(), Detached) on the way, or feeds a loss that is not "
        f"passed in"
    )
    first = min(c.order for c in calls)
    later = [entry for order, entry in entries if order > first]
    if later:
        text += f"; the loss's graph starts again at {later[0]}, whose input carries no graph"
    return text


def _check_expected(
    model: nn.Module, expected_unused: Selector | Sequence[Selector], caller: str
) -> set[int]:
    if isinstance(expected_unused, (list, tuple)):
        selectors = tuple(expected_unused)
    else:
        selectors = (expected_unused,)
    if not selectors:
        return set()
    return {id(p) for p in select(model, selectors, caller).params.values()}


def _cut_off(
    losses: Losses | Mapping[str, torch.Tensor],
    model: nn.Module,
    expected_unused: Selector | Sequence[Selector],
    trace: ForwardTrace | None,
    caller: str,
) -> CutOff:
    if isinstance(losses, Mapping):
        losses = check_loss_mapping(losses, caller)
    outputs = check_losses(losses, caller)
    check_module(model, caller)
    if trace is not None and not isinstance(trace, ForwardTrace):
        raise IsolationTypeError(
            f"{caller}: trace must be the ForwardTrace of isolate.cutoff.trace_forward(model), got "
            f"{type(trace).__name__}"
        )
    excused = _check_expected(model, expected_unused, caller)
    found = walk(outputs, caller)
    refuse_raising(found, caller, walk_only=True)
    check_leaves(found, [model], caller)  # FSDP2 temporaries -> their parameters, or refuse
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    missing = [(n, p) for n, p in named if id(p) not in found.leaves]
    if not missing:
        return CutOff({}, trainable=len(named))
    owners = _owners(model)
    no_graph = all(out.grad_fn is None for out in outputs)
    entries: list[tuple[int, str]] = []
    if trace is not None:
        modules = {id(m): (n, m) for n, m in model.named_modules()}
        for key, calls in trace.calls.items():
            for c in calls:
                if key in modules and not c.input_has_graph and c.reaches(found):
                    entries.append((c.order, _shown(*modules[key])))
        entries.sort()
    parameters: dict[str, str] = {}
    expected: list[str] = []
    reasons: dict[int, str] = {}
    for name, p in missing:
        if id(p) in excused:
            expected.append(name)
            continue
        if id(p) not in reasons:
            reason = _diagnose(owners.get(id(p), []), trace, found, entries)
            # The trace tells why a loss has no graph (a reentrant checkpoint, no_grad);
            # without it, that there is none is all that can be said.
            reasons[id(p)] = _NO_GRAPH if no_graph and reason == _GENERIC else reason
        parameters[name] = reasons[id(p)]
    return CutOff(parameters, tuple(expected), trainable=len(named))


def cut_off_parameters(
    losses: Losses | Mapping[str, torch.Tensor],
    model: nn.Module,
    *,
    expected_unused: Selector | Sequence[Selector] = (),
    trace: ForwardTrace | None = None,
) -> CutOff:
    """The trainable parameters of ``model`` that no loss can send gradient to, and why.

    The dual of :func:`isolate.reachability.reachable_parameters`, from the same walk of the
    autograd
    graph (no backward pass, the graph stays intact): a trainable parameter that no loss
    reaches will keep its value, however training looks.

    Args:
        losses: a loss tensor, a sequence of them, or a mapping of names to them; a
            parameter counts as reached when any of them reaches it.
        model: the module whose trainable parameters (``requires_grad=True``) are checked.
        expected_unused: selectors, as in :func:`isolate.freeze`, for parameters that may
            go unused on this step (a mixture-of-experts expert that no token was routed
            to); reported under ``expected_unused``, never as cut off. A selector that
            matches nothing is an error.
        trace: the :class:`ForwardTrace` of a forward run inside :func:`trace_forward`, to
            say why each parameter is cut off and to see which parameters ran inside a
            reentrant checkpoint.

    Returns:
        A :class:`CutOff`; ``.parameters`` maps each cut-off name to its reason, empty when
        every trainable parameter is reached.

    Raises:
        IsolationTypeError: an argument has the wrong type.
        SelectorError: an ``expected_unused`` selector matches no parameter.
        BlindSpotError: as :func:`isolate.reachability.reachable_parameters`: a reentrant checkpoint
            cannot be re-run, a compiled region's backward graph cannot be read, or the graph
            runs through a node whose backward raises.

    Note:
        Reachability is structural: a parameter with an exactly zero gradient through a
        live path (a classifier head initialised to zero) is reached, not cut off. A
        reentrant checkpoint (``use_reentrant=True``) that reaches the loss is re-run once,
        as backward re-runs it, to see the parameters it uses; one whose inputs do not
        require grad has no node in the graph, so its parameters are cut off (as a real
        backward finds), and ``trace=`` says why. Under ``torch.compile`` a parameter the
        compiled forward only reads through ``.detach()`` is cut off, as in eager.

    >>> model = nn.ModuleDict({"body": nn.Linear(3, 3), "unused": nn.Linear(3, 1)})
    >>> loss = model["body"](torch.randn(2, 3)).sum()
    >>> list(cut_off_parameters(loss, model).parameters)
    ['unused.weight', 'unused.bias']
    >>> cut_off_parameters(loss, model, expected_unused="unused").clean
    True
    """
    return _cut_off(losses, model, expected_unused, trace, "cut_off_parameters()")


def assert_reached(
    losses: Losses | Mapping[str, torch.Tensor],
    model: nn.Module,
    *,
    expected_unused: Selector | Sequence[Selector] = (),
    trace: ForwardTrace | None = None,
) -> None:
    """Raise unless every trainable parameter of ``model`` is reached by some loss.

    Args:
        losses: as in :func:`cut_off_parameters`.
        model: as in :func:`cut_off_parameters`.
        expected_unused: as in :func:`cut_off_parameters`.
        trace: as in :func:`cut_off_parameters`.

    Raises:
        CutOffError: trainable parameters get no gradient from any loss; the message names
            each one with its reason and the fix.
        BlindSpotError: the walk cannot see part of the graph (see
            :func:`cut_off_parameters`): the check refuses rather than guess.
        IsolationTypeError: an argument has the wrong type.
        SelectorError: an ``expected_unused`` selector matches no parameter, or nothing is
            left to prove: no parameter of ``model`` is trainable, or each one is expected
            unused and not reached.

    >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    >>> x = torch.randn(2, 3)
    >>> assert_reached(model(x).sum(), model)
    >>> assert_reached(model[1](model[0](x).detach()).sum(), model)
    Traceback (most recent call last):
    ...
    isolate.errors.CutOffError: assert_reached(): 2 of 4 trainable parameters get no gradient ...
    """
    __tracebackhide__ = True
    caller = "assert_reached()"
    result = _cut_off(losses, model, expected_unused, trace, caller)
    if result.trainable == len(result.expected_unused):
        total = sum(1 for _ in model.parameters())
        unused = len(result.expected_unused)
        excused = f", and {unused} of them expected unused" if unused else ""
        raise SelectorError(
            f"{caller}: nothing to prove: {result.trainable} of the {total} parameters of "
            f"{type(model).__name__} are trainable{excused}, so this assertion could never "
            f"fail. Assert it where the parameters that must learn require grad (before a "
            f"freeze, or after their thaw)"
        )
    if result.parameters:
        raise CutOffError(
            f"{caller}: {result}\nFix: connect them to the loss, freeze them "
            f"(isolate.freeze) if they are not meant to learn, or declare them with "
            f"expected_unused= if they are unused on this step by design"
        )
