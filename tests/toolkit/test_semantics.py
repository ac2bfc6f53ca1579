"""What isolate does about each trap of detach(), detach_() and clone().

The traps themselves, as torch behaves today, are pinned in tests/test_upstream_traps.py
(marked ``upstream_trap``); the tests here check isolate's answer to each of them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import isolate
from isolate import Cloned, Detached
from isolate.errors import InplaceModificationError

SIGMOID_GRAD = torch.tensor([0.1966, 0.1050, 0.0452])


def _a() -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 3.0], requires_grad=True)


class _ZeroInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.zero_()


def test_the_guard_catches_the_edit_first_and_names_the_branch() -> None:
    a = _a()
    out = a.sigmoid()
    kept = out.detach().clone()
    branch = Detached(_ZeroInPlace(), name="probe")
    with pytest.raises(InplaceModificationError, match=r"^Detached\(probe\): .*in place") as info:
        branch(out)
    assert "Cloned" in str(info.value) and "inplace='copy'" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    # The guard reports the edit; it cannot undo it: the main values are zeros now.
    assert torch.equal(out, torch.zeros(3)) and not torch.equal(kept, torch.zeros(3))


def test_the_silent_case_is_caught_too() -> None:
    # AddBackward saves no input, so autograd never notices this edit (see
    # test_upstream_traps.py); the version-counter guard does.
    features = _a() * 1.0
    main = features + 1.0
    with pytest.raises(InplaceModificationError, match=r"^Detached\(_ZeroInPlace\): "):
        Detached(_ZeroInPlace())(features)
    assert main.grad_fn is not None


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


def test_isolate_clone_gradient_matches_torch_clone() -> None:
    a, b = _a(), _a()
    isolate.clone(a.sigmoid()).sum().backward()
    b.sigmoid().clone().sum().backward()
    assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]


def test_stop_gradient_shares_storage_like_detach() -> None:
    # The trap is inherited on purpose (no copy per call); the Note of stop_gradient says so.
    out = _a().sigmoid()
    cut = isolate.stop_gradient(out)
    assert cut.data_ptr() == out.data_ptr() and cut.grad_fn is None and not cut.requires_grad
