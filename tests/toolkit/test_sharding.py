"""Seeing through wrapped and sharded models, in one process: a wrapper whose graph leaves stand
for its parameters but cannot be mapped to them is refused (never a vacuous pass), and foreign
leaves that stand for nothing are ordinary. Sharded runs on 2 processes are in
tests/distributed/test_fsdp.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.func import functional_call

import isolate
import isolate.errors
import isolate.gradients
import isolate.reachability
from isolate._sharding import (
    ShardedView,
    canonical_parameters,
    check_leaves,
    check_wrappers,
    is_flat_parameter,
    settle,
    sharded_view,
)
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


def _fsdp1_unit(fqns: list[str], originals: list[nn.Parameter] | None) -> _FakeFsdp1Unit:
    """A unit built with use_orig_params=True over ``originals`` (``_params`` of the flat)."""
    flat = nn.Parameter(torch.zeros(4))
    flat._fqns = fqns  # type: ignore[attr-defined]
    flat._params = originals  # type: ignore[attr-defined]
    return _FakeFsdp1Unit(flat, use_orig_params=True)


def test_fsdp1_units_that_mix_frozen_and_trainable_parameters_are_named_in_one_warning() -> None:
    a_weight, a_bias, b_weight = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    mixed = _fsdp1_unit(["a.weight", "a.bias"], [a_weight, a_bias])
    many = [nn.Parameter(torch.zeros(1)) for _ in range(8)]
    mixed_many = _fsdp1_unit([f"c.{i}" for i in range(8)], many)
    frozen_unit = _fsdp1_unit(["b.weight"], [b_weight])
    empty = _FakeFsdp1Unit(nn.Parameter(torch.zeros(1)), use_orig_params=True)
    object.__setattr__(empty, "_handle", None)  # a unit that owns no parameter
    bare = _FakeFsdp1Unit(nn.Parameter(torch.zeros(1)), use_orig_params=True)
    object.__setattr__(bare, "_handle", SimpleNamespace())  # a handle without a flat
    model = nn.Sequential(mixed, frozen_unit, empty, bare, mixed_many)
    warnings: list[str] = []
    frozen = {"a.weight": a_weight, "b.weight": b_weight, "c.0": many[0]}
    check_wrappers(model, frozen, "apply()", warnings.append)
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "apply(): FSDP1 units mix frozen and trainable parameters (['a.weight', 'a.bias', "
        "'c.0', 'c.1', 'c.2', 'c.3', ... and 4 more]); FSDP1 keeps one flat gradient per unit"
    )
    # A unit all frozen or all trainable saves its gradients' memory: nothing to say.
    check_wrappers(model, {"b.weight": b_weight}, "apply()", warnings.append)
    check_wrappers(model, {}, "apply()", warnings.append)
    assert len(warnings) == 1
    # Not a module: the caller's own type check speaks.
    check_wrappers("model", {}, "apply()", warnings.append)  # type: ignore[arg-type]
    assert len(warnings) == 1


def test_an_fsdp1_unit_that_does_not_show_its_original_parameters_is_refused() -> None:
    # use_orig_params=True but no list of the originals, or a handle that does not say
    # which way it was built: the spec cannot tell what each parameter's flag is.
    without_originals = _fsdp1_unit(["a.weight"], None)
    unsaid = _fsdp1_unit(["a.weight"], [nn.Parameter(torch.zeros(2))])
    object.__setattr__(unsaid, "_handle", SimpleNamespace(flat_param=unsaid._handle.flat_param))
    for unit in (without_originals, unsaid):
        with pytest.raises(UnsupportedStrategyError, match=r"^apply\(\): the model holds Fully"):
            check_wrappers(nn.Sequential(unit), {}, "apply()", lambda text: None)


@pytest.fixture
def one_process() -> Iterator[None]:
    """A process group of one (gloo): fully_shard for real, every shard the whole tensor."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).detach().relu())  # type: ignore[no-any-return]


def _fully_shard(net: Net, *, head_stays_unsharded: bool = False) -> dict[str, torch.Tensor]:
    """Shard ``net`` with one unit per layer under a root unit; its sharded parameters."""
    fully_shard(net.encoder)
    fully_shard(net.head, reshard_after_forward=not head_stays_unsharded)
    fully_shard(net)
    sharded = dict(net.named_parameters())
    assert {type(p).__name__ for p in sharded.values()} == {"DTensor"}
    return sharded


def test_fully_shard_audits_read_the_temporaries_and_agree_with_backward(one_process: None) -> None:
    net = Net()
    sharded = _fully_shard(net)
    loss = net(torch.randn(2, 3)).sum()
    view = sharded_view([net], "walk()")
    assert view.units == [net, net.encoder, net.head]
    assert sharded_view([net.head, net], "walk()").units == [net.head, net, net.encoder]
    for p in sharded.values():
        members = view.family[id(p)]
        temporary = view.leaf(p)
        assert members[0] is p and temporary is members[1] and len(members) == 2
        assert type(temporary).__name__ == "Parameter" and temporary.shape == p.shape
        assert view.family[id(temporary)] is members
        assert view.canonical(temporary) is p and view.canonical(p) is p
    assert view.aliases({id(sharded["head.bias"]): "head.bias"}) == {
        id(sharded["head.bias"]): "head.bias",
        id(view.leaf(sharded["head.bias"])): "head.bias",
    }
    head_reached_as_backward_says(loss, net, sharded)


def head_reached_as_backward_says(
    loss: torch.Tensor, net: nn.Module, sharded: dict[str, nn.Parameter]
) -> None:
    """The walk and the gradient report of ``loss`` through ``net``'s sharded head, against a
    real backward (FSDP reduces into the sharded parameters' ``.grad``)."""
    reached = isolate.reachability.reachable_parameters(loss, net)
    report = isolate.gradients.gradient_report({"main": loss}, net)  # reshards the head
    loss.backward(retain_graph=True)
    assert reached == ("head.weight", "head.bias")
    assert [n for n, p in sharded.items() if p.grad is not None] == list(reached)
    expected = torch.cat([sharded[n].grad.full_tensor().reshape(-1) for n in reached]).norm()
    assert report["head"].norms["main"] == pytest.approx(float(expected), rel=1e-6)
    assert report["encoder"].norms["main"] is None


def test_settle_reshards_a_unit_left_unsharded(one_process: None) -> None:
    net = Net()
    sharded = _fully_shard(net, head_stays_unsharded=True)
    net(torch.randn(2, 3))  # a forward without backward, as validation runs
    registered = dict(net.named_parameters())
    temporaries = [n for n, p in registered.items() if p is not sharded[n]]
    assert temporaries == ["head.weight", "head.bias"]
    assert type(registered["head.weight"]).__name__ == "Parameter"
    canonical = canonical_parameters(net, registered)
    assert all(canonical[n] is sharded[n] for n in sharded)
    assert settle(net) == 3
    assert all(p is sharded[n] for n, p in net.named_parameters())
    assert settle("net") == 0  # type: ignore[arg-type]


def _old_layout_unit(group: object) -> nn.Module:
    """A fully_shard unit as torch < 2.8 kept it: one parameter group per state."""
    from torch.distributed.fsdp import FSDPModule

    state = SimpleNamespace(_fsdp_param_group=group)
    unit = nn.Linear(2, 2)
    unit.__class__ = type(
        "FSDPLinear", (FSDPModule, nn.Linear), {"_get_fsdp_state": lambda self: state}
    )
    return unit


def test_fsdp2_state_kept_as_one_group_is_read_and_an_unreadable_one_refused() -> None:
    unit = _old_layout_unit(None)
    assert sharded_view([unit], "walk()").family == {}  # a unit that owns no parameter
    temporary = torch.zeros(2, 2, requires_grad=True)
    param = SimpleNamespace(_unsharded_param=temporary)
    unit = _old_layout_unit(SimpleNamespace(fsdp_params=[param]))
    param.sharded_param = unit.weight
    view = sharded_view([unit], "walk()")
    members = view.family[id(temporary)]
    assert members[0] is unit.weight and members[1] is temporary and len(members) == 2
    assert canonical_parameters(unit, {"weight": temporary})["weight"] is unit.weight
    plain = nn.Linear(2, 1)
    canonical = canonical_parameters(plain, dict(plain.named_parameters()))
    assert canonical["weight"] is plain.weight and list(canonical) == ["weight", "bias"]
    unit.__class__._get_fsdp_state = lambda self: SimpleNamespace()  # type: ignore[attr-defined]
    with pytest.raises(ShardedGraphError, match=r"^isolate: FSDPLinear is sharded with fully_"):
        canonical_parameters(unit, {})
    with pytest.raises(ShardedGraphError, match=r"^walk\(\): FSDPLinear is sharded with fully_"):
        check_leaves(SimpleNamespace(leaves={}, consumers={}), [unit], "walk()")


def test_an_fsdp2_parameter_without_its_sharded_parameter_is_refused() -> None:
    # Only the temporary is found: mapping it to itself would hide the registered parameter.
    param = SimpleNamespace(_unsharded_param=torch.zeros(2, 2, requires_grad=True))
    unit = _old_layout_unit(SimpleNamespace(fsdp_params=[param]))
    with pytest.raises(ShardedGraphError) as caught:
        sharded_view([unit], "walk()")
    assert str(caught.value) == (
        "walk(): an FSDP2 parameter of FSDPLinear has no sharded parameter isolate can find; "
        "the audit refuses rather than guess"
    )
