"""Tree and Names: every module, parameter and buffer under the names torch itself gives
(``named_parameters`` / ``state_dict``), checked against torch, and FSDP2 temporaries named
as the sharded parameters they stand for."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from isolate import Detached
from isolate._walker import Names, Tree
from isolate.errors import ShardedGraphError


class Odd(nn.Module):
    """Tied weights, a shared buffer, a wrapper, and empty slots (None) of every kind."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.body = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        self.detached = Detached(nn.Linear(3, 3))
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("shared", self.body[1].running_mean)
        self.register_parameter("gone", None)
        self.register_buffer("none", None)
        self.register_module("empty", None)


def test_a_tree_lists_what_torch_lists_in_its_order() -> None:
    model = Odd()
    tree = Tree.of(model)
    named = list(model.named_parameters(remove_duplicate=False))
    assert tree.names == [n for n, _ in named]
    assert all(p is q for p, (_, q) in zip(tree.params, named, strict=True))
    assert tree.ids == [id(p) for _, p in named]
    buffers = list(model.named_buffers(remove_duplicate=False))
    assert tree.buffer_names == [n for n, _ in buffers]
    assert all(b is c for b, (_, c) in zip(tree.buffers, buffers, strict=True))
    assert tree.modules == list(model.named_modules(remove_duplicate=False))
    assert "detached.module.weight" in tree.names


def test_by_keys_a_tree_lists_the_state_dict_keys() -> None:
    model = Odd()
    tree = Tree.of(model, keys=True)
    keys = list(model.state_dict(keep_vars=True))
    assert tree.names + tree.buffer_names == [k for k in keys if k in tree.names] + [
        k for k in keys if k in tree.buffer_names
    ]
    assert sorted(tree.names + tree.buffer_names) == sorted(keys)
    assert "detached.weight" in tree.names and "detached.module.weight" not in tree.names


def test_names_are_state_dict_keys_first_alias_first() -> None:
    model = Odd()
    names = Names.of(model)
    assert list(names.params) == [k for k in Tree.of(model, keys=True).names if k != "head.weight"]
    assert names.params["embed.weight"] is model.embed.weight
    assert names.name(model.head.weight) == "embed.weight"
    assert names.name(model.detached.module.bias) == "detached.bias"  # no "module." infix
    # The root's own tensors come before its children's: the shared buffer is named "shared".
    assert list(names.buffers) == ["shared", "body.1.running_var", "body.1.num_batches_tracked"]
    assert names.name(model.body[1].running_mean) == "shared"


def test_every_alias_is_kept_when_asked_for() -> None:
    model = Odd()
    every = Names.of(model, aliases=True)
    assert list(every.params) == Tree.of(model, keys=True).names
    assert every.params["head.weight"] is every.params["embed.weight"] is model.embed.weight
    assert list(every.buffers) == Tree.of(model, keys=True).buffer_names
    assert every.buffers["body.1.running_mean"] is every.buffers["shared"] is model.shared
    assert every.of_id == Names.of(model).of_id


def test_a_tensor_the_model_does_not_hold_is_described_by_its_shape() -> None:
    assert Names.of(Odd()).name(torch.zeros(2, 1)) == "<tensor of shape (2, 1)>"


def _sharded(state: Any) -> tuple[nn.Module, torch.Tensor]:
    """A Linear that looks like a fully_shard unit in one process: its FSDP state holds the
    registered weight as the sharded parameter and ``temporary`` as its unsharded twin."""
    model = nn.Sequential(nn.Linear(2, 2))
    unit = model[0]
    unit.__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {"_get_fsdp_state": state})
    return model, unit.weight


def test_an_fsdp2_temporary_is_named_as_its_sharded_parameter() -> None:
    temporary = torch.zeros(2, 2, requires_grad=True)
    param = SimpleNamespace(_unsharded_param=temporary)
    state = SimpleNamespace(_fsdp_param_groups=[SimpleNamespace(fsdp_params=[param])])
    model, weight = _sharded(lambda self: state)
    param.sharded_param = weight
    names = Names.of(model)
    assert names.name(temporary) == names.name(weight) == "0.weight"
    assert list(names.params) == ["0.weight", "0.bias"]
    assert names.params["0.weight"] is weight
    # Between forward and backward FSDP registers the temporary in the sharded one's place.
    model[0]._parameters["weight"] = temporary  # type: ignore[assignment]
    names = Names.of(model, aliases=True)
    assert names.params["0.weight"] is weight
    assert names.name(temporary) == "0.weight"


def test_an_fsdp2_unit_whose_state_cannot_be_read_is_refused() -> None:
    def state(self: nn.Module) -> None:
        raise AttributeError("no _fsdp_state")

    model, _ = _sharded(state)
    with pytest.raises(ShardedGraphError, match=r"^isolate: FSDPLinear is sharded with fully_"):
        Names.of(model)
