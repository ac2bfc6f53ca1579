"""clone / Cloned: a branch gets private copies that stay in the graph, so gradient flows back
to the source and an in-place edit in the branch leaves the main tensor intact (isolate's
answer to the traps of ``clone()`` and ``detach()`` pinned in tests/test_upstream_traps.py)."""

from __future__ import annotations

import torch
from torch import nn

import isolate
from isolate import Cloned, Detached
from tests.toolkit._shared import ZeroInPlace


def test_cloned_branch_sends_gradient_back_and_keeps_the_source_intact() -> None:
    a = torch.tensor([-1.0, 2.0, -3.0], requires_grad=True)
    shared = a * 1
    out = Cloned(nn.ReLU(inplace=True))(shared)
    assert torch.equal(shared, torch.tensor([-1.0, 2.0, -3.0]))
    (shared.sum() + out.sum()).backward()
    assert torch.equal(a.grad, torch.tensor([1.0, 2.0, 1.0]))  # type: ignore[arg-type]


def _a() -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 3.0], requires_grad=True)


SIGMOID_GRAD = torch.tensor([0.1966, 0.1050, 0.0452])


def test_copy_policy_and_cloned_keep_the_main_tensor_intact() -> None:
    a = _a()
    out = a.sigmoid()
    kept = out.detach().clone()
    Detached(ZeroInPlace(), inplace="copy")(out)
    Cloned(ZeroInPlace())(out)
    assert torch.equal(out, kept)
    out.sum().backward()
    assert a.grad is not None
    torch.testing.assert_close(a.grad, SIGMOID_GRAD, atol=1e-4, rtol=0)


def test_isolate_clone_gradient_matches_torch_clone() -> None:
    a, b = _a(), _a()
    isolate.clone(a.sigmoid()).sum().backward()
    b.sigmoid().clone().sum().backward()
    assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
