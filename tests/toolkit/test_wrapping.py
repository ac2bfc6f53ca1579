"""What every module wrapper shares (Frozen, Detached, Cloned): keyword arguments reach the
wrapped module, ``state_dict`` / ``load_state_dict`` name keys without a ``module.`` infix
(copies too), the wrapped module's children, parameters and buffers are reached through the
wrapper, and ``unwrap()`` releases that wrapper alone."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import isolate
import isolate.reachability
from isolate import Cloned, Detached
from isolate.errors import InplaceModificationError, WrappingError
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


def test_only_children_parameters_and_buffers_are_reached_through_the_wrapper() -> None:
    linear = isolate.Detached(nn.Linear(2, 3))
    assert linear.module.in_features == 2
    with pytest.raises(AttributeError, match=r"^'Detached' object has no attribute 'in_features'$"):
        _ = linear.in_features


def test_an_attribute_read_before_the_wrapper_is_set_up_is_named_as_missing() -> None:
    # As a subclass reading self.module before calling Wrapper.__init__ would.
    bare = isolate.Detached.__new__(isolate.Detached)
    with pytest.raises(AttributeError, match=r"^'Detached' object has no attribute 'module'$"):
        _ = bare.module


def test_unwrapping_one_wrapper_leaves_the_module_s_other_live_wrappers_registered() -> None:
    branch = nn.Linear(2, 2)
    detached = Detached(branch)
    cloned = Cloned(branch)
    assert cloned.unwrap() is branch
    with pytest.raises(
        WrappingError, match=r"^Detached\(\): this Linear is already wrapped in a live Detached"
    ):
        Detached(branch)
    Cloned(branch)  # the unwrapped one is released
    assert detached.module is branch


def test_a_wrapper_whose_module_was_replaced_unwraps_to_the_new_module() -> None:
    # As torch.ao.quantization's convert swaps a Linear for its quantized form in place.
    wrapper = Detached(nn.Linear(2, 2))
    replacement = nn.Linear(2, 2)
    wrapper.module = replacement
    assert wrapper.unwrap() is replacement


def test_a_wrapper_whose_module_was_replaced_lets_go_of_the_old_one_and_holds_the_new() -> None:
    old, new = nn.Linear(2, 2), nn.Linear(2, 2)
    wrapper = Detached(old)
    wrapper.module = new
    assert Detached(old).module is old  # released: it can be wrapped again
    with pytest.raises(
        WrappingError,
        match=r"^Detached\(\): this Linear is already wrapped in a live Detached",
    ):
        Detached(new)
    assert wrapper.unwrap() is new
    Detached(new)  # and released on unwrap


def test_a_detached_wrapper_whose_module_was_replaced_names_the_new_branch_in_its_errors() -> None:
    class Edit(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mul_(2)

    default, named = Detached(nn.Identity()), Detached(nn.Identity(), name="probe")
    default.module, named.module = Edit(), Edit()
    assert (default.name, named.name) == ("Edit", "probe")
    with pytest.raises(InplaceModificationError, match=r"^Detached\(Edit\): the branch edited"):
        default(torch.randn(3, 2))


def test_a_frozen_wrapper_whose_module_was_replaced_freezes_the_new_and_releases_the_old() -> None:
    # A Frozen wrapper must never hold a module that still learns.
    old = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    new = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    frozen = isolate.Frozen(old).train()
    frozen.module = new
    assert [p.requires_grad for p in new.parameters()] == [False] * 4
    assert [p.requires_grad for p in old.parameters()] == [True] * 4
    frozen.train()(torch.randn(3, 2))
    assert not new[1].training and new[1].num_batches_tracked.item() == 0
    old.train()(torch.randn(3, 2))
    assert old[1].training and old[1].num_batches_tracked.item() == 1  # no longer held
    assert frozen.unwrap() is new
    assert [p.requires_grad for p in new.parameters()] == [True] * 4


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            "not a module",
            isolate.errors.IsolationTypeError,
            r"must be a torch\.nn\.Module, got str",
        ),
        (None, isolate.errors.IsolationTypeError, r"must be a torch\.nn\.Module, got NoneType"),
        (Cloned(nn.Linear(2, 2)), WrappingError, r"already wrapped in Cloned"),
    ],
)
def test_a_replacement_module_that_cannot_be_wrapped_is_refused_and_nothing_changes(
    value: object, error: type[Exception], message: str
) -> None:
    old = nn.Linear(2, 2)
    frozen = isolate.Frozen(old)
    with pytest.raises(error, match=r"^Frozen\.module = \.\.\.: .*" + message):
        frozen.module = value
    assert frozen.module is old
    assert not old.weight.requires_grad and not old.bias.requires_grad
    with pytest.raises(WrappingError, match="already wrapped in a live Frozen"):
        isolate.Frozen(old)


def test_a_replacement_module_held_by_another_frozen_wrapper_is_refused() -> None:
    old, new = nn.Linear(2, 2), nn.Linear(2, 2)
    frozen, other = isolate.Frozen(old), isolate.Frozen(new)
    with pytest.raises(WrappingError, match=r"^Frozen\.module = \.\.\.: this Linear is already"):
        frozen.module = new
    assert frozen.module is old and other.module is new
    assert not old.weight.requires_grad and not new.weight.requires_grad


def test_a_replacement_module_with_lazy_parameters_is_refused_and_the_old_stays_frozen() -> None:
    old = nn.Linear(2, 2)
    frozen = isolate.Frozen(old)
    with pytest.raises(isolate.errors.IsolationTypeError, match=r"^Frozen\.module = \.\.\.: "):
        frozen.module = nn.LazyLinear(2)
    assert frozen.module is old and not old.weight.requires_grad


def test_a_wrapper_pickled_without_its_load_hook_names_keys_without_the_infix_once_loaded() -> None:
    # A wrapper saved before the hook existed: the copy gets it back, and only once.
    wrapper = Detached(nn.Linear(2, 2))
    wrapper._load_state_dict_post_hooks.clear()
    copy = pickle.loads(pickle.dumps(wrapper))
    assert len(copy._load_state_dict_post_hooks) == 1
    state = {"weight": torch.ones(2, 2), "extra": torch.ones(1)}
    result = copy.load_state_dict(state, strict=False)
    assert result.missing_keys == ["bias"]
    assert result.unexpected_keys == ["extra"]
    assert torch.equal(copy.module.weight, torch.ones(2, 2))


def test_a_wrapper_pickled_without_any_load_hook_loads_the_keys_it_was_saved_with() -> None:
    # A wrapper saved before its keys left out the infix: the copy gets the post hook back,
    # which has nothing to rename when no pre hook put the infix in.
    wrapper = Detached(nn.Linear(2, 2))
    wrapper._load_state_dict_pre_hooks.clear()
    wrapper._load_state_dict_post_hooks.clear()
    copy = pickle.loads(pickle.dumps(wrapper))
    state = {"module.weight": torch.ones(2, 2), "module.bias": torch.zeros(2)}
    result = copy.load_state_dict(state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(copy.module.weight, torch.ones(2, 2))


def test_a_message_written_before_the_wrapper_loads_is_left_as_it_is() -> None:
    # Module names may hold spaces: the key of a module loaded before the wrapper can read
    # "for trunk.module." without being the wrapper's.
    model = nn.ModuleDict(
        {
            "copy for trunk": nn.ModuleDict({"module": nn.Linear(2, 2)}),
            "trunk": Detached(nn.Linear(2, 2)),
        }
    )
    state = model.state_dict()
    assert list(state) == [
        "copy for trunk.module.weight",
        "copy for trunk.module.bias",
        "trunk.weight",
        "trunk.bias",
    ]
    state["copy for trunk.module.weight"] = torch.zeros(3, 3)
    state["trunk.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(state)
    assert "size mismatch for copy for trunk.module.weight: copying" in str(info.value)
    assert "size mismatch for trunk.weight: copying" in str(info.value)
