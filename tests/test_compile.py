"""torch.compile: the wrappers work inside compiled models, and flipping requires_grad stays
out of compiled regions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import isolate


class _ZeroInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.zero_()


class Net(nn.Module):
    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 4)
        self.head = isolate.Cloned(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 2)))
        self.aux = isolate.Detached(nn.Sequential(branch, nn.Linear(4, 3)))
        self.reverse = isolate.GradientScale(-0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        return self.head(features), self.aux(self.reverse(features))


def _grads(model: nn.Module, outputs: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (outputs[0].square().sum() + outputs[1].square().sum()).backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("branch", [nn.Identity, _ZeroInPlace])
def test_wrappers_compile_in_one_graph_and_match_eager(branch: type[nn.Module]) -> None:
    x = torch.randn(6, 4)
    model = Net(branch())
    features = model.trunk(x).detach()
    if branch is _ZeroInPlace:
        with pytest.raises(isolate.InplaceModificationError, match=r"^Detached\(Sequential\)"):
            model(x)  # eager: the guard catches the edit
        eager_grads = None
    else:
        eager_grads = _grads(model, model(x))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    outputs = compiled(x)
    # Compiled code gets copies, so even an editing branch leaves the main features intact.
    assert torch.equal(model.trunk(x), features)
    compiled_grads = _grads(model, outputs)
    if eager_grads is not None:
        for a, b in zip(eager_grads, compiled_grads, strict=True):
            torch.testing.assert_close(a, b)
    head_only = [p.grad for p in model.trunk.parameters()]
    model.zero_grad(set_to_none=True)
    compiled(x)[0].square().sum().backward()
    for a, b in zip(head_only, model.trunk.parameters(), strict=True):
        torch.testing.assert_close(a, b.grad)  # the Detached branch adds nothing to the trunk


def test_freeze_inside_a_compiled_function_runs_eagerly() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))

    def step(x: torch.Tensor) -> torch.Tensor:
        handle = isolate.freeze(model, "0")
        out = model(x).sum()
        handle.restore()
        return out

    out = torch.compile(step, backend="aot_eager")(torch.randn(2, 3))
    out.backward()
    assert model[0].weight.grad is None and model[1].weight.grad is not None
    assert all(p.requires_grad for p in model.parameters())
