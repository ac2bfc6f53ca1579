"""Freezing parameter subsets, with an exact undo.

``freeze`` / ``unfreeze`` change ``requires_grad`` (and, by policy, the mode of BatchNorm
layers, or with ``mode=`` of every module whose behaviour depends on its mode) and return a
:class:`FreezeHandle` whose ``restore()`` writes back exactly what was there; ``frozen`` /
``unfrozen`` are their context-manager forms and :class:`Frozen` their module twin;
:func:`held_in_eval` says which modules a hold keeps in eval mode, :func:`reads_training`
which modules a mode matters to.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Collection, Iterator
from typing import Any, Literal

import torch
from torch import nn

from isolate._flags import HandleSequence, check_params, outside_compile, whole_module, write_flags
from isolate._holding import (
    check_policy,
    held_policy,
    policy_of,
    pop_hold,
    push_hold,
    reads_training,
)
from isolate._selectors import Selector, check_module, select
from isolate._text import warn_user
from isolate._tree import iter_tensors
from isolate._wrapping import Wrapper
from isolate.errors import RestoreError
from isolate.exposure import Exposure, optimizer_exposure, unwrap_optimizer

__all__ = [
    "FreezeHandle",
    "Frozen",
    "freeze",
    "frozen",
    "held_in_eval",
    "is_frozen",
    "reads_training",
    "unfreeze",
    "unfrozen",
]

BNPolicy = Literal["eval", "train"]
Mode = Literal["eval", "train"]


_sequence = HandleSequence()
_active: weakref.WeakSet[FreezeHandle] = weakref.WeakSet()


class FreezeHandle:
    """The undo of one :func:`freeze` or :func:`unfreeze` call.

    Constructing one applies an already resolved selection: every check runs before the
    first flag flips, and a flip that still fails halfway is undone before the error
    propagates.

    Args:
        model: the module the selection was resolved against (named in messages).
        caller: how messages name the call (``"freeze()"``).
        params: the selected parameters, by name.
        norms: the layers whose mode policy to set, by name: BatchNorm layers, or (for
            ``mode=``) every module whose behaviour depends on its mode.
        requires_grad: the flag to set.
        bn: ``"eval"`` holds the layers in eval mode; ``"train"`` lets them follow the
            model's mode.

    Raises:
        IsolationTypeError: a parameter is an uninitialized lazy parameter, or was created
            under ``torch.inference_mode()`` (its flag could not be restored), or is not
            floating point while ``requires_grad=True``.
        SelectorError: ``bn`` is not a policy.

    Note:
        A copy of an active handle (made with the :class:`Frozen` module holding it, by
        ``copy.deepcopy`` or pickling) is active and undoes the copied parameters and
        layers. A copy of a *model* made while a handle is active is frozen too, but no
        handle undoes it: release it with :func:`unfreeze`.

    Attributes:
        names: the parameter names the call selected, in model order.
        norms: the BatchNorm layers whose policy the call set, by name.
        held: every layer whose policy the call set, by name (the BatchNorm layers, and with
            ``mode=`` the dropout, drop-path, ... layers too).
        exposures: with ``freeze(..., optimizer=...)``, the frozen parameters that optimizer
            holds in a param group where a zero-filled ``.grad`` would still move them.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> handle = FreezeHandle(model, "mine()", dict(model[0].named_parameters()),
    ...                       {"1": model[1]}, False, "eval")
    >>> handle
    FreezeHandle(mine on Sequential: 2 parameters, 1 BatchNorm layers, active)
    >>> handle.restore()
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
        bn = check_policy(bn, caller)
        values, plain = check_params(model, caller, params, requires_grad)
        self._seq = _sequence.take()
        self._caller = caller
        self._model_name = type(model).__name__
        self.names: tuple[str, ...] = tuple(params)
        self.exposures: tuple[Exposure, ...] = ()
        self.held: tuple[str, ...] = tuple(norms)
        self.norms: tuple[str, ...] = tuple(
            n for n, m in norms.items() if isinstance(m, nn.modules.batchnorm._BatchNorm)
        )
        # Parallel lists, not (p, flag) tuples: 10,000 small tuples cost more (allocation and
        # the garbage collections they trigger) than the flag flips themselves.
        self._params = values
        self._flags = [p.requires_grad for p in values]
        self._plain = plain
        self._modules = [(m, m.training) for m in norms.values()]
        self._active = True
        # Everything above was validated and recorded before this point; only now does state
        # change. Should anything still fail halfway (an interrupt), what was done is undone.
        train_mode = model.training
        pushed: list[nn.Module] = []
        try:
            write_flags(values, requires_grad, self._plain)
            if not requires_grad:
                for p in values:
                    if p.grad is not None:
                        # A zero-filled grad would still let weight decay and momentum move p.
                        p.grad = None
            for m in norms.values():
                push_hold(m, self._seq, bn)
                pushed.append(m)
                m.training = False if bn == "eval" else train_mode
        except BaseException:
            self._undo(pushed)
            raise
        _active.add(self)

    def _undo(self, pushed: list[nn.Module]) -> None:
        write_flags(self._params, self._flags, self._plain)
        for m in pushed:
            pop_hold(m, self._seq)
        for m, training in self._modules:
            m.training = training
        self._active = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (copy.deepcopy, pickle, torch.load) of an active handle is active and holds
        # the copied parameters and layers: it joins the registry so that nesting checks see
        # it, and keeps its place in the order, which the copied layers' policies refer to.
        self.__dict__.update(state)
        _sequence.past(self._seq)
        if self._active:
            _active.add(self)

    @property
    def active(self) -> bool:
        """Whether :meth:`restore` has yet to be called."""
        return self._active

    @outside_compile
    def restore(self) -> None:
        """Write back the ``requires_grad`` flags and BatchNorm modes recorded at the call
        (not the gradients dropped when freezing: they would be stale).

        Raises:
            RestoreError: if the handle was restored already, or if a newer handle that
                touches the same parameters or layers is still active (restore that first).
        """
        self.check_restore()
        write_flags(self._params, self._flags, self._plain)
        for m, training in self._modules:
            pop_hold(m, self._seq)
            m.training = training
        self._active = False
        _active.discard(self)

    def check_restore(self, *, first: Collection[FreezeHandle] = ()) -> None:
        """Raise what :meth:`restore` would once the handles ``first`` are; change nothing."""
        if not self._active:
            raise RestoreError(f"{self._caller}: this handle was restored already; restore once")
        newer = [h for h in list(_active) if h._seq > self._seq and h._active and h._touches(self)]
        newer = [h for h in newer if all(h is not f for f in first)]
        if newer:
            # By identity, not by name: each handle names from its own model's root.
            ids = set().union(*(h._ids() for h in newer))
            names = [n for n, p in zip(self.names, self._params, strict=True) if id(p) in ids]
            held = zip(self.held, self._modules, strict=True)  # layers only (BatchNorm, no affine)
            layers = [n or self._model_name for n, (m, _) in held if id(m) in ids]
            raise RestoreError(
                f"{self._caller}: restored out of order: {len(newer)} newer handle(s) still "
                f"hold {'parameters' if names else 'layers'} this one set "
                f"({sorted(names or layers)[:5]}...); restore the newest first, "
                f"or use the context managers frozen()/unfrozen(), which nest correctly"
            )

    def _ids(self) -> set[int]:
        return {id(p) for p in self._params} | {id(m) for m, _ in self._modules}

    def _touches(self, other: FreezeHandle) -> bool:
        # Computed only when handles nest, so a lone freeze/restore pays nothing for it.
        return not self._ids().isdisjoint(other._ids())

    def __repr__(self) -> str:
        state = "active" if self._active else "restored"
        others = len(self.held) - len(self.norms)
        more = f", {others} other mode-dependent layers" if others else ""
        return (
            f"FreezeHandle({self._caller.rstrip('()')} on {self._model_name}: "
            f"{len(self.names)} parameters, {len(self.norms)} BatchNorm layers{more}, {state})"
        )


def held_in_eval(model: nn.Module) -> tuple[str, ...]:
    """The names of the modules of ``model`` that a freeze holds in eval mode now (their
    forward runs in eval mode whatever ``model.train()`` or Lightning set).

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(), nn.BatchNorm1d(2))
    >>> with frozen(model, mode="eval"):
    ...     held_in_eval(model)
    ('1', '2')
    >>> held_in_eval(model)
    ()
    """
    check_module(model, "held_in_eval()")
    return tuple(n for n, m in model.named_modules() if held_policy(m) == "eval")


@outside_compile
def freeze(
    model: nn.Module,
    *selectors: Selector,
    mode: Mode | None = None,
    bn: BNPolicy | None = None,
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
        mode: the mode to hold the selection in, as a whole: ``"eval"`` holds every module
            within it whose behaviour depends on its mode in eval mode (dropout, drop path
            and stochastic depth, BatchNorm and InstanceNorm statistics, RNN and attention
            dropout, and any module whose forward reads ``.training``, or that declares so
            with the class attribute ``isolate_reads_training = True``), so a frozen part
            computes deterministic features; ``"train"`` lets them all follow the model's
            mode. ``None``: only BatchNorm layers get a policy, ``bn``'s.
        bn: the policy for BatchNorm layers within the selection, when ``mode`` is not given
            (the narrower, older spelling; the default is ``"eval"``). ``"eval"`` holds them
            in eval mode, so their running statistics stay fixed even when a parent module or
            Lightning calls ``.train()``; ``"train"`` lets them follow the model's mode and
            update their statistics. Give ``mode`` or ``bn``, not both.
        optimizer: an optimizer to check: frozen parameters it still holds in a param group
            with weight decay or momentum are listed in the handle's ``exposures`` and in an
            :class:`~isolate.errors.IsolationWarning`, since a zero-filled ``.grad`` would
            still move them.

    Returns:
        A :class:`FreezeHandle`; its ``restore()`` puts back exactly what was there.

    Raises:
        SelectorError: a selector matched nothing or is malformed, or both ``mode`` and ``bn``
            are given; nothing was changed.
        IsolationTypeError: ``model`` is not a module, a selector has the wrong type,
            ``optimizer`` is not an optimizer, or a selected parameter is an uninitialized
            lazy parameter (run one forward first) or was created under
            ``torch.inference_mode()``; nothing was changed.

    Note:
        ``requires_grad=False`` alone does not freeze BatchNorm running statistics, which is
        why ``bn="eval"`` is the default; nor does it stop a frozen part's dropout, which
        keeps its features random in training: ``mode="eval"`` holds that too. A hold is a
        forward pre-hook, not an override of ``train()``: it survives a parent's ``.train()``
        and Lightning's loops, which assign ``module.training`` directly. Optimizers still
        move parameters whose ``.grad`` is a zero tensor (weight decay, momentum); ``freeze``
        sets ``.grad`` to ``None`` so they don't, but a parameter frozen *after* an optimizer
        step may still carry momentum state. DDP only syncs parameters that required grad
        when it was built: freeze before wrapping.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    >>> handle = freeze(model, "0", "1")
    >>> [p.requires_grad for p in model.parameters()]
    [False, False, False, False, True, True]
    >>> handle.restore()
    >>> all(p.requires_grad for p in model.parameters())
    True
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    >>> with frozen(net, mode="eval"):
    ...     torch.equal(net.train()(torch.ones(1, 2)), net(torch.ones(1, 2)))
    True
    """
    caller = "freeze()"
    check_module(model, caller)
    policy, whole = policy_of(mode, bn, "eval", caller)
    if optimizer is not None:
        unwrap_optimizer(optimizer, caller)
    selection = select(model, selectors, caller, modes=whole)
    layers = selection.modes if whole else selection.norms
    handle = FreezeHandle(model, caller, selection.params, dict(layers), False, policy)
    if optimizer is not None:
        chosen = set(handle.names)
        try:
            # Read after the flip: an exposure is a frozen parameter the optimizer holds.
            exposed = [
                e for e in optimizer_exposure(optimizer, model) if e.at_risk and e.name in chosen
            ]
        except BaseException:
            handle.restore()
            raise
        handle.exposures = tuple(exposed)
        if exposed:
            groups = sorted({e.group for e in exposed})
            moving = [e for e in exposed if e.moves_on_step]
            when = (
                f"the next step moves {len(moving)} of them"
                if moving
                else "their .grad is None now, so this optimizer skips them, but a zero-filled "
                ".grad would move them"
            )
            warn_user(
                f"{caller}: optimizer param group(s) {groups} still hold {len(exposed)} frozen "
                f"parameter(s), e.g. {(moving or exposed)[0]}; {when}. Take them out of the "
                f"optimizer (or build it anew from the trainable parameters)"
            )
    return handle


@outside_compile
def unfreeze(
    model: nn.Module,
    *selectors: Selector,
    mode: Mode | None = None,
    bn: BNPolicy | None = None,
) -> FreezeHandle:
    """Let the selected parameters learn again and return the undo.

    The opposite of :func:`freeze`, with the same selectors. By default (``bn="train"``)
    BatchNorm layers in the selection follow the model's mode again, even where an earlier
    :func:`freeze` held them in eval mode; ``mode="train"`` does so for every mode-dependent
    layer (undoing an earlier ``freeze(..., mode="eval")``).

    Raises:
        SelectorError: a selector matched nothing or is malformed, or both ``mode`` and
            ``bn`` are given; nothing was changed.
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
    policy, whole = policy_of(mode, bn, "train", caller)
    selection = select(model, selectors, caller, modes=whole)
    layers = selection.modes if whole else selection.norms
    return FreezeHandle(model, caller, selection.params, dict(layers), True, policy)


@contextlib.contextmanager
def frozen(
    model: nn.Module,
    *selectors: Selector,
    mode: Mode | None = None,
    bn: BNPolicy | None = None,
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
    handle = freeze(model, *selectors, mode=mode, bn=bn, optimizer=optimizer)
    try:
        yield handle
    finally:
        if handle.active:
            handle.restore()


@contextlib.contextmanager
def unfrozen(
    model: nn.Module,
    *selectors: Selector,
    mode: Mode | None = None,
    bn: BNPolicy | None = None,
) -> Iterator[FreezeHandle]:
    """Context-manager form of :func:`unfreeze`: restores on exit, exceptions included."""
    handle = unfreeze(model, *selectors, mode=mode, bn=bn)
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
    return not any(p.requires_grad for p in select(model, selectors, "is_frozen()").params.values())


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
        IsolationTypeError: ``module`` has uninitialized lazy parameters (run one forward
            first) or parameters created under ``torch.inference_mode()``; nothing was
            changed. From ``forward``: an input holds tensors where they cannot be reached
            (see :func:`isolate.stop_gradient`).

    Note:
        A copy of a :class:`Frozen` module (``copy.deepcopy``, pickling, ``torch.save`` /
        ``torch.load(weights_only=False)``, the copy ``torch.optim.swa_utils.AveragedModel``
        makes for EMA and SWA) is frozen on its own: its ``unwrap()`` releases the copy's
        parameters and BatchNorm layers and leaves the original held, and the other way
        round. ``frozen.module = other`` freezes ``other`` and releases the old module.

    >>> trunk = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    >>> frozen_trunk = Frozen(trunk).train()
    >>> out = frozen_trunk(torch.randn(8, 4))
    >>> out.grad_fn is None, trunk[1].training
    (True, False)
    >>> frozen_trunk.unwrap() is trunk
    True
    """

    def __init__(self, module: nn.Module) -> None:
        caller = "Frozen()"
        check_module(module, caller, "the wrapped object")
        params, norms = whole_module(module, caller)
        super().__init__(module)
        self._handle = FreezeHandle(module, caller, params, norms, False, "eval")

    def _rewrap(self, old: nn.Module, new: nn.Module) -> None:
        # ``frozen.module = other`` freezes ``other`` and releases ``old``, as unwrapping and
        # wrapping again would: a Frozen wrapper never holds a module that still learns.
        caller = "Frozen.module = ..."
        params, norms = whole_module(new, caller)
        if self._handle.active:
            self._handle.restore()
        super()._rewrap(old, new)
        self._handle = FreezeHandle(new, caller, params, norms, False, "eval")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tensors = iter_tensors((args, kwargs), f"Frozen({type(self.module).__name__})")
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return self.module(*args, **kwargs)
        with torch.no_grad():
            return self.module(*args, **kwargs)

    def unwrap(self) -> nn.Module:
        """Restore the wrapped module's flags and modes and return it."""
        if self._handle.active:
            self._handle.restore()
        return super().unwrap()
