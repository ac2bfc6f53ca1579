"""Seeing through wrapped and sharded models, in one process: a wrapper whose graph leaves stand
for its parameters but cannot be mapped to them is refused (never a vacuous pass), and foreign
leaves that stand for nothing are ordinary. Sharded runs on 2 processes are in
tests/distributed/test_fsdp.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.func import functional_call

import isolate
import isolate.errors
import isolate.reachability
from isolate._sharding import ShardedView, check_leaves, check_wrappers, is_flat_parameter
from isolate.errors import ShardedGraphError, UnsupportedStrategyError
from isolate.reachability import walk


class FlatViews(nn.Module):
    """A toy wrapper that runs its module on views of one hidden flat leaf, as FSDP1 and
    flat-buffer optimizers do: the registered parameters share the leaf's storage but are
    never in the graph."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        object.__setattr__(self, "_hidden", nn.Parameter(flat))  # a leaf, not registered
        offset = 0
        self._slices: dict[str, tuple[int, torch.Size]] = {}
        for name, p in module.named_parameters():
            p.data = flat[offset : offset + p.numel()].view_as(p)
            self._slices[name] = (offset, p.shape)
            offset += p.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat: torch.Tensor = object.__getattribute__(self, "_hidden")
        views = {n: flat[o : o + s.numel()].view(s) for n, (o, s) in self._slices.items()}
        return functional_call(self.module, views, (x,))  # type: ignore[no-any-return]


def test_wrapper_with_hidden_leaves_is_refused() -> None:
    model = FlatViews(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)))
    loss = model(torch.randn(2, 3)).sum()
    # Negative control: the walk finds none of the registered parameters; without the
    # refusal, "()" and a passing assert_isolated are a vacuous proof.
    found = walk([loss], "raw")
    assert not any(id(p) in found.leaves for p in model.parameters())
    with pytest.raises(ShardedGraphError, match=r"^reachable_parameters\(\): the graph's leaves"):
        isolate.reachability.reachable_parameters(loss, model)
    with pytest.raises(ShardedGraphError, match=r"^assert_isolated\(\): the graph's leaves"):
        isolate.assert_isolated(loss, model.module[0], model=model)
    with pytest.raises(ShardedGraphError, match=r"^gradient_report\(\): "):
        isolate.gradient_report({"main": loss}, model)
    assert issubclass(ShardedGraphError, isolate.errors.BlindSpotError)


def test_foreign_leaves_that_stand_for_nothing_are_fine() -> None:
    # Another model's parameters and inputs that require grad are ordinary foreign leaves.
    encoder, head = nn.Linear(3, 3), nn.Linear(3, 1)
    x = torch.randn(2, 3, requires_grad=True)
    loss = head(encoder(x).detach() + x).sum()
    assert isolate.reachability.reachable_parameters(loss, encoder) == ()
    isolate.assert_isolated(loss, encoder)
    assert isolate.reachability.reachable_parameters(loss, head) == ("weight", "bias")


class _FakeFsdp1Unit(FullyShardedDataParallel):
    """An FSDP1 unit as check_wrappers sees it (a flat parameter on a handle), built in one
    process without a process group."""

    def __init__(self, flat: nn.Parameter, *, use_orig_params: bool) -> None:
        nn.Module.__init__(self)
        handle = SimpleNamespace(flat_param=flat, _use_orig_params=use_orig_params)
        object.__setattr__(self, "_handle", handle)


def test_fsdp1_unit_without_orig_params_is_refused_naming_six_of_its_parameters() -> None:
    flat = nn.Parameter(torch.zeros(4))
    flat._fqns = [f"layer.{i}.weight" for i in range(8)]  # type: ignore[attr-defined]
    model = nn.Sequential(_FakeFsdp1Unit(flat, use_orig_params=False))
    with pytest.raises(UnsupportedStrategyError) as caught:
        check_wrappers(model, {}, "apply()", lambda text: None)
    shown_names = "'layer.0.weight', 'layer.1.weight', 'layer.2.weight', 'layer.3.weight', "
    shown_names += "'layer.4.weight', 'layer.5.weight', ... and 2 more"
    assert str(caught.value).startswith(
        f"apply(): the model holds FullyShardedDataParallel units built with "
        f"use_orig_params=False (_FakeFsdp1Unit over [{shown_names}]): "
    )


def test_flat_parameter_leaf_is_refused_with_or_without_its_names() -> None:
    model = nn.Linear(2, 2)
    named = nn.Parameter(torch.zeros(3))
    named._is_flat_param = True  # type: ignore[attr-defined]
    named._fqns = ["a.weight", "a.bias"]  # type: ignore[attr-defined]
    unnamed = nn.Parameter(torch.zeros(3))
    unnamed._is_flat_param = True  # type: ignore[attr-defined]
    found = SimpleNamespace(leaves={id(named): named, id(unnamed): unnamed}, consumers={})
    with pytest.raises(ShardedGraphError) as caught:
        check_leaves(found, [model], "walk()", view=ShardedView())
    assert str(caught.value).startswith(
        "walk(): the graph's leaves include 2 FSDP1 FlatParameter(s), each holding many "
        "parameters in one flat tensor (['a.weight', 'a.bias']); "
    )


def test_a_mapped_parameter_takes_its_temporarys_consumers_or_none() -> None:
    # An FSDP2 parameter whose unsharded temporary is the graph's leaf: after the mapping
    # the registered parameter is a leaf too, with a copy of the temporary's consumers.
    model = nn.Linear(2, 2)
    sharded, temporary = model.weight, torch.zeros(2, 2, requires_grad=True)
    family = [sharded, temporary]
    view = ShardedView(family={id(sharded): family, id(temporary): family}, units=[])
    found = SimpleNamespace(leaves={id(temporary): temporary}, consumers={})
    assert check_leaves(found, [model], "walk()", view=view) is view
    assert found.leaves[id(sharded)] is sharded
    assert found.consumers == {id(sharded): []}
    consumers = ["node"]
    found = SimpleNamespace(leaves={id(temporary): temporary}, consumers={id(temporary): consumers})
    check_leaves(found, [model], "walk()", view=view)
    assert found.consumers[id(sharded)] == ["node"]
    assert found.consumers[id(sharded)] is not consumers


def test_the_leaf_of_a_sharded_parameter_is_its_temporary_of_the_full_shape() -> None:
    sharded = nn.Parameter(torch.zeros(4, 2))  # a DTensor's shape is the global one
    shard = torch.zeros(2, 2)  # a post-forward shard: as many dims, not the full shape
    full = torch.zeros(4, 2)  # the all-gathered temporary the graph differentiates
    family = [sharded, shard, full]
    view = ShardedView(family={id(t): family for t in family}, units=[])
    assert view.leaf(sharded) is full
    view = ShardedView(family={id(sharded): [sharded, shard]}, units=[])
    assert view.leaf(sharded) is sharded  # not gathered: the parameter itself
    plain = torch.zeros(1)
    assert view.leaf(plain) is plain


def test_a_flat_parameter_is_known_by_its_flag_or_by_its_type_name() -> None:
    class FlatParameter(nn.Parameter):  # as FSDP1 names it, without the flag
        pass

    flagged = nn.Parameter(torch.zeros(2))
    flagged._is_flat_param = True  # type: ignore[attr-defined]
    assert is_flat_parameter(FlatParameter(torch.zeros(2))) and is_flat_parameter(flagged)
    assert not is_flat_parameter(nn.Parameter(torch.zeros(2)))
    assert not is_flat_parameter("FlatParameter")
