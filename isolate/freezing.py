"""Freezing parameter subsets, with an exact undo.

``freeze`` / ``unfreeze`` change ``requires_grad`` (and, by policy, the mode of BatchNorm
layers) and return a :class:`FreezeHandle` whose ``restore()`` writes back exactly what was
there; ``frozen`` / ``unfrozen`` are their context-manager forms and :class:`Frozen` their
module twin.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from isolate._selectors import Selector, check_module, is_float, select
from isolate._tree import iter_tensors
from isolate._wrapping import Wrapper
from isolate.drift import Exposure, optimizer_exposure
from isolate.errors import IsolationTypeError, IsolationWarning, RestoreError, SelectorError

__all__ = ["FreezeHandle", "Frozen", "freeze", "frozen", "is_frozen", "unfreeze", "unfrozen"]

BNPolicy = Literal["eval", "train"]
_BN_POLICIES = ("eval", "train")

_F = TypeVar("_F", bound=Callable[..., Any])


def _outside_compile(fn: _F) -> _F:
    """Keep ``fn`` out of compiled graphs: a flag flipped while tracing would be baked in."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


_sequence = itertools.count()
_active: weakref.WeakSet[FreezeHandle] = weakref.WeakSet()


class _NormPolicy:
    """The stack of BatchNorm policies pushed on one module, and the hook that enforces the top.

    A forward pre-hook is used rather than an override of ``train()`` because Lightning's
    evaluation loop restores modes by assigning ``module.training`` directly.
    """

    def __init__(self, module: nn.Module) -> None:
        self.stack: list[tuple[int, str]] = []
        self.hook: RemovableHandle = module.register_forward_pre_hook(self._enforce)

    def _enforce(self, module: nn.Module, args: Any) -> None:
        if self.stack[-1][1] == "eval":
            module.training = False


_norm_policies: weakref.WeakKeyDictionary[nn.Module, _NormPolicy] = weakref.WeakKeyDictionary()


def _push_policy(module: nn.Module, seq: int, policy: str) -> None:
    state = _norm_policies.get(module)
    if state is None:
        state = _norm_policies[module] = _NormPolicy(module)
    state.stack.append((seq, policy))


def _pop_policy(module: nn.Module, seq: int) -> None:
    state = _norm_policies.get(module)
    if state is None:
        return
    state.stack = [entry for entry in state.stack if entry[0] != seq]
    if not state.stack:
        state.hook.remove()
        del _norm_policies[module]


class FreezeHandle:
    """The undo of one :func:`freeze` or :func:`unfreeze` call.

    Attributes:
        names: the parameter names the call selected, in model order.
        norms: the BatchNorm layers whose policy the call set, by name.
        exposures: with ``freeze(..., optimizer=...)``, the frozen parameters that optimizer
            holds in a param group where a zero-filled ``.grad`` would still move them.
    """

    def __init__(
        self,
        model: nn.Module,
        caller: str,
        params: dict[str, nn.Parameter],
        norms: dict[str, nn.Module],
        requires_grad: bool,
        bn: str,
    ) -> None:
        self._seq = next(_sequence)
        self._caller = caller
        self._model_name = type(model).__name__
        self.names: tuple[str, ...] = tuple(params)
        self.exposures: tuple[Exposure, ...] = ()
        self.norms: tuple[str, ...] = tuple(norms)
        # Parallel lists, not (p, flag) tuples: 10,000 small tuples cost more (allocation and
        # the garbage collections they trigger) than the flag flips themselves.
        self._params = list(params.values())
        self._flags = [p.requires_grad for p in self._params]
        self._modules = [(m, m.training) for m in norms.values()]
        self._active = True
        # Everything above was recorded before this point; only now does state change.
        if requires_grad:
            for p in self._params:
                p.requires_grad_(True)
        else:
            for p in self._params:
                p.requires_grad_(False)
                if p.grad is not None:
                    # A zero-filled grad would still let weight decay and momentum move p.
                    p.grad = None
        train_mode = model.training
        for m in norms.values():
            _push_policy(m, self._seq, bn)
            m.training = False if bn == "eval" else train_mode
        _active.add(self)

    @property
    def active(self) -> bool:
        """Whether :meth:`restore` has yet to be called."""
        return self._active

    @_outside_compile
    def restore(self) -> None:
        """Write back the ``requires_grad`` flags and BatchNorm modes recorded at the call.

        Gradients dropped when freezing are not brought back: they would be stale.

        Raises:
            RestoreError: if the handle was restored already, or if a newer handle that
                touches the same parameters or layers is still active (restore that first).
        """
        if not self._active:
            raise RestoreError(f"{self._caller}: this handle was restored already; restore once")
        newer = [h for h in list(_active) if h._seq > self._seq and h._active and h._touches(self)]
        if newer:
            names = sorted({n for h in newer for n in h.names if n in self.names})
            raise RestoreError(
                f"{self._caller}: restored out of order: {len(newer)} newer handle(s) still "
                f"hold parameters this one set ({names[:5]}...); restore the newest first, "
                f"or use the context managers frozen()/unfrozen(), which nest correctly"
            )
        for p, flag in zip(self._params, self._flags, strict=True):
            p.requires_grad_(flag)
        for m, training in self._modules:
            _pop_policy(m, self._seq)
            m.training = training
        self._active = False
        _active.discard(self)

    def _ids(self) -> set[int]:
        return {id(p) for p in self._params} | {id(m) for m, _ in self._modules}

    def _touches(self, other: FreezeHandle) -> bool:
        # Computed only when handles nest, so a lone freeze/restore pays nothing for it.
        return not self._ids().isdisjoint(other._ids())

    def __repr__(self) -> str:
        state = "active" if self._active else "restored"
        return (
            f"FreezeHandle({self._caller.rstrip('()')} on {self._model_name}: "
            f"{len(self.names)} parameters, {len(self.norms)} BatchNorm layers, {state})"
        )


def _check_bn(bn: object, caller: str) -> str:
    if bn not in _BN_POLICIES:
        raise SelectorError(
            f"{caller}: bn={bn!r} is not a BatchNorm policy; expected one of {list(_BN_POLICIES)}"
        )
    return str(bn)


@_outside_compile
def freeze(
    model: nn.Module,
    *selectors: Selector,
    bn: BNPolicy = "eval",
    optimizer: torch.optim.Optimizer | None = None,
) -> FreezeHandle:
    """Stop the selected parameters from learning and return the undo.

    Sets ``requires_grad=False`` and drops ``.grad`` of every selected parameter. Parameter
    objects are never replaced, so optimizers and checkpoints keep working.

    Args:
        model: the module that holds the parameters.
        *selectors: which parameters: submodules, dotted module names (``"trunk"``), globs
            over parameter names (``"trunk.*"``, ``"*.bias"``), parameters, or predicates
            ``fn(name, parameter) -> bool``. None means the whole model.
        bn: the policy for BatchNorm layers within the selection. ``"eval"`` holds them in
            eval mode, so their running statistics stay fixed even when a parent module or
            Lightning calls ``.train()``; ``"train"`` lets them follow the model's mode and
            update their statistics.
        optimizer: an optimizer to check: frozen parameters it still holds in a param group
            with weight decay or momentum are listed in the handle's ``exposures`` and in an
            :class:`~isolate.errors.IsolationWarning`, since a zero-filled ``.grad`` would
            still move them.

    Returns:
        A :class:`FreezeHandle`; its ``restore()`` puts back exactly what was there.

    Raises:
        SelectorError: a selector matched nothing or is malformed; nothing was changed.
        IsolationTypeError: ``model`` is not a module, a selector has the wrong type, or
            ``optimizer`` is not an optimizer.

    Note:
        ``requires_grad=False`` alone does not freeze BatchNorm running statistics, which is
        why ``bn="eval"`` is the default. Optimizers still move parameters whose ``.grad`` is
        a zero tensor (weight decay, momentum); ``freeze`` sets ``.grad`` to ``None`` so they
        don't, but a parameter frozen *after* an optimizer step may still carry momentum
        state. DDP only syncs parameters that required grad when it was built: freeze before
        wrapping.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    >>> handle = freeze(model, "0", "1")
    >>> [p.requires_grad for p in model.parameters()]
    [False, False, False, False, True, True]
    >>> handle.restore()
    >>> all(p.requires_grad for p in model.parameters())
    True
    """
    caller = "freeze()"
    check_module(model, caller)
    policy = _check_bn(bn, caller)
    if optimizer is not None and not isinstance(
        getattr(optimizer, "optimizer", optimizer), torch.optim.Optimizer
    ):
        raise IsolationTypeError(
            f"{caller}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    selection = select(model, selectors, caller)
    handle = FreezeHandle(model, caller, selection.params, dict(selection.norms), False, policy)
    if optimizer is not None:
        chosen = set(handle.names)
        exposed = [
            e for e in optimizer_exposure(optimizer, model) if e.at_risk and e.name in chosen
        ]
        handle.exposures = tuple(exposed)
        if exposed:
            groups = sorted({e.group for e in exposed})
            warnings.warn(
                f"{caller}: optimizer param group(s) {groups} still hold {len(exposed)} frozen "
                f"parameter(s), e.g. {exposed[0]}. Their .grad is None now, so no built-in "
                f"optimizer moves them, but a zero-filled .grad would; take them out of the "
                f"optimizer or set weight_decay/momentum to 0 for them",
                IsolationWarning,
                stacklevel=3,
            )
    return handle


@_outside_compile
def unfreeze(model: nn.Module, *selectors: Selector, bn: BNPolicy = "train") -> FreezeHandle:
    """Let the selected parameters learn again and return the undo.

    The opposite of :func:`freeze`, with the same selectors. With ``bn="train"`` (the
    default) BatchNorm layers in the selection follow the model's mode again, even where an
    earlier :func:`freeze` held them in eval mode.

    Raises:
        SelectorError: a selector matched nothing or is malformed; nothing was changed.
        IsolationTypeError: a selected parameter is not floating point, so autograd cannot
            track it.

    >>> model = nn.Linear(2, 1)
    >>> outer = freeze(model)
    >>> inner = unfreeze(model, "bias")
    >>> model.weight.requires_grad, model.bias.requires_grad
    (False, True)
    >>> inner.restore(); outer.restore()
    >>> model.weight.requires_grad, model.bias.requires_grad
    (True, True)
    """
    caller = "unfreeze()"
    check_module(model, caller)
    policy = _check_bn(bn, caller)
    selection = select(model, selectors, caller)
    integral = [name for name, p in selection.params.items() if not is_float(p)]
    if integral:
        raise IsolationTypeError(
            f"{caller}: parameters {integral} are not floating point, so they cannot require "
            f"grad; leave them out of the selection (e.g. with a predicate)"
        )
    return FreezeHandle(model, caller, selection.params, dict(selection.norms), True, policy)


@contextlib.contextmanager
def frozen(
    model: nn.Module,
    *selectors: Selector,
    bn: BNPolicy = "eval",
    optimizer: torch.optim.Optimizer | None = None,
) -> Iterator[FreezeHandle]:
    """Context-manager form of :func:`freeze`: restores on exit, exceptions included.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> with frozen(model, "0.*") as handle:
    ...     handle.names
    ('0.weight', '0.bias')
    >>> model[0].weight.requires_grad
    True
    """
    handle = freeze(model, *selectors, bn=bn, optimizer=optimizer)
    try:
        yield handle
    finally:
        if handle.active:
            handle.restore()


@contextlib.contextmanager
def unfrozen(
    model: nn.Module, *selectors: Selector, bn: BNPolicy = "train"
) -> Iterator[FreezeHandle]:
    """Context-manager form of :func:`unfreeze`: restores on exit, exceptions included."""
    handle = unfreeze(model, *selectors, bn=bn)
    try:
        yield handle
    finally:
        if handle.active:
            handle.restore()


def is_frozen(model: nn.Module, *selectors: Selector) -> bool:
    """Whether every selected parameter has ``requires_grad=False``.

    >>> model = nn.Linear(2, 1)
    >>> with frozen(model, "weight"):
    ...     is_frozen(model, "weight"), is_frozen(model)
    (True, False)
    """
    check_module(model, "is_frozen()")
    selection = select(model, selectors, "is_frozen()")
    return not any(p.requires_grad for p in selection.params.values())


def _any_requires_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(t.requires_grad for t in iter_tensors((args, kwargs)))


class Frozen(Wrapper):
    """A module whose parameters never learn and whose BatchNorm statistics never move.

    When grad mode is off or no input requires grad, the forward runs under
    ``torch.no_grad()``: no graph is recorded, so the wrapped module keeps no activation
    memory. When an input requires grad, gradient still flows *through* the module to its
    inputs, but not into its parameters.

    The wrapped module is ``.module``; ``state_dict`` keys are those of the wrapped module
    (no ``module.`` infix), so checkpoints load with or without the wrapper. Parameter names
    from ``named_parameters()`` do contain the ``module.`` infix.

    Args:
        module: the module to freeze.

    Raises:
        WrappingError: ``module`` is already wrapped, or has a live :class:`Frozen`.

    >>> trunk = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    >>> frozen_trunk = Frozen(trunk).train()
    >>> out = frozen_trunk(torch.randn(8, 4))
    >>> out.grad_fn is None, trunk[1].training
    (True, False)
    >>> frozen_trunk.unwrap() is trunk
    True
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self._handle = freeze(module, bn="eval")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and _any_requires_grad(args, kwargs):
            return self.module(*args, **kwargs)
        with torch.no_grad():
            return self.module(*args, **kwargs)

    def unwrap(self) -> nn.Module:
        """Restore the wrapped module's flags and modes and return it."""
        if self._handle.active:
            self._handle.restore()
        return super().unwrap()
