"""What an audit protects, as its refusal names it: every alias of a tied parameter, each
with the module that owns it, whichever way the parameters were given."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from isolate.errors import GradientLeakError, IsolationTypeError
from isolate.reachability import assert_isolated


def tied() -> nn.Sequential:
    """``dec.weight`` is ``enc.0.weight``; ``outX`` ends on a letter ``rstrip`` could eat."""
    torch.manual_seed(0)
    net = nn.Sequential(
        OrderedDict(
            enc=nn.Sequential(nn.Linear(2, 2)),
            dec=nn.Linear(2, 2),
            outX=nn.Linear(2, 1),
        )
    )
    net.dec.weight = net.enc[0].weight
    return net


def leaked(net: nn.Module, protect: object, *, model: bool = True) -> list[str]:
    """The name and owner of each protected parameter that ``net``'s loss reaches, as the
    refusal says (``model=False``: the audit is not given the model)."""
    loss = net(torch.ones(3, 2)).sum()
    with pytest.raises(GradientLeakError) as refused:
        assert_isolated(loss, protect, model=net if model else None)  # type: ignore[arg-type]
    lines = str(refused.value).splitlines()[1:-2]  # between the count and the route
    return [line.split("consumed by")[0].rstrip("; ").strip() for line in lines]


def test_a_tied_parameter_is_named_by_every_alias_with_its_owner() -> None:
    net = tied()
    assert leaked(net, [net.enc[0].weight]) == [
        "enc.0.weight  in 'enc.0' (Linear)",
        "dec.weight    in 'dec' (Linear)",
    ]
    assert leaked(net, net.enc) == [
        "enc.0.weight  in 'enc.0' (Linear)",
        "dec.weight    in 'dec' (Linear)",
        "enc.0.bias    in 'enc.0' (Linear)",
    ]
    # Without the model, the module's own names: every alias still, owners by their path.
    assert leaked(net, net, model=False) == [
        "enc.0.weight  in 'enc.0' (Linear)",
        "enc.0.bias    in 'enc.0' (Linear)",
        "dec.weight    in 'dec' (Linear)",
        "dec.bias      in 'dec' (Linear)",
        "outX.weight   in 'outX' (Linear)",
        "outX.bias     in 'outX' (Linear)",
    ]


def test_modules_given_together_without_the_model_are_numbered() -> None:
    net = tied()
    assert leaked(net, [net.dec, net.outX], model=False) == [
        "[0].weight  in '[0]' (Linear)",
        "[0].bias    in '[0]' (Linear)",
        "[1].weight  in '[1]' (Linear)",
        "[1].bias    in '[1]' (Linear)",
    ]


def test_a_named_pair_has_an_owner_only_under_a_name_the_model_uses() -> None:
    net = tied()
    assert leaked(net, ("dec.weight", net.dec.weight)) == ["dec.weight  in 'dec' (Linear)"]
    assert leaked(net, [("dec.weight", net.dec.weight), ("shared", net.dec.weight)]) == [
        "dec.weight  in 'dec' (Linear)",
        "shared",
    ]


def test_a_selector_function_is_resolved_against_the_model() -> None:
    net = tied()
    assert leaked(net, lambda name, p: name.startswith("outX")) == [
        "outX.weight  in 'outX' (Linear)",
        "outX.bias    in 'outX' (Linear)",
    ]


def test_what_cannot_name_parameters_is_refused_in_the_callers_name() -> None:
    loss = tied()(torch.ones(1, 2)).sum()
    with pytest.raises(IsolationTypeError) as refused:
        assert_isolated(loss, 42)  # type: ignore[arg-type]
    assert str(refused.value).startswith(
        "assert_isolated(): cannot tell which parameters int means; pass a module"
    )
    with pytest.raises(IsolationTypeError) as refused:
        assert_isolated(loss, "enc", model=[nn.Linear(2, 2)])  # type: ignore[arg-type]
    assert str(refused.value).startswith(
        "assert_isolated(): model must be a torch.nn.Module, got list"
    )
