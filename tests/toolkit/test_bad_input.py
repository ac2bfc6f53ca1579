"""The bad-input catalogue of the core: each kind of bad input gets its typed error, a message
that names the culprit, and leaves the model, its flags, modes and hooks exactly as before.

The Lightning callback, the data module and the configs have their own catalogues in
tests/lightning/test_callback.py, tests/experiments/test_data.py and
tests/experiments/test_configs.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import isolate
import isolate.freezing
import isolate.reachability
from isolate import IsolationError
from isolate.errors import IsolationTypeError, RestoreError, SelectorError, WrappingError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())
        self.head = nn.Linear(4, 2)
        self.steps = nn.Parameter(torch.zeros((), dtype=torch.long), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def everything(model: nn.Module) -> dict[str, Any]:
    """All a bad call could touch: every flag, identity, value, gradient, mode and hook."""
    return {
        "parameters": [
            (n, id(p), p.requires_grad, None if p.grad is None else p.grad.clone())
            for n, p in model.named_parameters()
        ],
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "modules": [(n, id(m), type(m), m.training) for n, m in model.named_modules()],
        "hooks": [
            (n, *({k: id(h) for k, h in getattr(m, attr).items()} for attr in _HOOKS))
            for n, m in model.named_modules()
        ],
    }


_HOOKS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What changed between two ``everything()`` records, named, for the failure message."""
    if [x[0] for x in a["parameters"]] != [x[0] for x in b["parameters"]]:
        return [
            f"parameters {[x[0] for x in a['parameters']]} -> {[x[0] for x in b['parameters']]}"
        ]
    out = []
    for (n, i, flag, grad), (_, j, flag2, grad2) in zip(
        a["parameters"], b["parameters"], strict=True
    ):
        if i != j:
            out.append(f"{n}: replaced")
        if flag != flag2:
            out.append(f"{n}: requires_grad {flag} -> {flag2}")
        if (grad is None) != (grad2 is None) or (grad is not None and not torch.equal(grad, grad2)):
            out.append(f"{n}: .grad changed")
    if a["state_dict"].keys() != b["state_dict"].keys():
        out.append(f"state_dict keys {list(a['state_dict'])} -> {list(b['state_dict'])}")
    else:
        out += [f"{k}: value changed" for k, v in a["state_dict"].items()
                if not torch.equal(v, b["state_dict"][k])]  # fmt: skip
    if a["modules"] != b["modules"]:
        out.append(f"modules (ids, classes, modes) {a['modules']} -> {b['modules']}")
    if a["hooks"] != b["hooks"]:
        out.append(f"hooks {a['hooks']} -> {b['hooks']}")
    return out


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
     SelectorError, r"^freeze\(\): 'trunk\.9' matched no parameter of Net; its children are "),
    ("module without parameters", _plain(lambda n: isolate.freeze(n, "trunk.2")),
     SelectorError, r"^freeze\(\): 'trunk\.2' matched no parameter of Net"),
    ("malformed glob", _plain(lambda n: isolate.freeze(n, "trunk.[0")), SelectorError,
     r"^freeze\(\): malformed glob 'trunk\.\[0'"),
    ("empty selector", _plain(lambda n: isolate.freezing.unfreeze(n, "")), SelectorError,
     r"^unfreeze\(\): empty selector"),
    ("predicate matches nothing", _plain(lambda n: isolate.freeze(n, lambda name, p: False)),
     SelectorError, r"^freeze\(\): '<lambda>' matched no parameter of Net"),
    ("valid selector before a bad one", _plain(lambda n: isolate.freeze(n, "head", "nothing")),
     SelectorError, r"^freeze\(\): 'nothing' matched no parameter of Net"),
    ("selector of the wrong type", _plain(lambda n: isolate.freeze(n, 3.5)), IsolationTypeError,
     r"^freeze\(\): a selector must be .* got float 3\.5"),
    ("target is not a module", _plain(lambda n: isolate.freeze(n.head.weight)),
     IsolationTypeError, r"^freeze\(\): model must be a torch\.nn\.Module, got Parameter"),
    ("module of another model", _plain(lambda n: isolate.freeze(n, nn.Linear(4, 4))),
     SelectorError, r"^freeze\(\): the Linear passed as a selector is not a submodule of Net"),
    ("parameter of another model",
     _plain(lambda n: isolate.freeze(n, nn.Parameter(torch.ones(1)))), SelectorError,
     r"^freeze\(\): the parameter of shape \(1,\) passed as a selector is not a parameter of Net"),
    ("unknown BatchNorm policy", _plain(lambda n: isolate.freeze(n, "trunk", bn="fixed")),
     SelectorError, r"^freeze\(\): bn='fixed' is not a BatchNorm policy"),
    ("unfreezing an integer parameter", _plain(lambda n: isolate.freezing.unfreeze(n)),
     IsolationTypeError, r"^unfreeze\(\): parameters \['steps'\] are not floating point"),
    ("optimizer of the wrong type", _plain(lambda n: isolate.freeze(n, optimizer=[1])),
     IsolationTypeError, r"^freeze\(\): optimizer must be a torch\.optim\.Optimizer, got list"),
    ("restoring a handle twice", _restored_twice, RestoreError,
     r"^freeze\(\): this handle was restored already"),
    ("restoring out of order", _restored_out_of_order, RestoreError,
     r"^freeze\(\): restored out of order"),
    ("non-tensor to stop_gradient", _plain(lambda n: isolate.stop_gradient("x")),
     IsolationTypeError, r"^stop_gradient\(\): expected a tensor .*, got str"),
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
     IsolationTypeError,
     r"^Frozen\(\): the wrapped object must be a torch\.nn\.Module, got function"),
    ("reachability of a non-tensor",
     _plain(lambda n: isolate.reachability.reachable_parameters(3.0, n)),
     IsolationTypeError,
     r"^reachable_parameters\(\): loss must be a torch\.Tensor or a sequence of tensors, "
     r"got float"),
    ("reachability in a non-module",
     _with_loss(lambda n, out: isolate.reachability.reachable_parameters(out.sum(), "net")),
     IsolationTypeError, r"^reachable_parameters\(\): model must be a torch\.nn\.Module, got str"),
    ("report of a non-scalar loss",
     _with_loss(lambda n, out: isolate.gradient_report({"main": out}, n)), IsolationTypeError,
     r"^gradient_report\(\): loss 'main' must be a scalar tensor, got a tensor of shape \(3, 2\)"),
    ("report group that matches nothing",
     _with_loss(lambda n, out: isolate.gradient_report({"main": out.sum()}, n, groups=["x.*"])),
     SelectorError, r"^gradient_report\(\): 'x\.\*' matched no parameter of Net"),
    ("snapshot of a non-module", _plain(lambda n: isolate.snapshot(42)), IsolationTypeError,
     r"^snapshot\(\): target must be a torch\.nn\.Module or a mapping of names to tensors, "
     r"got int"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "prepare", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_typed_error_and_changes_nothing(
    name: str, prepare: Callable[[Net], Prepared], error: type[IsolationError], message: str
) -> None:
    net = Net()
    net(torch.randn(3, 4)).sum().backward()  # some grads exist: a half-applied freeze drops them
    action, cleanup = prepare(net)
    before = everything(net)
    try:
        with pytest.raises(IsolationError, match=message) as info:
            action()
        assert type(info.value) is error, f"{name}: {type(info.value).__name__}, not {error}"
        assert not _differences(before, everything(net)), _differences(before, everything(net))
    finally:
        cleanup()


def test_the_model_comparison_sees_each_kind_of_change() -> None:
    """The check above is only as good as ``everything()``: each change must show."""
    changes: dict[str, Callable[[Net], object]] = {
        "flag": lambda n: n.head.bias.requires_grad_(False),
        "grad": lambda n: n.head.bias.grad.mul_(2),  # type: ignore[union-attr]
        "dropped grad": lambda n: setattr(n.head.bias, "grad", None),
        "value": lambda n: n.head.bias.data.add_(1),
        "buffer": lambda n: n.trunk[1].running_mean.add_(1),
        "replaced": lambda n: setattr(n.head, "bias", nn.Parameter(n.head.bias.detach().clone())),
        "mode": lambda n: n.trunk[1].eval(),
        "hook": lambda n: n.trunk[1].register_forward_pre_hook(lambda m, a: None),
        "wrapped": lambda n: setattr(n, "head", isolate.Frozen(n.head)),
    }
    for what, change in changes.items():
        net = Net()
        net(torch.randn(3, 4)).sum().backward()
        before = everything(net)
        change(net)
        assert _differences(before, everything(net)), f"a changed {what} went unnoticed"
        if isinstance(net.head, isolate.Frozen):
            net.head.unwrap()
