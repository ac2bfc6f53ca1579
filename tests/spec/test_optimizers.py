"""A spec and its optimizers: frozen parameters out (or refused, changing nothing), a thawed
group in once, by identity, with its settings, into the optimizer it names."""

from __future__ import annotations

import warnings

import pytest
import torch

import isolate
from isolate import IsolationSpec, Thaw
from isolate.errors import (
    SpecError,
)
from tests.spec._models import SPEC, Net, assert_same, groups_of, state_of

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def test_an_optimizer_refused_leaves_model_and_optimizer_as_they_were() -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    before, groups = state_of(model), groups_of(opt)
    spec = IsolationSpec(freeze=["trunk"], frozen_in_optimizer="error")
    with pytest.raises(SpecError, match=r"^IsolationSpec: 6 frozen parameters sit in an optimizer"):
        spec.apply(model, optimizer=opt)
    assert_same(before, state_of(model))
    assert groups_of(opt) == groups


def test_a_thaw_adds_the_group_once_by_identity_with_its_settings() -> None:
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters()], lr=0.1, momentum=0.9)
    handle = SPEC.apply(model, optimizer=opt)
    assert [len(g) for g in groups_of(opt)] == [4]  # the 6 frozen parameters are out
    assert handle.step(epoch=0, step=5) == []
    assert handle.step(epoch=1, step=6) == ["trunk.3"]
    last = opt.param_groups[-1]
    assert [id(p) for p in last["params"]] == [id(model.trunk[3].weight), id(model.trunk[3].bias)]
    assert last["lr"] == 0.5 and last["momentum"] == 0.9
    with pytest.raises(SpecError, match=r"thaw group 'trunk.3' was thawed already .*thawed once"):
        handle.thaw("trunk.3")
    with pytest.raises(SpecError, match=r"no thaw group 'trunk'; the groups are \['trunk.3'\]"):
        handle.thaw("trunk")
    assert handle.step(epoch=2, step=7) == []
    assert sum(len(g) for g in groups_of(opt)) == 6
    handle.restore()


def test_an_optimizer_built_before_the_spec_gives_up_its_frozen_parameters_quietly() -> None:
    """Lightning's ModelParallelStrategy applies the spec after configure_optimizers: the
    optimizer cannot help holding what the spec freezes, so taking them out is no news."""
    before, after = Net(), Net()
    early = torch.optim.AdamW(before.parameters(), lr=0.1, weight_decay=0.1)
    quiet, loud = SPEC.apply(before), SPEC.apply(after)
    late = torch.optim.AdamW(after.parameters(), lr=0.1, weight_decay=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.attach(early, built_before_apply=True)
    assert [str(w.message) for w in caught] == []
    with pytest.warns(isolate.IsolationWarning, match=r"took 6 frozen parameters out"):
        loud.attach(late)  # built from a frozen model's parameters: worth a warning
    for model, opt in ((before, early), (after, late)):
        trainable = [id(p) for p in model.parameters() if p.requires_grad]
        assert groups_of(opt) == [trainable]  # taken out either way
    quiet.restore()
    loud.restore()


def test_thaw_takes_an_optimizer_and_an_lr() -> None:
    model = Net()
    first = torch.optim.SGD(model.head.parameters(), lr=0.1)
    second = torch.optim.SGD(model.aux.parameters(), lr=0.2)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", step=2, lr=0.5, optimizer_idx=0)])
    handle = spec.apply(model, optimizer=[first, second])
    group = handle.thaw("trunk.3", optimizer=second, lr=0.01)
    assert group is second.param_groups[-1] and group["lr"] == 0.01
    assert len(first.param_groups) == 1
    handle.restore()
    assert len(second.param_groups) == 1


def test_thaw_refuses_an_optimizer_object_that_is_not_attached() -> None:
    model = Net()
    first = torch.optim.SGD(model.head.parameters(), lr=0.1)
    stranger = torch.optim.SGD(model.aux.parameters(), lr=0.2)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", step=2, lr=0.5)])
    handle = spec.apply(model, optimizer=first)
    try:
        with pytest.raises(SpecError, match=r"not one of the 1 attached optimizers"):
            handle.thaw("trunk.3", optimizer=stranger)
        assert len(first.param_groups) == 1 and len(stranger.param_groups) == 1
        assert handle.thawed == ()
    finally:
        handle.restore()
