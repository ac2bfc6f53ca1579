"""The IsolationHandle without Lightning: apply checks everything before changing anything, and
restore (or leaving ``applied``, also on an exception) brings back exactly what was there."""

from __future__ import annotations

import pytest
import torch

import isolate
from isolate import IsolationSpec, Thaw
from isolate.errors import (
    RestoreError,
    SelectorError,
    SpecError,
)
from isolate.spec.handle import IsolationHandle
from isolate.spec.plan import resolve
from tests.spec._models import SPEC, Net, assert_same, groups_of, state_of

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (
            IsolationSpec(freeze=["backbone"]),
            SelectorError,
            r"^IsolationSpec\(freeze\): 'backbone' matched no",
        ),
        (
            IsolationSpec(detach=["probe"]),
            SelectorError,
            r"^IsolationSpec\(detach\): 'probe' is not a submodule",
        ),
        (
            IsolationSpec(freeze=["trunk.0"], thaw=[Thaw("head", epoch=1)]),
            SpecError,
            r"thaw group 'head'",
        ),
        # the last item fails after the freeze and the first wrap would have been done
        (IsolationSpec(freeze=["trunk"], detach=["aux", "nowhere"]), SelectorError, r"'nowhere'"),
    ],
)
def test_apply_checks_everything_before_changing_anything(
    spec: IsolationSpec, error: type[Exception], match: str
) -> None:
    model = Net()
    before = state_of(model)
    with pytest.raises(error, match=match):
        spec.apply(model)
    assert_same(before, state_of(model))


def test_apply_then_restore_is_exact_wrappers_optimizer_and_thaws_included() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before, groups = state_of(model), groups_of(opt)
    handle = SPEC.apply(model, optimizer=opt)
    assert isinstance(model.aux, isolate.Detached) and not model.trunk[0].weight.requires_grad
    assert not model.train().trunk[1].training or model.trunk[1](torch.randn(3, 8)) is not None
    handle.step(epoch=1, step=3)
    assert handle.thawed == ("trunk.3",) and model.trunk[3].weight.requires_grad
    handle.restore()
    model.eval().train()  # modes were recorded at apply; the model was in train mode then
    assert_same(before, state_of(model))
    assert groups_of(opt) == groups
    assert not handle.active
    with pytest.raises(SpecError, match=r"the handle was restored; apply the spec again"):
        handle.thaw("trunk.3")


def test_a_restored_handle_refuses_every_change_naming_the_call() -> None:
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    state = handle.state_dict()
    handle.restore()
    loss = model(torch.randn(3, 4))[0].sum()
    before = state_of(model)
    for call, name in (
        (lambda: handle.thaw("trunk.3"), "thaw"),
        (lambda: handle.observe({"val_loss": 1.0}), "observe"),
        (lambda: handle.verify(total=loss), "verify"),
        (lambda: handle.load_state_dict(state), "load_state_dict"),
        (lambda: handle.step(epoch=0, step=0), "step"),
        (lambda: handle.attach(torch.optim.SGD(model.parameters(), lr=0.1)), "attach"),
    ):
        with pytest.raises(SpecError) as caught:
            call()
        assert str(caught.value) == (
            f"IsolationSpec.{name}(): the handle was restored; apply the spec again"
        )
    assert_same(before, state_of(model))


def test_a_handle_says_what_it_holds_and_what_it_expects() -> None:
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert repr(handle) == "IsolationHandle(Net: 6 frozen, 1 branches, thawed [], active)"
    assert handle.expectations()["trunk.3.weight"] == "still until epoch 1"
    handle.step(epoch=1, step=3)
    assert repr(handle) == (
        "IsolationHandle(Net: 4 frozen, 1 branches, thawed ['trunk.3'], active)"
    )
    assert handle.expectations()["trunk.3.weight"] == "moves"
    assert handle.expectations()["trunk.0.weight"] == "still"
    handle.restore()
    assert repr(handle).endswith(", restored)")


def test_check_every_and_observe_refuse_in_the_callers_name() -> None:
    model = Net()
    spec = IsolationSpec(
        freeze=["trunk"],
        thaw=[Thaw("trunk.3", monitor="val_loss", lr=0.1)],
        protect={"aux": ["trunk"]},
    )
    handle = spec.apply(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        with pytest.raises(SpecError, match=r"^IsolationSpec: verify_every_n_steps must be"):
            handle.check_every(-1)
        with pytest.raises(SpecError, match=r"^IsolationSpec: thaw group 'trunk\.3' monitors"):
            handle.observe({"loss": 1.0})
        loop = handle.check_every(1, losses_hint="no losses at step {step}: set them")
        loop.begin_step(epoch=0, step=0)
        loss = model(torch.randn(3, 4))[0].sum()
        loop.before_backward(loss)  # the named losses protect reads never come
        loss.backward()
        with pytest.raises(SpecError, match=r"the losses \['aux'\], but no losses at step 0: set"):
            loop.end_step()
    finally:
        handle.restore()


def test_a_handle_built_by_hand_names_itself_and_is_active_only_between_start_and_restore() -> None:
    handle = IsolationHandle(resolve(SPEC, Net()))
    assert handle.active is False
    with pytest.raises(
        SpecError, match=r"^IsolationHandle\.thaw\(\): the handle was never started; call start"
    ):
        handle.thaw("trunk.3")
    handle.start()
    assert handle.active is True
    handle.restore()
    assert handle.active is False


def test_a_handle_started_twice_is_refused_and_restores_exactly() -> None:
    model = Net()
    before = state_of(model)
    handle = IsolationHandle(resolve(SPEC, model))
    handle.start()
    started = state_of(model)
    with pytest.raises(SpecError, match=r"^IsolationHandle\.start\(\): the handle is active"):
        handle.start()
    assert_same(started, state_of(model))
    handle.restore()
    assert_same(before, state_of(model))


@pytest.mark.parametrize(
    ("selector", "refused_by"),
    [("trunk.0", r"IsolationSpec\(freeze\)"), ("trunk.3", r"IsolationSpec\(thaw 'trunk\.3'\)")],
)
def test_a_restore_a_newer_freeze_blocks_is_refused_before_anything_is_undone(
    selector: str, refused_by: str
) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before, groups = state_of(model), groups_of(opt)
    handle = SPEC.apply(model, optimizer=opt)
    handle.step(epoch=1, step=0)  # thaws trunk.3 into a group of its own
    applied_groups = groups_of(opt)
    assert len(applied_groups) == 2 and model.trunk[3].weight.requires_grad
    user = isolate.freeze(model, selector)  # newer than the spec's freeze and its thaw
    held = state_of(model)
    with pytest.raises(RestoreError, match=rf"^{refused_by}: restored out of order"):
        handle.restore()
    assert_same(held, state_of(model))  # the thaw, the wrapper and the freeze all stand
    assert groups_of(opt) == applied_groups and handle.active
    assert handle.thawed == ("trunk.3",) and isinstance(model.aux, isolate.Detached)
    user.restore()
    handle.restore()
    assert_same(before, state_of(model))
    assert groups_of(opt) == groups and not handle.active


def test_a_restore_into_an_optimizer_that_lost_a_group_is_refused_before_anything_is_undone() -> (
    None
):
    model = Net()
    opt = torch.optim.SGD(
        [{"params": model.trunk.parameters()}, {"params": model.head.parameters(), "lr": 0.5}],
        lr=0.1,
    )
    before = state_of(model)
    handle = SPEC.apply(model, optimizer=opt)
    opt.param_groups.pop()  # the user's own surgery after attach
    applied, applied_groups = state_of(model), groups_of(opt)
    with pytest.raises(RestoreError) as error:
        handle.restore()
    assert str(error.value) == (
        "IsolationSpec: optimizer 0 has 1 param groups, fewer than the 2 it had when attached, "
        "so the parameters taken out of them cannot be put back; restore(optimizers=False) "
        "restores the rest and leaves the optimizers as they are"
    )
    assert_same(applied, state_of(model))  # the freeze and the wrapper stand
    assert groups_of(opt) == applied_groups and handle.active
    handle.restore(optimizers=False)
    model.eval().train()
    assert_same(before, state_of(model))
    assert groups_of(opt) == applied_groups and not handle.active


def test_applied_restores_on_exceptions() -> None:
    model = Net()
    before = state_of(model)
    with pytest.raises(RuntimeError, match="boom"), SPEC.applied(model) as handle:
        assert handle.frozen[0] == "trunk.0.weight"
        raise RuntimeError("boom")
    assert_same(before, state_of(model))
