"""The semantics of detach(), detach_() and clone() as users meet them, and what isolate
does about each trap."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import isolate
from isolate import Cloned, Detached, InplaceModificationError

SIGMOID_GRAD = torch.tensor([0.1966, 0.1050, 0.0452])


def _a() -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 3.0], requires_grad=True)


def test_detaching_an_output_and_leaving_it_alone_does_not_change_backward() -> None:
    a = _a()
    out = a.sigmoid()
    side = out.detach()
    assert side.grad_fn is None and not side.requires_grad
    out.sum().backward()
    assert a.grad is not None
    torch.testing.assert_close(a.grad, SIGMOID_GRAD, atol=1e-4, rtol=0)


def test_backward_from_a_detached_tensor_raises() -> None:
    side = _a().sigmoid().detach()
    with pytest.raises(RuntimeError, match="does not require grad"):
        side.sum().backward()


def test_requires_grad_on_a_detached_tensor_does_not_reconnect_it() -> None:
    a = _a()
    side = a.sigmoid().detach().requires_grad_(True)
    side.sum().backward()
    assert a.grad is None
    assert side.grad is not None and side.is_leaf


def test_zeroing_a_detached_sigmoid_output_breaks_the_main_backward() -> None:
    a = _a()
    out = a.sigmoid()
    out.detach().zero_()  # shares storage: the main branch's values are now zeros
    assert torch.equal(out, torch.zeros(3))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


class _ZeroInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.zero_()


def test_the_guard_catches_the_edit_first_and_names_the_branch() -> None:
    a = _a()
    out = a.sigmoid()
    branch = Detached(_ZeroInPlace(), name="probe")
    with pytest.raises(InplaceModificationError, match=r"^Detached\(probe\): .*in place") as info:
        branch(out)
    assert "Cloned" in str(info.value) and "inplace='copy'" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_the_silent_case_is_caught_too() -> None:
    # AddBackward does not save its inputs, so autograd itself never notices the edit: the
    # main loss trains on corrupted values without any error.
    a = _a()
    features = a * 1.0
    main = features + 1.0
    features.detach().zero_()
    main.sum().backward()
    assert a.grad is not None  # no error from autograd: the corruption went unnoticed
    assert torch.equal(features, torch.zeros(3))

    features = _a() * 1.0
    with pytest.raises(InplaceModificationError, match=r"^Detached\(_ZeroInPlace\): "):
        Detached(_ZeroInPlace())(features)


def test_copy_policy_and_cloned_keep_the_main_tensor_intact() -> None:
    a = _a()
    out = a.sigmoid()
    kept = out.detach().clone()
    Detached(_ZeroInPlace(), inplace="copy")(out)
    Cloned(_ZeroInPlace())(out)
    assert torch.equal(out, kept)
    out.sum().backward()
    assert a.grad is not None
    torch.testing.assert_close(a.grad, SIGMOID_GRAD, atol=1e-4, rtol=0)


def test_detach_in_place_turns_the_tensor_into_a_leaf_for_good() -> None:
    a = _a()
    out = a.sigmoid()
    out.detach_()
    assert out.is_leaf and out.grad_fn is None and not out.requires_grad
    out.requires_grad_(True)
    (out * 2).sum().backward()
    assert a.grad is None  # still cut: re-enabling grad made a new leaf, not a reconnection


def test_detach_in_place_refuses_views() -> None:
    base = _a() * 1.0
    view = base[:2]
    with pytest.raises(RuntimeError, match="view"):
        view.detach_()


def test_gradient_flows_back_through_clone_and_accumulates_on_the_source() -> None:
    a = _a()
    out = a.sigmoid()
    copy = out.clone()
    assert copy.grad_fn is not None and copy.data_ptr() != out.data_ptr()
    (out.sum() + copy.sum()).backward()
    assert a.grad is not None
    torch.testing.assert_close(a.grad, 2 * SIGMOID_GRAD, atol=2e-4, rtol=0)


def test_isolate_clone_gradient_matches_torch_clone() -> None:
    a, b = _a(), _a()
    isolate.clone(a.sigmoid()).sum().backward()
    a_ref = b.sigmoid().clone()
    a_ref.sum().backward()
    assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
