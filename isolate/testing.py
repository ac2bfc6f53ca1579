"""Assertions for your own test suite, and a pytest plugin with fixtures built on them.

Import it explicitly (``import isolate.testing``); ``import isolate`` never imports pytest.
Installing ``isolate`` registers this module as a pytest plugin (entry point
``isolate.testing`` in the ``pytest11`` group), which provides the
:func:`isolation_snapshot` fixture.

Note:
    The plugin is loaded by its entry point. The entry point has the module's own name, so
    listing it in ``pytest_plugins`` or passing ``-p isolate.testing`` as well is harmless;
    with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` set, ``-p isolate.testing`` loads it.

:func:`assert_isolated` (no path from a loss to protected parameters) and
:func:`assert_reached` (a path from some loss to every trainable parameter) are the core's
own assertions, re-exported here so that a test suite finds them in one place.

The helpers are plain functions and work without pytest:

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
>>> with assert_unchanged(model[0]):
...     loss = model[1](model[0](torch.randn(2, 3)).detach()).sum()
...     loss.backward()
...     torch.optim.SGD(model.parameters(), lr=0.1).step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from isolate._autograd import Losses
from isolate._protected import Protected
from isolate._selectors import Selector
from isolate.cutoff import assert_reached, trace_forward
from isolate.drift import ParameterFilter, Snapshot, check_atol, snapshot
from isolate.errors import GradientLeakError, SelectorError
from isolate.gradients import gradient_invariance
from isolate.reachability import assert_isolated

__all__ = [
    "assert_gradient_invariance",
    "assert_isolated",
    "assert_reached",
    "assert_trains",
    "assert_unchanged",
    "isolation_snapshot",
]


def assert_gradient_invariance(
    main_loss: torch.Tensor,
    total_loss: torch.Tensor,
    protected: Protected,
    *,
    model: nn.Module | None = None,
    atol: float = 0.0,
) -> None:
    """Assert that adding the auxiliary losses leaves the protected gradients as they were.

    Compares the gradients of ``main_loss`` and of ``total_loss`` (``main_loss`` plus the
    auxiliary terms, main loss with weight 1) on ``protected``; see
    :func:`isolate.gradients.gradient_invariance`.

    Args:
        main_loss: the scalar loss the protected parameters learn from.
        total_loss: the scalar objective that is trained.
        protected: the parameters whose gradients must not change.
        model: the whole model, to name parameters and resolve selector strings.
        atol: the largest |Δ| that still passes; ``0.0`` (exact) is the right value when
            the auxiliary branch is cut off.

    Raises:
        GradientLeakError: naming each parameter whose gradient changed and by how much.
        SelectorError: no protected parameter requires grad: there is nothing to compare.
        IsolationTypeError: ``atol`` is not a number >= 0.

    >>> encoder, head, probe = nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(3, 2)
    >>> features = encoder(torch.randn(4, 3))
    >>> main = head(features).mean()
    >>> assert_gradient_invariance(main, main + probe(features.detach()).mean(), encoder)
    >>> assert_gradient_invariance(main, main + probe(features).mean(), encoder)
    Traceback (most recent call last):
    ...
    isolate.errors.GradientLeakError: assert_gradient_invariance(): the auxiliary losses ...
    """
    __tracebackhide__ = True
    caller = "assert_gradient_invariance()"
    check_atol(atol, caller)
    result = gradient_invariance(main_loss, total_loss, protected, model=model)
    if not result.trainable:
        raise SelectorError(
            f"{caller}: nothing to prove: none of the {len(result.deltas)} protected "
            f"parameters requires grad, so neither loss sends them a gradient and this "
            f"assertion could never fail. Assert it while they are trainable (before a "
            f"freeze, or after their thaw); frozen ones are for assert_unchanged"
        )
    moved = result.changed(atol=atol)
    if not moved:
        return
    width = max(map(len, moved))
    lines = [f"  {name:<{width}}  max|Δ|={delta:.3e}" for name, delta in moved.items()]
    raise GradientLeakError(
        f"{caller}: the auxiliary losses change the gradient of {len(moved)} of "
        f"{len(result.deltas)} protected parameters (atol={atol}):\n"
        + "\n".join(lines)
        + "\nFix: find the path with assert_isolated(aux_loss, protected) for each auxiliary "
        "loss, and cut it with isolate.stop_gradient or isolate.Detached"
    )


def assert_trains(
    model: nn.Module,
    forward: Callable[[], Losses | Mapping[str, torch.Tensor]],
    *,
    expected_unused: Selector | Sequence[Selector] = (),
) -> None:
    """Run ``forward()`` under :func:`isolate.cutoff.trace_forward` and assert that its losses reach
    every trainable parameter of ``model``, with the reason for each one they do not.

    Args:
        model: the module whose trainable parameters must all get a gradient.
        forward: runs the forward pass and returns the loss (a tensor, a sequence, or a
            mapping of names to tensors); no backward is needed.
        expected_unused: selectors for parameters allowed to go unused, as in
            :func:`isolate.cutoff.cut_off_parameters`.

    Raises:
        CutOffError: naming each cut-off parameter, why (the module did not run, ran under
            ``no_grad`` or inside a reentrant checkpoint whose inputs do not require grad,
            or its output was detached) and the fix.
        BlindSpotError: the graph holds a reentrant checkpoint and cannot show the rest.

    >>> model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    >>> assert_trains(model, lambda: model(torch.randn(2, 3)).sum())
    >>> assert_trains(model, lambda: model[1](model[0](torch.randn(2, 3)).detach()).sum())
    Traceback (most recent call last):
    ...
    isolate.errors.CutOffError: assert_reached(): 2 of 4 trainable parameters get no gradient ...
    """
    __tracebackhide__ = True
    with trace_forward(model) as trace:
        losses = forward()
    assert_reached(losses, model, expected_unused=expected_unused, trace=trace)


@contextlib.contextmanager
def assert_unchanged(
    target: nn.Module | Mapping[str, torch.Tensor],
    *,
    parameters: ParameterFilter = "all",
    buffers: bool = True,
    atol: float = 0.0,
) -> Iterator[Snapshot]:
    """Assert that the block leaves the parameters and buffers of ``target`` as they were.

    Takes a :func:`isolate.drift.snapshot` on entry and checks it on exit. When the block
    raises, that exception propagates and nothing is checked.

    Args:
        target: a module or a mapping of names to tensors.
        parameters: which parameters to watch: ``"all"``, ``"frozen"``, ``"trainable"`` or
            ``"none"``.
        buffers: whether to watch buffers (BatchNorm running statistics included).
        atol: the largest |Δ| per element that still counts as unchanged.

    Yields:
        The :class:`~isolate.drift.Snapshot` taken on entry.

    Raises:
        DriftError: naming every tensor that changed, with its max |Δ|.
        SelectorError: ``target`` and the filters select no tensor (checked on entry, since
            such an assertion could never fail).

    >>> bn = nn.BatchNorm1d(2)
    >>> with assert_unchanged(bn):
    ...     _ = bn(torch.randn(4, 2))
    Traceback (most recent call last):
    ...
    isolate.errors.DriftError: assert_unchanged(): 3 of 5 tensors changed since the snapshot ...
    """
    __tracebackhide__ = True
    snap = snapshot(target, parameters=parameters, buffers=buffers)
    snap.require_tensors("assert_unchanged()")  # before the block: an empty one proves nothing
    yield snap
    snap.assert_unchanged(atol=atol)


try:
    import pytest
except ImportError:  # the helpers above work without pytest; only the fixture needs it
    pass
else:

    @pytest.fixture
    def isolation_snapshot() -> Callable[..., Snapshot]:
        """A factory for :func:`isolate.drift.snapshot` (same arguments).

        ::

            def test_probe_leaves_encoder_alone(isolation_snapshot):
                snap = isolation_snapshot(model.encoder)
                train_probe(model, steps=3)
                snap.assert_unchanged()
        """

        def make(target: nn.Module | Mapping[str, torch.Tensor], **options: Any) -> Snapshot:
            return snapshot(target, **options)

        return make
