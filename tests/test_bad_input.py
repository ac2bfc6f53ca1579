"""The bad-input catalogue of the core: each kind of bad input gets its typed error, a message
that names the culprit, and leaves the model, its flags, modes and hooks exactly as before.

The Lightning callback, the data module and the configs have their own catalogues in
tests/test_lightning.py, tests/test_data.py and tests/test_configs.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import isolate
from isolate import (
    IsolationError,
    IsolationTypeError,
    RestoreError,
    SelectorError,
    WrappingError,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())
        self.head = nn.Linear(4, 2)
        self.steps = nn.Parameter(torch.zeros((), dtype=torch.long), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def everything(model: nn.Module) -> Any:
    return (
        [
            (n, id(p), p.requires_grad, p.grad is None, p.detach().clone())
            for n, p in model.named_parameters()
        ],
        [(n, b.detach().clone()) for n, b in model.named_buffers()],
        [
            (n, type(m), m.training, dict(m._forward_pre_hooks), dict(m._forward_hooks),
             dict(m._backward_hooks), dict(m._state_dict_hooks))
            for n, m in model.named_modules()
        ],
    )  # fmt: skip


def _same(a: Any, b: Any) -> bool:
    params_a, buffers_a, modules_a = a
    params_b, buffers_b, modules_b = b
    return (
        [x[:4] for x in params_a] == [x[:4] for x in params_b]
        and all(torch.equal(x[4], y[4]) for x, y in zip(params_a, params_b, strict=True))
        and [n for n, _ in buffers_a] == [n for n, _ in buffers_b]
        and all(torch.equal(x[1], y[1]) for x, y in zip(buffers_a, buffers_b, strict=True))
        and [m[:3] for m in modules_a] == [m[:3] for m in modules_b]
        and [tuple(map(len, m[3:])) for m in modules_a]
        == [tuple(map(len, m[3:])) for m in modules_b]
    )


Action = Callable[[], object]
Prepared = tuple[Action, Callable[[], None]]


def _plain(call: Callable[[Net], object]) -> Callable[[Net], Prepared]:
    """A case with nothing to set up: the bad call itself."""
    return lambda net: ((lambda: call(net)), lambda: None)


def _restored_twice(net: Net) -> Prepared:
    handle = isolate.freeze(net, "head")
    handle.restore()
    return handle.restore, lambda: None


def _restored_out_of_order(net: Net) -> Prepared:
    outer = isolate.freeze(net, "trunk")
    inner = isolate.freeze(net, "trunk.0")

    def cleanup() -> None:
        inner.restore()
        outer.restore()

    return outer.restore, cleanup


def _wrapped_twice(net: Net) -> Prepared:
    first = isolate.Cloned(net.head)

    def cleanup() -> None:
        first.unwrap()

    return (lambda: isolate.Cloned(net.head)), cleanup


def _with_loss(call: Callable[[Net, torch.Tensor], object]) -> Callable[[Net], Prepared]:
    def prepare(net: Net) -> Prepared:
        loss = net(torch.randn(3, 4))
        return (lambda: call(net, loss)), lambda: None

    return prepare


CASES: list[tuple[str, Callable[[Net], Prepared], type[IsolationError], str]] = [
    ("glob matches nothing", _plain(lambda n: isolate.freeze(n, "backbone.*")), SelectorError,
     r"^freeze\(\): 'backbone\.\*' matched no parameter of Net; its children are "
     r"\['trunk', 'head'\]"),
    ("unknown module name", _plain(lambda n: isolate.frozen(n, "trunk.9").__enter__()),
     SelectorError, r"^freeze\(\): 'trunk\.9' matched no parameter"),
    ("module without parameters", _plain(lambda n: isolate.freeze(n, "trunk.2")),
     SelectorError, r"'trunk\.2' matched no parameter"),
    ("malformed glob", _plain(lambda n: isolate.freeze(n, "trunk.[0")), SelectorError,
     r"^freeze\(\): malformed glob 'trunk\.\[0'"),
    ("empty selector", _plain(lambda n: isolate.unfreeze(n, "")), SelectorError,
     r"^unfreeze\(\): empty selector"),
    ("predicate matches nothing", _plain(lambda n: isolate.freeze(n, lambda name, p: False)),
     SelectorError, r"'<lambda>' matched no parameter"),
    ("valid selector before a bad one", _plain(lambda n: isolate.freeze(n, "head", "nothing")),
     SelectorError, r"'nothing' matched no parameter"),
    ("selector of the wrong type", _plain(lambda n: isolate.freeze(n, 3.5)), IsolationTypeError,
     r"^freeze\(\): a selector must be .* got float 3\.5"),
    ("target is not a module", _plain(lambda n: isolate.freeze(n.head.weight)),
     IsolationTypeError, r"^freeze\(\): model must be a torch\.nn\.Module, got Parameter"),
    ("module of another model", _plain(lambda n: isolate.freeze(n, nn.Linear(4, 4))),
     SelectorError, r"not a submodule of Net"),
    ("parameter of another model",
     _plain(lambda n: isolate.freeze(n, nn.Parameter(torch.ones(1)))), SelectorError,
     r"is not a parameter of Net"),
    ("unknown BatchNorm policy", _plain(lambda n: isolate.freeze(n, "trunk", bn="fixed")),
     SelectorError, r"^freeze\(\): bn='fixed' is not a BatchNorm policy"),
    ("unfreezing an integer parameter", _plain(lambda n: isolate.unfreeze(n)),
     IsolationTypeError, r"^unfreeze\(\): parameters \['steps'\] are not floating point"),
    ("optimizer of the wrong type", _plain(lambda n: isolate.freeze(n, optimizer=[1])),
     IsolationTypeError, r"^freeze\(\): optimizer must be a torch\.optim\.Optimizer, got list"),
    ("restoring a handle twice", _restored_twice, RestoreError,
     r"^freeze\(\): this handle was restored already"),
    ("restoring out of order", _restored_out_of_order, RestoreError,
     r"^freeze\(\): restored out of order"),
    ("non-tensor to stop_gradient", _plain(lambda n: isolate.stop_gradient("x")),
     IsolationTypeError, r"^stop_gradient\(\): expected a tensor"),
    ("non-tensor to clone", _plain(lambda n: isolate.clone(None)), IsolationTypeError,
     r"^clone\(\): expected a tensor .* got NoneType"),
    ("non-finite alpha", _plain(lambda n: isolate.scale_gradient(torch.ones(1), float("nan"))),
     IsolationTypeError, r"^scale_gradient\(\): alpha must be a finite real number, got nan"),
    ("alpha of the wrong type", _plain(lambda n: isolate.GradientScale("-1")),
     IsolationTypeError, r"^GradientScale\(\): alpha must be a finite real number, got '-1'"),
    ("unknown in-place policy", _plain(lambda n: isolate.Detached(n.head, inplace="ignore")),
     IsolationTypeError, r"^Detached\(\): inplace='ignore' is not a policy"),
    ("wrapping a non-module", _plain(lambda n: isolate.Cloned(n.head.weight)),
     IsolationTypeError,
     r"^Cloned\(\): the wrapped object must be a torch\.nn\.Module, got Parameter"),
    ("wrapping a wrapper", _plain(lambda n: isolate.Detached(isolate.Detached(n.head))),
     WrappingError, r"^Detached\(\): the module is already wrapped in Detached"),
    ("wrapping a module twice", _wrapped_twice, WrappingError,
     r"^Cloned\(\): this Linear is already wrapped in a live Cloned"),
    ("Frozen of a non-module", _plain(lambda n: isolate.Frozen(torch.nn.functional.relu)),
     IsolationTypeError, r"^Frozen\(\): the wrapped object must be a torch\.nn\.Module"),
    ("reachability of a non-tensor", _plain(lambda n: isolate.reachable_parameters(3.0, n)),
     IsolationTypeError, r"^reachable_parameters\(\): "),
    ("reachability in a non-module",
     _with_loss(lambda n, out: isolate.reachable_parameters(out.sum(), "net")),
     IsolationTypeError, r"^reachable_parameters\(\): "),
    ("report of a non-scalar loss",
     _with_loss(lambda n, out: isolate.gradient_report({"main": out}, n)), IsolationTypeError,
     r"^gradient_report\(\): "),
    ("report group that matches nothing",
     _with_loss(lambda n, out: isolate.gradient_report({"main": out.sum()}, n, groups=["x.*"])),
     SelectorError, r"^gradient_report\(\): "),
    ("snapshot of a non-module", _plain(lambda n: isolate.snapshot(42)), IsolationTypeError,
     r"^snapshot\(\): "),
]  # fmt: skip


def test_catalogue_has_at_least_25_kinds() -> None:
    assert len(CASES) >= 25
    assert len({name for name, *_ in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "prepare", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_typed_error_and_changes_nothing(
    name: str, prepare: Callable[[Net], Prepared], error: type[IsolationError], message: str
) -> None:
    net = Net()
    net(torch.randn(3, 4)).sum().backward()  # some grads exist: a half-applied freeze drops them
    action, cleanup = prepare(net)
    before = everything(net)
    try:
        with pytest.raises(error, match=message) as info:
            action()
        assert isinstance(info.value, IsolationError)
        assert _same(everything(net), before), f"{name}: the model changed"
    finally:
        cleanup()
