"""What every module wrapper shares (Frozen, Detached, Cloned): keyword arguments reach the
wrapped module, and ``state_dict`` / ``load_state_dict`` name keys without a ``module.``
infix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import isolate
import isolate.reachability
from isolate import Cloned, Detached
from tests.toolkit._shared import Scaled


@pytest.mark.parametrize(
    "wrap",
    [
        isolate.Cloned,
        isolate.Detached,
        lambda m: isolate.Detached(m, inplace="copy"),
        isolate.Frozen,
    ],
    ids=["Cloned", "Detached", "Detached-copy", "Frozen"],
)
def test_keyword_arguments_reach_the_wrapped_module(wrap: type[nn.Module]) -> None:
    wrapped = wrap(Scaled())
    out = wrapped(torch.ones(2), scale=torch.full((2,), 3.0))
    assert torch.equal(out.detach(), torch.full((2,), 6.0))
    if isinstance(wrapped, isolate.Frozen):
        wrapped.unwrap()


def test_load_state_dict_reports_keys_without_the_module_infix() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 2),
        Detached(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), Cloned(nn.Linear(2, 2)))),
    )
    keys = list(model.state_dict())
    assert keys == ["0.weight", "0.bias", "1.0.weight", "1.0.bias", "1.2.weight", "1.2.bias"]
    state = model.state_dict()
    del state["1.2.weight"], state["1.0.bias"]
    state["1.bogus"] = torch.zeros(1)
    state["1.2.extra"] = torch.zeros(1)
    result = model.load_state_dict(state, strict=False)
    assert sorted(result.missing_keys) == ["1.0.bias", "1.2.weight"]
    assert sorted(result.unexpected_keys) == ["1.2.extra", "1.bogus"]
    assert set(result.missing_keys) <= set(keys)
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(state)
    assert 'Missing key(s) in state_dict: "1.0.bias", "1.2.weight"' in str(info.value)
    assert "module." not in str(info.value)
    bad = model.state_dict()
    bad["1.2.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for 1\.2\.weight: copying"):
        model.load_state_dict(bad)
    inner = model[1].load_state_dict({"0.weight": torch.ones(2, 2)}, strict=False)
    assert sorted(inner.missing_keys) == ["0.bias", "2.bias", "2.weight"]
    assert torch.equal(model[1].module[0].weight, torch.ones(2, 2))


def test_the_wrapped_modules_children_parameters_and_buffers_are_reached_through_it() -> None:
    inner = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    wrapped = isolate.Detached(inner)
    assert wrapped.get_submodule("0") is inner[0]  # as torch.distributed.checkpoint walks keys
    assert getattr(wrapped, "0") is inner[0]
    linear = isolate.Detached(nn.Linear(2, 2))
    assert linear.weight is linear.module.weight
    norm = isolate.Detached(nn.BatchNorm1d(2))
    assert norm.running_mean is norm.module.running_mean
    with pytest.raises(AttributeError):
        _ = linear.forward_pre_hooks_that_do_not_exist
