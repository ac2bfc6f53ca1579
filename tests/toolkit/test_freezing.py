"""freeze / unfreeze / frozen / Frozen: exact round trips, selectors, BatchNorm, errors."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import isolate
from isolate import Frozen, IsolationError, freeze, frozen
from isolate.errors import IsolationTypeError, RestoreError, SelectorError, WrappingError
from isolate.freezing import FreezeHandle, is_frozen, unfreeze, unfrozen
from tests.toolkit._shared import Scaled


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.aux = nn.Sequential(nn.BatchNorm1d(8, affine=False), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def state(model: nn.Module) -> dict[str, Any]:
    """Everything a freeze may touch, for exact comparisons."""
    return {
        "flags": {n: p.requires_grad for n, p in model.named_parameters()},
        "ids": {n: id(p) for n, p in model.named_parameters()},
        "classes": {n: type(m) for n, m in model.named_modules()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "hooks": {
            n: len(m._forward_pre_hooks) + len(m._forward_hooks) for n, m in model.named_modules()
        },
    }


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


def test_freeze_and_restore_round_trip(net: Net) -> None:
    before = state(net)
    handle = freeze(net, "trunk")
    assert handle.names == (
        "trunk.0.weight",
        "trunk.0.bias",
        "trunk.1.weight",
        "trunk.1.bias",
        "trunk.3.weight",
        "trunk.3.bias",
    )
    assert handle.norms == ("trunk.1",)
    assert all(not p.requires_grad for p in net.trunk.parameters())
    assert all(p.requires_grad for p in net.head.parameters())
    assert not net.trunk[1].training and net.aux[0].training
    handle.restore()
    assert state(net) == before
    assert not handle.active


@pytest.mark.parametrize(
    ("selectors", "expected"),
    [
        (
            ("trunk",),
            {
                "trunk.0.weight",
                "trunk.0.bias",
                "trunk.1.weight",
                "trunk.1.bias",
                "trunk.3.weight",
                "trunk.3.bias",
            },
        ),
        (
            ("trunk.*",),
            {
                "trunk.0.weight",
                "trunk.0.bias",
                "trunk.1.weight",
                "trunk.1.bias",
                "trunk.3.weight",
                "trunk.3.bias",
            },
        ),
        (("*.bias",), {"trunk.0.bias", "trunk.1.bias", "trunk.3.bias", "head.bias", "aux.1.bias"}),
        (("head.weight",), {"head.weight"}),
        (("trunk.3", "head"), {"trunk.3.weight", "trunk.3.bias", "head.weight", "head.bias"}),
        ((lambda name, p: p.ndim == 2 and name.startswith("aux"),), {"aux.1.weight"}),
    ],
)
def test_selectors(net: Net, selectors: tuple[Any, ...], expected: set[str]) -> None:
    with frozen(net, *selectors) as handle:
        assert set(handle.names) == expected
        assert {n for n, p in net.named_parameters() if not p.requires_grad} == expected


def test_module_and_parameter_objects_as_selectors(net: Net) -> None:
    with frozen(net, net.head, net.trunk[0].weight) as handle:
        assert handle.names == ("trunk.0.weight", "head.weight", "head.bias")


def test_no_selector_freezes_everything(net: Net) -> None:
    with frozen(net) as handle:
        assert len(handle.names) == len(list(net.parameters()))
        assert handle.norms == ("trunk.1", "aux.0")
        assert is_frozen(net)


def test_pre_frozen_parameters_stay_frozen(net: Net) -> None:
    net.head.bias.requires_grad_(False)
    with frozen(net, "head"):
        assert not net.head.weight.requires_grad
    assert net.head.weight.requires_grad and not net.head.bias.requires_grad
    with unfrozen(net, "head"):
        assert net.head.bias.requires_grad
    assert not net.head.bias.requires_grad


def test_nesting_restores_each_level(net: Net) -> None:
    before = state(net)
    with frozen(net, "trunk"):
        mid = state(net)
        with frozen(net):
            with unfrozen(net, "trunk.3"):
                assert net.trunk[3].weight.requires_grad and not net.trunk[0].weight.requires_grad
            assert is_frozen(net)
        assert state(net) == mid
    assert state(net) == before


def test_exception_inside_the_block_restores(net: Net) -> None:
    before = state(net)
    with pytest.raises(KeyError), frozen(net, "trunk", "head"):
        raise KeyError("boom")
    assert state(net) == before


def test_freeze_drops_gradients(net: Net) -> None:
    net(torch.randn(5, 4)).sum().backward()
    assert net.trunk[0].weight.grad is not None
    with frozen(net, "trunk"):
        assert all(p.grad is None for p in net.trunk.parameters())
        assert net.head.weight.grad is not None
        net(torch.randn(5, 4)).sum().backward()
        assert all(p.grad is None for p in net.trunk.parameters())


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        (
            "backbone.*",
            r"^freeze\(\): 'backbone\.\*' matched no parameter of Net; its children "
            r"are \['trunk', 'head', 'aux'\]",
        ),
        ("backbone", r"^freeze\(\): 'backbone' matched no parameter of Net"),
        ("trunk.2", r"^freeze\(\): 'trunk\.2' matched no parameter"),  # ReLU: nothing to freeze
        ("trunk.[0", r"^freeze\(\): malformed glob 'trunk\.\[0'"),
        ("", r"^freeze\(\): empty selector"),
        (lambda n, p: False, r"^freeze\(\): '<lambda>' matched no parameter"),
    ],
)
def test_bad_selectors_raise_before_anything_changes(net: Net, selector: Any, message: str) -> None:
    before = state(net)
    with pytest.raises(SelectorError, match=message) as info:
        freeze(net, "head", selector)  # the valid first selector must not be half-applied
    assert isinstance(info.value, ValueError) and isinstance(info.value, IsolationError)
    assert state(net) == before


def test_foreign_module_and_parameter_selectors(net: Net) -> None:
    before = state(net)
    with pytest.raises(SelectorError, match=r"not a submodule of Net"):
        freeze(net, nn.Linear(2, 2))
    with pytest.raises(SelectorError, match=r"is not a parameter of Net"):
        freeze(net, nn.Parameter(torch.ones(2)))
    assert state(net) == before


def test_wrong_types(net: Net) -> None:
    with pytest.raises(
        IsolationTypeError, match=r"^freeze\(\): model must be a torch\.nn\.Module, got Tensor"
    ):
        freeze(torch.ones(2), "x")  # type: ignore[arg-type]
    with pytest.raises(IsolationTypeError, match=r"^freeze\(\): a selector must be .* got int 3"):
        freeze(net, 3)  # type: ignore[arg-type]
    with pytest.raises(SelectorError, match=r"^freeze\(\): bn='frozen' is not a BatchNorm policy"):
        freeze(net, bn="frozen")  # type: ignore[arg-type]


def test_a_module_class_as_selector_is_refused_with_the_type_selector_to_write(net: Net) -> None:
    before = state(net)
    with pytest.raises(
        IsolationTypeError,
        match=r"^freeze\(\): a selector must be .*; got the class BatchNorm1d itself\. To select "
        r"every BatchNorm1d module, write 'type:BatchNorm1d'$",
    ):
        freeze(net, "head", nn.BatchNorm1d)  # type: ignore[arg-type]
    assert state(net) == before
    with pytest.raises(IsolationTypeError, match=r"^is_frozen\(\): .* write 'type:Linear'$"):
        is_frozen(net, nn.Linear)  # type: ignore[arg-type]


def test_is_frozen_names_itself_in_its_errors() -> None:
    with pytest.raises(
        IsolationTypeError, match=r"^is_frozen\(\): model must be a torch\.nn\.Module, got str"
    ):
        isolate.freezing.is_frozen("model")  # type: ignore[arg-type]
    with pytest.raises(SelectorError, match=r"^is_frozen\(\): 'zz' matched no parameter of Linear"):
        isolate.freezing.is_frozen(nn.Linear(2, 1), "zz")


def test_unfreeze_refuses_integer_parameters() -> None:
    model = nn.Linear(2, 2)
    model.register_parameter(
        "steps", nn.Parameter(torch.zeros(1, dtype=torch.long), requires_grad=False)
    )
    with pytest.raises(
        IsolationTypeError, match=r"^unfreeze\(\): parameters \['steps'\] are not floating"
    ):
        unfreeze(model)
    assert not model.steps.requires_grad and model.weight.requires_grad


def test_restore_twice_and_out_of_order(net: Net) -> None:
    outer = freeze(net, "trunk")
    inner = freeze(net, "trunk.0")
    with pytest.raises(RestoreError, match=r"^freeze\(\): restored out of order"):
        outer.restore()
    assert not net.trunk[0].weight.requires_grad  # the refused restore changed nothing
    inner.restore()
    outer.restore()
    with pytest.raises(RestoreError, match=r"^freeze\(\): this handle was restored already"):
        outer.restore()
    assert all(p.requires_grad for p in net.parameters())


def test_disjoint_handles_restore_in_any_order(net: Net) -> None:
    before = state(net)
    first, second = freeze(net, "trunk"), freeze(net, "head")
    first.restore()
    second.restore()
    assert state(net) == before


def test_handle_repr(net: Net) -> None:
    with frozen(net, "head") as handle:
        assert isinstance(handle, FreezeHandle)
        assert (
            repr(handle) == "FreezeHandle(freeze on Net: 2 parameters, 0 BatchNorm layers, active)"
        )
    assert repr(handle).endswith("restored)")


def test_a_handle_without_optimizer_has_no_exposures_and_says_what_it_holds() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    handle = isolate.freeze(model)
    assert handle.exposures == ()
    assert (
        repr(handle)
        == "FreezeHandle(freeze on Sequential: 4 parameters, 1 BatchNorm layers, active)"
    )
    handle.restore()
    assert repr(handle).endswith(", restored)")
    inner = isolate.freezing.unfreeze(model, "0")
    assert (
        repr(inner)
        == "FreezeHandle(unfreeze on Sequential: 2 parameters, 0 BatchNorm layers, active)"
    )
    inner.restore()


# --- BatchNorm policy -------------------------------------------------------------------


def test_bn_eval_holds_statistics_across_train_mode_forwards(net: Net) -> None:
    bn = net.trunk[1]
    stats = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    with frozen(net, "trunk", bn="eval"):
        for _ in range(3):
            net.train()  # what a parent or Lightning does every epoch
            net(torch.randn(16, 4))
        bn.training = True  # what Lightning's _ModuleMode.restore does
        net(torch.randn(16, 4))
        assert torch.equal(bn.running_mean, stats[0])
        assert torch.equal(bn.running_var, stats[1])
        assert torch.equal(bn.num_batches_tracked, stats[2])
    assert bn.training
    assert not bn._forward_pre_hooks  # nothing left behind
    net(torch.randn(16, 4))
    assert not torch.equal(bn.running_mean, stats[0])


def test_bn_train_lets_statistics_update(net: Net) -> None:
    bn = net.trunk[1]
    mean = bn.running_mean.clone()
    with frozen(net, "trunk", bn="train") as handle:
        assert handle.norms == ("trunk.1",)
        net(torch.randn(16, 4))
        assert not torch.equal(bn.running_mean, mean)
        assert not bn.weight.requires_grad


def test_bn_without_affine_is_covered_by_module_and_glob_selectors(net: Net) -> None:
    with frozen(net, "aux") as by_name:
        assert by_name.norms == ("aux.0",)
    with frozen(net, "aux.*") as by_glob:
        assert by_glob.norms == ("aux.0",)
    with frozen(net, net.aux) as by_object:
        assert by_object.norms == ("aux.0",)


def test_unfreeze_releases_a_held_batchnorm_and_restore_holds_it_again(net: Net) -> None:
    bn = net.trunk[1]
    with frozen(net, "trunk"):
        with unfrozen(net, "trunk.1"):
            assert bn.training and bn.weight.requires_grad
            mean = bn.running_mean.clone()
            net(torch.randn(16, 4))
            assert not torch.equal(bn.running_mean, mean)
        assert not bn.training
        net.train()
        mean = bn.running_mean.clone()
        net(torch.randn(16, 4))
        assert torch.equal(bn.running_mean, mean)


def test_training_mode_is_restored_exactly(net: Net) -> None:
    net.eval()
    net.trunk.train()
    before = state(net)
    with frozen(net):
        net.train()
    net.eval()
    net.trunk.train()
    assert state(net) == before


# --- Frozen ---------------------------------------------------------------------------


def test_frozen_outputs_carry_no_grad_fn_and_keep_statistics(net: Net) -> None:
    wrapped = Frozen(net.trunk).train()
    bn = net.trunk[1]
    mean = bn.running_mean.clone()
    out = wrapped(torch.randn(8, 4))
    assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(bn.running_mean, mean)
    assert all(not p.requires_grad for p in wrapped.parameters())
    wrapped.unwrap()


def test_frozen_records_no_activations(net: Net) -> None:
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    x = torch.randn(8, 4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net.trunk(x)
        plain = len(saved)
        saved.clear()
        wrapped = Frozen(net.trunk)
        wrapped(x)
    assert plain > 0 and saved == []
    wrapped.unwrap()


def test_frozen_passes_gradient_to_inputs_but_not_to_parameters(net: Net) -> None:
    wrapped = Frozen(net.trunk)
    x = torch.randn(8, 4, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in net.trunk.parameters())
    wrapped.unwrap()


def test_frozen_lets_gradient_through_to_an_input_passed_by_keyword() -> None:
    frozen = isolate.Frozen(Scaled())
    scale = torch.ones(2, requires_grad=True)
    frozen(torch.ones(2), scale=scale).sum().backward()
    assert torch.equal(scale.grad, torch.full((2,), 2.0))  # type: ignore[arg-type]
    assert frozen.module.weight.grad is None
    frozen.unwrap()


def test_frozen_forward_matches_eval_forward(net: Net) -> None:
    x = torch.randn(8, 4)
    net.trunk.eval()
    expected = net.trunk(x)
    net.trunk.train()
    wrapped = Frozen(net.trunk)
    assert torch.equal(wrapped(x), expected)
    wrapped.unwrap()


def test_frozen_unwrap_round_trip_and_state_dict_keys(net: Net) -> None:
    before = state(net.trunk)
    keys = list(net.trunk.state_dict())
    wrapped = Frozen(net.trunk)
    assert list(wrapped.state_dict()) == keys
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in net.trunk.parameters()]
    net.trunk = wrapped  # type: ignore[assignment]
    saved = net.state_dict()
    assert "trunk.0.weight" in saved and not any(".module." in k for k in saved)
    fresh = Net()
    fresh.trunk = Frozen(fresh.trunk)  # type: ignore[assignment]
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.trunk.module[0].weight, wrapped.module[0].weight)
    plain = Net()
    plain.load_state_dict(saved)
    assert torch.equal(plain.trunk[0].weight, wrapped.module[0].weight)
    inner = wrapped.unwrap()
    assert inner is wrapped.module
    assert state(inner) == before


def test_frozen_refuses_double_wrapping_and_non_modules(net: Net) -> None:
    wrapped = Frozen(net.trunk)
    with pytest.raises(
        WrappingError, match=r"^Frozen\(\): the module is already wrapped in Frozen"
    ):
        Frozen(wrapped)
    with pytest.raises(
        WrappingError, match=r"^Frozen\(\): this Sequential is already wrapped in a live Frozen"
    ):
        Frozen(net.trunk)
    wrapped.unwrap()
    Frozen(net.trunk).unwrap()  # allowed again once unwrapped
    with pytest.raises(
        IsolationTypeError, match=r"^Frozen\(\): the wrapped object must be a torch\.nn\.Module"
    ):
        Frozen(lambda x: x)  # type: ignore[arg-type]


def test_public_names_are_sorted_and_exported() -> None:
    assert isolate.__all__ == sorted(isolate.__all__)
    assert all(hasattr(isolate, name) for name in isolate.__all__)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.decode = nn.Linear(4, 10, bias=False)
        self.decode.weight = self.embed.weight  # tied


def test_tied_parameters_go_by_their_first_name_and_match_every_alias() -> None:
    model = Tied()
    assert [n for n, _ in model.named_parameters()] == ["embed.weight", "body.weight", "body.bias"]
    with frozen(model, "decode") as handle:
        assert handle.names == ("embed.weight",)
        assert not model.decode.weight.requires_grad and model.body.weight.requires_grad
    with frozen(model) as everything:
        assert everything.names == ("embed.weight", "body.weight", "body.bias")
    assert all(p.requires_grad for p in model.parameters())


class Siamese(nn.Module):
    """One trunk reached by two names: the BatchNorm and the dropout go by ``left.*``."""

    def __init__(self) -> None:
        super().__init__()
        trunk = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False), nn.Dropout(0.5))
        self.left = trunk
        self.right = trunk
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.right(x))


@pytest.mark.parametrize("selector", ["right", "right.*", "left"])
def test_a_shared_module_is_held_whichever_of_its_names_selects_it(selector: str) -> None:
    torch.manual_seed(0)
    model = Siamese()
    bn = model.right[1]
    with frozen(model, selector, mode="eval") as handle:
        assert handle.names == ("left.0.weight", "left.0.bias")
        assert handle.held == ("left.1", "left.2")
        assert handle.norms == ("left.1",)
        assert isolate.freezing.held_in_eval(model) == ("left.1", "left.2")
        mean = bn.running_mean.clone()
        x = torch.randn(4, 2)
        out = model.train()(x)
        assert torch.equal(bn.running_mean, mean)
        assert torch.equal(out, model(x))  # the dropout is held too: the forward is fixed
    with frozen(model, selector) as by_bn:
        assert by_bn.norms == ("left.1",)
    assert bn.training and model.right[2].training
    assert not bn._forward_pre_hooks


def test_freeze_names_optimizer_groups_that_could_still_move_frozen_parameters(net: Net) -> None:
    decayed = torch.optim.SGD(
        [
            {"params": net.trunk.parameters(), "weight_decay": 1e-2},
            {"params": net.head.parameters(), "weight_decay": 0.0},
        ],
        lr=0.1,
    )
    with pytest.warns(
        isolate.IsolationWarning, match=r"^freeze\(\): optimizer param group\(s\) \[0\]"
    ):
        handle = freeze(net, "trunk", "head", optimizer=decayed)
    assert [e.name for e in handle.exposures] == list(handle.names[:6])
    assert all(e.group == 0 for e in handle.exposures)
    handle.restore()
    plain = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = freeze(net, "head", optimizer=plain)
    assert quiet.exposures == ()
    quiet.restore()
    with pytest.raises(IsolationTypeError, match=r"^freeze\(\): optimizer must be"):
        freeze(net, "head", optimizer="sgd")  # type: ignore[arg-type]


# Everything is validated before the first flag flips: a parameter that cannot be frozen
# (uninitialized lazy, made under inference mode) is refused and nothing changes.


def _lazy_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.LazyLinear(2))


LAZY = (
    r"parameters '2\.weight', '2\.bias' of Sequential are uninitialized lazy parameters "
    r"\(UninitializedParameter, from nn\.LazyLinear and friends\), whose requires_grad cannot be "
    r"set; nothing was changed\. Fix: run one forward pass with a sample batch first"
)


@pytest.mark.parametrize(
    ("call", "caller"),
    [
        (lambda m: freeze(m), r"freeze\(\)"),
        (lambda m: freeze(m, "0", "2"), r"freeze\(\)"),
        (lambda m: unfreeze(m, "*.bias", "2.weight"), r"unfreeze\(\)"),
        (lambda m: frozen(m).__enter__(), r"freeze\(\)"),
        (lambda m: Frozen(m), r"Frozen\(\)"),
        (
            lambda m: FreezeHandle(
                m, "spec()", dict(m.named_parameters()), {"1": m[1]}, False, "eval"
            ),
            r"spec\(\)",
        ),
    ],
)
def test_uninitialized_lazy_parameters_are_refused_before_any_change(
    call: Any, caller: str
) -> None:
    model = _lazy_model()
    model[0].weight.requires_grad_(False)  # a flag the user set, to be kept as it is
    before = state(model)
    with pytest.raises(IsolationTypeError, match=rf"^{caller}: {LAZY}"):
        call(model)
    assert state(model) == before
    assert model[0].weight.requires_grad is False and model[2].weight.requires_grad is True
    model(torch.randn(5, 3))  # the fix: one forward materializes them (LazyLinear -> Linear)
    wrapped = Frozen(model)  # the refused call left no live wrapper behind
    assert not any(p.requires_grad for p in model.parameters())
    wrapped.unwrap()
    after = state(model)
    assert (after["flags"], after["ids"], after["modes"]) == (
        before["flags"],
        before["ids"],
        before["modes"],
    )


def test_the_initialized_part_of_a_lazy_model_can_be_frozen() -> None:
    model = _lazy_model()
    with frozen(model, "0", "1") as handle:
        assert handle.names == ("0.weight", "0.bias", "1.weight", "1.bias")
        assert not model[0].weight.requires_grad and model[2].weight.requires_grad


def test_parameters_made_under_inference_mode_are_refused_before_any_change() -> None:
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    before = state(model)
    # requires_grad=True cannot be set on them again, so a freeze could never be restored.
    with pytest.raises(
        IsolationTypeError,
        match=r"^freeze\(\): parameters '0\.weight', '0\.bias', '1\.weight', '1\.bias' of "
        r"Sequential were created under torch\.inference_mode\(\), so requires_grad=True can "
        r"never be set on them again and this change could not be undone; nothing was changed",
    ):
        freeze(model)
    assert state(model) == before
    model[1].weight.requires_grad_(False)
    with pytest.raises(IsolationTypeError, match=r"^unfreeze\(\): parameter '1\.weight' of"):
        unfreeze(model, "1")
    with frozen(model, "1.weight"):  # already frozen: nothing to flip, nothing to undo
        pass


def test_frozen_holds_a_batchnorm_without_affine_parameters() -> None:
    bn = nn.BatchNorm1d(3, affine=False)  # no parameters at all: only statistics to hold
    wrapped = Frozen(bn).train()
    wrapped(torch.randn(5, 3))
    assert not bn.training and torch.equal(bn.running_mean, torch.zeros(3))
    assert wrapped.unwrap() is bn
    bn.train()
    bn(torch.randn(5, 3))
    assert bn.training and bn.running_mean.abs().sum() > 0


# The resolved path checks each condition in one pass and writes flags by assignment; these
# pin what it must still do: call a subclass's requires_grad_, restore mixed flags exactly,
# name the one bad parameter among many.


class Counting(nn.Parameter):
    """A parameter subclass with its own requires_grad_, which must still be called."""

    calls: ClassVar[list[bool]] = []

    def requires_grad_(self, requires_grad: bool = True) -> Counting:
        Counting.calls.append(requires_grad)
        return super().requires_grad_(requires_grad)  # type: ignore[return-value]


def test_a_large_selection_with_mixed_flags_and_a_subclass_round_trips_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(50)))
    model[7].weight = Counting(model[7].weight.detach())
    flags = [i % 3 != 0 for i in range(100)]
    for p, flag in zip(model.parameters(), flags, strict=True):
        p.requires_grad_(flag)
    model[3].bias.grad = torch.zeros(2)
    model[4].bias.grad = torch.ones(2)  # a frozen parameter with a grad: dropped as well
    model[4].bias.requires_grad_(False)
    flags[9] = False
    ids = [id(p) for p in model.parameters()]
    Counting.calls.clear()
    handle = FreezeHandle(model, "spec()", dict(model.named_parameters()), {}, False, "eval")
    assert not any(p.requires_grad for p in model.parameters())
    assert model[3].bias.grad is None and model[4].bias.grad is None
    assert Counting.calls == [False]  # the subclass's own method, not an assignment
    handle.restore()
    assert [p.requires_grad for p in model.parameters()] == flags
    assert [id(p) for p in model.parameters()] == ids
    assert Counting.calls == [False, flags[14]] == [False, True]


def test_one_inference_parameter_among_many_is_named_and_nothing_changes() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(10)))
    with torch.inference_mode():
        model[4] = nn.Linear(2, 2)
    before = state(model)
    with pytest.raises(
        IsolationTypeError,
        match=r"^freeze\(\): parameters '4\.weight', '4\.bias' of Sequential were created under",
    ):
        freeze(model)
    assert state(model) == before
    with frozen(model, "3", "5"):  # the others are fine
        assert not model[3].weight.requires_grad and model[4].weight.requires_grad


def test_unfreeze_takes_complex_parameters_and_names_the_one_integer_among_floats() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(5)))
    model.register_parameter(
        "phase", nn.Parameter(torch.zeros(2, dtype=torch.cfloat), requires_grad=False)
    )
    with unfrozen(model, "phase"):
        assert model.phase.requires_grad
    assert not model.phase.requires_grad
    model[2].register_parameter(
        "steps", nn.Parameter(torch.zeros(1, dtype=torch.long), requires_grad=False)
    )
    model.requires_grad_(False)
    with pytest.raises(
        IsolationTypeError, match=r"^unfreeze\(\): parameters \['2\.steps'\] are not floating"
    ):
        unfreeze(model)
    assert not any(p.requires_grad for p in model.parameters())


def test_frozen_passes_keyword_inputs_when_no_input_requires_grad() -> None:
    frozen = isolate.Frozen(Scaled())
    out = frozen(torch.ones(2), scale=torch.full((2,), 3.0))  # the no_grad path
    assert torch.equal(out, torch.full((2,), 6.0)) and out.grad_fn is None
    frozen.unwrap()


def test_frozen_takes_parameters_that_already_cannot_learn() -> None:
    # An integer parameter, and one made under inference_mode that already has
    # requires_grad=False: freezing flips neither, so nothing is refused.
    model = nn.Linear(2, 2)
    model.register_parameter(
        "steps", nn.Parameter(torch.zeros(1, dtype=torch.long), requires_grad=False)
    )
    with torch.inference_mode():
        model.register_parameter("table", nn.Parameter(torch.ones(2), requires_grad=False))
    wrapped = Frozen(model)
    assert not model.weight.requires_grad and not model.steps.requires_grad
    assert wrapped.unwrap() is model
    assert model.weight.requires_grad and not model.table.requires_grad


def test_held_in_eval_names_itself_when_given_no_module() -> None:
    with pytest.raises(
        IsolationTypeError, match=r"^held_in_eval\(\): model must be a torch\.nn\.Module, got str"
    ):
        isolate.freezing.held_in_eval("model")  # type: ignore[arg-type]


def test_a_handle_repr_drops_only_the_callers_parentheses() -> None:
    model = nn.Linear(2, 1)
    handle = FreezeHandle(model, "SPEC_X()", dict(model.named_parameters()), {}, False, "eval")
    assert (
        repr(handle) == "FreezeHandle(SPEC_X on Linear: 2 parameters, 0 BatchNorm layers, active)"
    )
    handle.restore()


def test_a_handle_refuses_an_unknown_policy_in_its_callers_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    before = state(model)
    with pytest.raises(SelectorError, match=r"^spec\(\): bn='fixed' is not a BatchNorm policy"):
        FreezeHandle(
            model, "spec()", dict(model.named_parameters()), {"1": model[1]}, False, "fixed"
        )
    assert state(model) == before


def test_a_restore_out_of_order_names_the_first_five_parameters_held_by_newer_handles(
    net: Net,
) -> None:
    outer = freeze(net)
    inner = freeze(net, "trunk")  # six parameters of the outer selection
    held = "['trunk.0.bias', 'trunk.0.weight', 'trunk.1.bias', 'trunk.1.weight', 'trunk.3.bias']"
    with pytest.raises(RestoreError) as info:
        outer.restore()
    assert str(info.value).startswith(
        f"freeze(): restored out of order: 1 newer handle(s) still hold parameters this one "
        f"set ({held}...); restore the newest first"
    )
    inner.restore()
    outer.restore()


def test_a_restore_out_of_order_names_what_the_newer_handle_holds_not_names_it_shares(
    net: Net,
) -> None:
    """The handles name parameters from different roots: the wrapper's 'weight' is the
    model's 'head.weight', and the model's 'trunk.0.weight' is not the wrapper's."""
    holder = nn.Module()
    holder.trunk = nn.Sequential(nn.Linear(8, 8))
    holder.weight = net.head.weight
    wrapper = Frozen(holder)
    newer = freeze(net, "head.weight", "trunk.0.weight")
    with pytest.raises(RestoreError) as info:
        wrapper.unwrap()
    assert str(info.value).startswith(
        "Frozen(): restored out of order: 1 newer handle(s) still hold parameters this one "
        "set (['weight']...); restore the newest first"
    )
    newer.restore()
    assert wrapper.unwrap() is holder
    assert net.head.weight.requires_grad and net.trunk[0].weight.requires_grad
    bn = nn.BatchNorm1d(8, affine=False)  # no parameters: the handles share only the layer
    model = nn.Sequential(Frozen(bn), nn.Linear(8, 1))
    whole = freeze(model)
    with pytest.raises(RestoreError) as only_layers:
        model[0].unwrap()
    assert str(only_layers.value).startswith(
        "Frozen(): restored out of order: 1 newer handle(s) still hold layers this one set "
        "(['BatchNorm1d']...); restore the newest first"
    )
    whole.restore()
    assert model[0].unwrap() is bn and bn.training


def test_a_handle_restored_inside_its_block_is_not_restored_again(net: Net) -> None:
    before = state(net)
    with frozen(net, "trunk") as outer:
        with unfrozen(net, "trunk.0") as inner:
            inner.restore()
        assert not net.trunk[0].weight.requires_grad
        outer.restore()
    assert state(net) == before
