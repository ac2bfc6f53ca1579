"""handle.verify: what each check looked at, and each violation found (a leak, drift, flags,
optimizers), also for replaced buffers, a second backward, and branches run too often."""

from __future__ import annotations

import pytest
import torch

from isolate import IsolationSpec
from isolate.errors import (
    DriftError,
    GradientLeakError,
    SpecError,
)
from isolate.spec.checks import Verification
from tests.spec._models import SPEC, Net

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def test_verify_reports_what_it_checked_and_raises_on_a_leak() -> None:
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    handle.step(epoch=0, step=0)
    _, aux = model(torch.randn(5, 4))
    checked = handle.verify({"aux": aux.sum()})
    assert checked == Verification(
        params=6, losses={"aux": 6}, drift=9, flags=6, optimizers=1, ranks=1
    )
    # The head's loss is not isolated from the (trainable) parts upstream of the branch...
    spec = IsolationSpec(detach=["aux"], protect={"head": ["trunk"]})
    other = Net()
    with spec.applied(other) as h:
        h.step(epoch=0, step=0)
        head, _ = other(torch.randn(5, 4))
        with pytest.raises(
            GradientLeakError,
            match=r"loss 'head' reaches 6 protected parameters \(protect\['head'\]\)",
        ):
            h.verify({"head": head.sum()})
        found = h.verify({"head": head.sum()}, on_violation="warn")
        assert len(found.violations) == 1
    handle.restore()


def test_verify_sees_drift_flags_and_optimizers() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    handle = IsolationSpec(freeze=["trunk"]).apply(model, optimizer=opt)
    with torch.no_grad():
        model.trunk[0].bias[0] += 1.0
    with pytest.raises(
        DriftError, match=r"(?s)frozen tensors moved \(at the check\).*trunk.0.bias"
    ):
        handle.verify(checks=("drift",), when="at the check")
    handle.verify(checks=("drift",))  # reported once, then watched from the new value
    model.trunk[0].weight.requires_grad_(True)
    with pytest.raises(
        DriftError, match=r"1 frozen parameters require grad again: \['trunk.0.weight'\]"
    ):
        handle.verify(checks=("flags",))
    model.trunk[0].weight.requires_grad_(False)
    opt.add_param_group({"params": [model.trunk[0].weight], "weight_decay": 0.1})
    with pytest.raises(
        DriftError, match=r"back in an optimizer that can move them: \['trunk.0.weight"
    ):
        handle.verify(checks=("optimizers",))
    opt.param_groups.pop()
    with pytest.raises(SpecError, match=r"unknown checks \['grads'\]"):
        handle.verify(checks=("grads",))
    handle.restore()


def test_a_replaced_buffer_is_checked_by_its_new_values() -> None:
    # What Lightning's StochasticWeightAveraging does to BatchNorm statistics.
    model = Net()
    with torch.no_grad():
        model.trunk[1].running_mean.fill_(0.5)
    handle = IsolationSpec(freeze=["trunk"]).apply(model)
    model.trunk[1].running_mean = torch.zeros(8)
    with pytest.raises(DriftError, match=r"trunk.1.running_mean  \(buffer\) changed \(size unkn"):
        handle.verify(checks=("drift",))
    handle.restore()
    # With copies, the report also gives the size of the change.
    with torch.no_grad():
        model.trunk[1].running_mean.fill_(0.5)
    handle = IsolationSpec(freeze=["trunk"]).apply(model, drift="copy")
    model.trunk[1].running_mean = torch.zeros(8)
    with pytest.raises(DriftError, match=r"trunk.1.running_mean  \(buffer\) max\|Δ\|=5.000e-01"):
        handle.verify(checks=("drift",))
    handle.restore()


def test_a_second_backward_is_checked_against_the_same_forward() -> None:
    # Manual optimization: backward of the main loss, then verify the auxiliary loss.
    model = Net()
    handle = IsolationSpec(detach=["aux"]).apply(model)
    handle.step(epoch=0, step=0)
    main, aux = model(torch.randn(5, 4))
    main.sum().backward(retain_graph=True)
    checked = handle.verify({"aux": aux.sum()})
    assert checked.losses == {"aux": 6} and not checked.violations
    handle.restore()


def test_a_branch_called_past_the_record_limit_refuses_to_guess() -> None:
    model = Net()
    handle = IsolationSpec(detach=["aux"]).apply(model)
    x = torch.randn(2, 4)
    for _ in range(70):
        _, aux = model(x)
    with pytest.raises(SpecError, match=r"ran more than 64 times since the last step\(\)"):
        handle.verify({"aux": aux.sum()})
    handle.step(epoch=0, step=1)
    _, aux = model(x)
    assert handle.verify({"aux": aux.sum()}).losses == {"aux": 6}
    handle.restore()


def test_the_record_limit_is_64_calls_of_a_branch_per_step() -> None:
    model = Net()
    handle = IsolationSpec(detach=["aux"]).apply(model)
    x = torch.randn(2, 4)
    try:
        for calls in (64, 65):
            handle.step(epoch=0, step=calls)
            for _ in range(calls):
                _, aux = model(x)
            if calls == 64:
                assert handle.verify({"aux": aux.sum()}).losses == {"aux": 6}
            else:
                with pytest.raises(SpecError, match=r"\['aux'\] ran more than 64 times"):
                    handle.verify({"aux": aux.sum()})
    finally:
        handle.restore()


def test_a_check_step_without_the_losses_protect_names_is_refused() -> None:
    model = Net()
    handle = IsolationSpec(detach=["aux"], protect={"aux": ["trunk"]}).apply(model)
    loop = handle.check_every(1)
    try:
        loop.begin_step(epoch=0, step=0)
        main, aux = model(torch.randn(2, 4))
        loop.before_backward(main.sum() + aux.sum())  # no named losses
        with pytest.raises(
            SpecError,
            match=r"protect names the losses \['aux'\], but no named losses were given at step 0",
        ):
            loop.end_step()
    finally:
        handle.restore()
