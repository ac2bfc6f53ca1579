"""apply, as integrations call it: every refusal in the caller's name before anything changes,
warnings through the caller's channel, FSDP1 units refused before the selectors are read, and
what a spec expects of each parameter before training."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from isolate import IsolationSpec, Thaw
from isolate.errors import IsolationTypeError, SelectorError, SpecError, UnsupportedStrategyError
from isolate.spec.isolation import apply
from tests.toolkit.test_sharding import _FakeFsdp1Unit

CALLER = "IsolationCallback"


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(trunk=nn.Linear(2, 3), head=nn.Linear(3, 1)))


def flags(model: nn.Module) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("spec", "kwargs", "error", "message"),
    [
        ({"freeze": ["trunk"]}, {}, IsolationTypeError, "spec must be an IsolationSpec, got "),
        (IsolationSpec(freeze=["nowhere"]), {}, SelectorError, "'nowhere' matched no"),
        (IsolationSpec(freeze=["trunk"]), {"optimizer": "sgd"}, IsolationTypeError, "optimizer"),
        (IsolationSpec(freeze=["trunk"]), {"drift": "bits"}, SpecError, "drift must be 'finger"),
    ],
    ids=["not-a-spec", "selector", "optimizer", "drift"],
)
def test_apply_refuses_in_the_callers_name_before_changing_anything(
    spec: object, kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    model = net()
    before = flags(model)
    with pytest.raises(error) as caught:
        apply(spec, model, caller=CALLER, **kwargs)  # type: ignore[arg-type]
    assert str(caught.value).startswith(CALLER)
    assert message in str(caught.value)
    assert flags(model) == before
    if isinstance(spec, dict):
        assert str(caught.value) == f"{CALLER}: spec must be an IsolationSpec, got <class 'dict'>"


def test_apply_watches_by_fingerprint_by_default() -> None:
    handle = apply(IsolationSpec(freeze=["trunk"]), net())
    try:
        assert handle.drift == "fingerprint"
    finally:
        handle.restore()


def test_warnings_go_through_the_callers_channel() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may reach the warnings module
        handle = apply(IsolationSpec(freeze=["trunk"]), model, opt, caller=CALLER, warn=seen.append)
    handle.restore()
    assert len(seen) == 1
    assert seen[0].startswith(f"{CALLER}: took 2 frozen parameters out of the optimizers")


def _fsdp1(fqns: list[str], originals: list[nn.Parameter], *, orig: bool) -> nn.Module:
    flat = nn.Parameter(torch.zeros(4))
    flat._fqns = fqns  # type: ignore[attr-defined]
    flat._params = originals  # type: ignore[attr-defined]
    return nn.Sequential(OrderedDict(layer=_FakeFsdp1Unit(flat, use_orig_params=orig)))


def test_an_fsdp1_flat_unit_is_refused_before_the_selectors_are_read() -> None:
    # The spec names the unit's original modules, which the flat unit no longer registers:
    # the strategy is what is wrong, not the selector.
    model = _fsdp1(["layer.0.weight", "layer.0.bias"], [], orig=False)
    with pytest.raises(UnsupportedStrategyError) as caught:
        apply(IsolationSpec(freeze=["layer.0"]), model, caller=CALLER)
    assert str(caught.value).startswith(
        f"{CALLER}: the model holds FullyShardedDataParallel units built with use_orig_params=False"
    )


def test_expectations_say_what_each_parameter_does_before_training_and_change_nothing() -> None:
    model = net()
    before = flags(model)
    spec = IsolationSpec(freeze=["trunk", "head.bias"], thaw=[Thaw("trunk", epoch=2)])
    assert spec.expectations(model) == {
        "trunk.weight": "still until epoch 2",
        "trunk.bias": "still until epoch 2",
        "head.weight": "moves",
        "head.bias": "still",
    }
    assert flags(model) == before
    with pytest.raises(SelectorError, match=r"^IsolationSpec\(freeze\): 'nowhere' matched no"):
        IsolationSpec(freeze=["nowhere"]).expectations(model)
