"""Which foreign graph leaves stand for a model's parameters: the refusals of check_leaves name
every parameter stood for (storage shared with a DTensor's local shard, the full shape of a
DTensor no fully_shard unit owns), and leaves that stand for nothing (another model's
parameters of the same shapes, parameters that are views of one buffer, storage-less
tensors) are ordinary, as a real backward shows."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import isolate
import isolate.gradients
from isolate._sharding import ShardedView, check_leaves, check_wrappers
from isolate.errors import ShardedGraphError, UnsupportedStrategyError
from isolate.reachability import reachable_parameters
from tests.toolkit.test_sharding import (
    FlatViews,
    Net,
    _FakeFsdp1Unit,
    head_reached_as_backward_says,
    one_process,
)

__all__ = ["one_process"]  # the one-process gloo group fixture, imported for pytest to find


def _grads(loss: torch.Tensor, model: nn.Module) -> tuple[str, ...]:
    """Brute force: the parameters a real backward gives a gradient."""
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    return tuple(n for n, p in model.named_parameters() if p.grad is not None)


def test_another_models_parameters_of_the_same_shapes_stand_for_nothing() -> None:
    # A teacher (or EMA copy) of the same architecture: its leaves have every shape of the
    # student's parameters, and share none of their storage.
    student = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    teacher = copy.deepcopy(student)
    loss = teacher(torch.randn(2, 3)).sum()
    assert reachable_parameters(loss, student) == () == _grads(loss, student)
    isolate.assert_isolated(loss, student)
    assert reachable_parameters(loss, teacher) == ("0.weight", "0.bias", "1.weight", "1.bias")


def test_parameters_that_are_views_of_one_buffer_are_ordinary_leaves() -> None:
    # A contiguous-parameter optimizer makes every parameter a view of one flat buffer: the
    # parameters reached share storage with those not reached, and stand for nothing.
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    offset = 0
    for p in model.parameters():
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    loss = model[2](model[1](model[0](torch.randn(2, 3))).detach()).sum()
    assert reachable_parameters(loss, model) == ("2.weight", "2.bias") == _grads(loss, model)
    isolate.assert_isolated(loss, model[0], model=model)


def test_storage_less_tensors_share_no_storage() -> None:
    # Sparse tensors have no storage to compare: a sparse leaf of another model does not
    # stand for the model's sparse parameter (of another shape).
    model, other = nn.Module(), nn.Module()
    model.table = nn.Parameter(
        torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (5,), check_invariants=True)
    )
    other.table = nn.Parameter(
        torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), check_invariants=True)
    )
    loss = torch.sparse.sum(other.table * 2.0)
    assert reachable_parameters(loss, model) == () == _grads(loss, model)
    assert reachable_parameters(loss, other) == ("table",) == _grads(loss, other)


def test_a_wrapper_refusal_names_six_of_the_parameters_its_leaves_stand_for() -> None:
    model = FlatViews(nn.Sequential(*(nn.Linear(2, 2) for _ in range(4))))
    loss = model(torch.randn(1, 2)).sum()
    with pytest.raises(ShardedGraphError) as caught:
        reachable_parameters(loss, model)
    shown = ", ".join(f"'module.{i}.{k}'" for i in range(3) for k in ("weight", "bias"))
    assert str(caught.value).startswith(
        "reachable_parameters(): the graph's leaves are not the model's parameters: "
    )
    assert f"some stand for parameters of FlatViews ([{shown}, ... and 2 more]) - a" in str(
        caught.value
    )
    # Audited through two of its modules: both are named, and each parameter once.
    with pytest.raises(ShardedGraphError) as caught:
        isolate.assert_isolated(loss, [model.module[0], model.module[3]])
    assert "some stand for parameters of Linear, Linear (['weight', 'bias']) - a" in str(
        caught.value
    )


def test_a_flat_parameter_refusal_names_six_of_its_parameters() -> None:
    flat = nn.Parameter(torch.zeros(3))
    flat._is_flat_param = True  # type: ignore[attr-defined]
    flat._fqns = [f"layer.{i}" for i in range(8)]  # type: ignore[attr-defined]
    found = SimpleNamespace(leaves={id(flat): flat}, consumers={})
    with pytest.raises(ShardedGraphError) as caught:
        check_leaves(found, [nn.Linear(2, 2)], "walk()", view=ShardedView())
    shown = ", ".join(f"'layer.{i}'" for i in range(6))
    assert f"in one flat tensor ([{shown}, ... and 2 more]); the walk" in str(caught.value)


def test_fsdp1_units_whose_flat_parameter_lists_no_names_are_still_refused_or_warned() -> None:
    bare = nn.Parameter(torch.zeros(4))  # no _fqns: a torch that keeps the names elsewhere
    warnings: list[str] = []
    unit = _FakeFsdp1Unit(bare, use_orig_params=False)
    with pytest.raises(UnsupportedStrategyError, match=r"^apply\(\): .* \(_FakeFsdp1Unit over "):
        check_wrappers(nn.Sequential(unit), {}, "apply()", warnings.append)
    a, b, c = (nn.Parameter(torch.zeros(1)) for _ in range(3))
    unnamed = nn.Parameter(torch.zeros(4))
    unnamed._params = [a, b]  # type: ignore[attr-defined]
    named = nn.Parameter(torch.zeros(4))
    named._params, named._fqns = [c, b], ["c", "b"]  # type: ignore[attr-defined]
    units = [_FakeFsdp1Unit(f, use_orig_params=True) for f in (unnamed, named)]
    check_wrappers(nn.Sequential(*units), {"a": a, "c": c}, "apply()", warnings.append)
    # The unit without names does not stop the warning about the others.
    assert len(warnings) == 1 and "mix frozen and trainable parameters (['c', 'b'])" in warnings[0]


class Parallel(nn.Module):
    """A layer sharded by hand (tensor parallel): its weight is a DTensor no fully_shard unit
    owns, and ``gather`` is the leaf its forward runs on, if any."""

    def __init__(self, gather: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (1,))
        self.weight = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        self.probe = nn.Linear(3, 1)
        local = self.weight.to_local().detach()
        leaves = {
            "view": lambda: local.requires_grad_(),  # the local shard's own storage
            "copy": lambda: nn.Parameter(self.weight.full_tensor().detach().clone()),
        }
        object.__setattr__(self, "_gathered", leaves[gather]() if gather else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = object.__getattribute__(self, "_gathered")  # a leaf, not registered
        weight = self.weight.to_local() if gathered is None else gathered
        return x @ weight.T + self.probe(x.detach()).detach()


def test_a_dtensor_no_unit_owns_is_its_own_leaf(one_process: None) -> None:
    model = Parallel()
    x = torch.randn(2, 3)
    loss = model(x).sum()
    assert reachable_parameters(loss, model) == ("weight",) == _grads(loss, model)
    isolate.assert_isolated(loss, model.probe, model=model)
    isolate.assert_isolated(loss, [model.probe.weight], model=model)
    with pytest.raises(isolate.errors.GradientLeakError):
        isolate.assert_isolated(loss, [model.weight], model=model)
    isolate.assert_isolated(model.probe(x).sum(), [model.weight], model=model)


@pytest.mark.parametrize("gather", ["view", "copy"])
def test_a_leaf_standing_for_a_dtensor_no_unit_owns_is_refused(
    one_process: None, gather: str
) -> None:
    # The forward runs on a view of the local shard, or on a gathered copy of the full
    # shape: the registered DTensor is never reached, though the loss is computed from it.
    model = Parallel(gather)
    loss = model(torch.randn(2, 3)).sum()
    assert _grads(loss, model) == ()  # what a vacuous walk would report
    with pytest.raises(ShardedGraphError) as caught:
        reachable_parameters(loss, model)
    assert str(caught.value).startswith(
        "reachable_parameters(): the graph's leaves are not the model's parameters: some stand "
        "for parameters of Parallel (['weight']) - a wrapper"
    )


def test_fully_shard_leaves_behind_other_leaves_are_mapped_and_agree_with_backward(
    one_process: None,
) -> None:
    # A scale outside the model is the first leaf the walk meets, and another module of the
    # encoder's shapes is reached: neither stands for a parameter of the sharded net.
    net, twin, scale = Net(), nn.Linear(3, 4), nn.Parameter(torch.tensor(2.0))
    fully_shard(net.encoder)
    fully_shard(net.head, reshard_after_forward=False)  # left unsharded after the forward
    fully_shard(net)
    sharded = dict(net.named_parameters())
    x = torch.randn(2, 3)
    loss = scale * (net(x).sum() + twin(x).sum())
    # Audited by the sharded parameters the caller holds: the head's are not registered now.
    assert net.head.weight is not sharded["head.weight"]
    isolate.assert_isolated(loss, [sharded["encoder.weight"]], model=net)
    with pytest.raises(isolate.errors.GradientLeakError):
        isolate.assert_isolated(loss, [sharded["head.weight"]], model=net)
    head_reached_as_backward_says(loss, net, sharded)
