"""Proving where gradient can go, without running a backward pass.

:func:`reachable_parameters` walks the autograd graph of a loss and names the parameters it
can send gradient to; :func:`assert_isolated` turns that into an assertion that names every
leak and the operation behind it.
"""

from __future__ import annotations

from torch import nn

from isolate._autograd import Losses, check_losses, refuse_raising, walk
from isolate._protected import Protected, resolve_named
from isolate._selectors import check_module
from isolate._sharding import check_leaves, roots_of
from isolate.errors import GradientLeakError, IsolationTypeError

__all__ = ["assert_isolated", "reachable_parameters"]


def reachable_parameters(loss: Losses, model: nn.Module) -> tuple[str, ...]:
    """The names of the parameters of ``model`` that ``loss`` can send gradient to.

    Walks the autograd graph from ``loss.grad_fn`` through ``next_functions`` down to the
    ``AccumulateGrad`` nodes of the parameters. Nothing is freed: the graph stays intact for
    the real backward, and the walk costs far less than one backward pass (each node is
    visited once, iteratively, so deep graphs are fine). Only a reentrant checkpoint's
    segment is computed again, once, keeping none of its activations.

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
        ShardedGraphError: the graph's leaves stand for parameters of ``model`` that the walk
            cannot map back (FSDP1 flat parameters, views of a hidden leaf); FSDP2
            (``fully_shard``) temporaries are mapped to their sharded parameters.
        BlindSpotError: a reentrant checkpoint's segment cannot be re-run (its saved inputs
            were freed by a backward, or it fails), a compiled region's backward graph
            cannot be read, or the graph runs through a node whose backward raises (a
            Function marked ``@once_differentiable`` in a gradient penalty).

    Note:
        Reachability is structural: an edge in the graph counts even when the gradient along
        it is always zero (``p * 0``) or when a custom ``autograd.Function`` returns ``None``
        for that input. So the answer is an upper bound of where a backward can write, and a
        parameter *not* in it provably gets no gradient from ``loss``. A reentrant checkpoint
        (``use_reentrant=True``) uses parameters its node does not show: its segment is
        re-run once, as backward re-runs it (same RNG state, buffers restored afterwards),
        and the walk goes through the new graph; as in backward, every output of the segment
        sends gradient back (a zero one from an output the loss does not use). A
        ``torch.compile`` region's node has an edge to every parameter it reads; only those
        its backward graph sends gradient to from the outputs the loss uses count, which is
        the eager answer. The one blind spot left is a custom ``autograd.Function`` that
        closes over parameters.

    >>> import torch
    >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    >>> x = torch.randn(2, 3)
    >>> reachable_parameters(model(x).sum(), model)
    ('0.weight', '0.bias', '1.weight', '1.bias')
    >>> reachable_parameters(model[1](model[0](x).detach()).sum(), model)
    ('1.weight', '1.bias')
    """
    caller = "reachable_parameters()"
    outputs = check_losses(loss, caller)
    check_module(model, caller)
    found = walk(outputs, caller)
    refuse_raising(found, caller, walk_only=True)
    check_leaves(found, [model], caller)  # FSDP2 temporaries -> their parameters, or refuse
    return tuple(
        name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in found.leaves
    )


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
        IsolationTypeError: an argument has the wrong type, or ``loss`` is an empty sequence.
        SelectorError: a selector matched nothing, a module is not part of ``model``, or
            ``protected`` names no parameter at all (an exhausted generator, say).
        ShardedGraphError: as :func:`reachable_parameters`; also sharded parameters passed
            without ``model=`` and outside the modules passed.
        BlindSpotError: as :func:`reachable_parameters`.

    Note:
        A loss without ``grad_fn`` passes trivially: check that it was not computed under
        ``torch.no_grad()`` by mistake. Frozen parameters (``requires_grad=False``) pass too,
        but BatchNorm running statistics still move in train mode and optimizers still move
        parameters whose ``.grad`` is a zero tensor; use :func:`isolate.snapshot` for those.

    >>> import torch
    >>> encoder, head = nn.Linear(4, 4), nn.Linear(4, 1)
    >>> x = torch.randn(2, 4)
    >>> assert_isolated(head(encoder(x).detach()).sum(), encoder)
    >>> assert_isolated(head(encoder(x)).sum(), encoder)
    Traceback (most recent call last):
    ...
    isolate.errors.GradientLeakError: assert_isolated(): the loss reaches 2 of 2 protected ...
    """
    caller = "assert_isolated()"
    outputs = check_losses(loss, caller)
    if not outputs:
        raise IsolationTypeError(
            f"{caller}: loss is an empty sequence, so there is nothing to prove isolated (a "
            f"branch that produced no loss, an emptied config list); pass the loss tensors"
        )
    named = resolve_named(protected, model, caller)
    found = walk(outputs, caller)
    refuse_raising(found, caller, walk_only=True)
    tensors = [entry.tensor for entry in named]
    check_leaves(found, roots_of(protected, model), caller, tensors=tensors)
    leaked = [entry for entry in named if id(entry.tensor) in found.leaves]
    if not leaked:
        return
    width = max(len(entry.name) for entry in leaked)
    lines = []
    routes: list[tuple[int, str, list[str]]] = []
    for entry in leaked:
        ops = found.connecting_ops(entry.tensor)
        facts = []
        if entry.owner:
            facts.append(f"in {entry.owner}")
        if ops:
            facts.append(f"consumed by {', '.join(ops)}")
        lines.append(f"  {entry.name:<{width}}  {'; '.join(facts)}".rstrip())
        consumers = found.consumers.get(id(entry.tensor))
        if consumers:
            path = [*found.path(consumers[0]), "AccumulateGrad"]
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
