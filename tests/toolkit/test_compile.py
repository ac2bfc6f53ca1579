"""torch.compile: the wrappers work inside compiled models, and flipping requires_grad stays
out of compiled regions."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

import isolate
import isolate.errors
import isolate.freezing
from tests.toolkit._shared import ZeroInPlace


class Net(nn.Module):
    """A trunk, a Detached branch that runs *before* the main head, and the main head.

    The branch runs first, so the head consumes the features after the branch had its chance
    to edit them: if the branch's edit reached the features, the main output shows it.
    """

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 4)
        self.aux = isolate.Detached(nn.Sequential(branch, nn.Linear(4, 3)))
        self.reverse = isolate.GradientScale(-0.5)
        self.head = isolate.Cloned(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 2)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        aux = self.aux(self.reverse(features))
        return self.head(features), aux, features


def _grads(model: Net, outputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (outputs[0].square().sum() + outputs[1].square().sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("branch", [nn.Identity, ZeroInPlace])
def test_compiled_branch_leaves_the_main_features_intact_and_matches_eager(
    branch: type[nn.Module],
) -> None:
    x = torch.randn(6, 4)
    model = Net(branch())

    # Reference 1: the main path alone, eager, no branch at all.
    model.zero_grad(set_to_none=True)
    main_only = model.head(model.trunk(x))
    main_only.square().sum().backward()
    main_grads = {
        n: p.grad.clone()  # type: ignore[union-attr]
        for n, p in model.named_parameters()
        if n.startswith(("trunk.", "head."))
    }
    clean_features = model.trunk(x).detach()

    # Reference 2: the whole model, eager. An editing branch is refused by the default guard;
    # with inplace="copy" eager gets the copies that compiled code is documented to get.
    if branch is ZeroInPlace:
        error = isolate.errors.InplaceModificationError
        with pytest.raises(error, match=r"^Detached\(Sequential\): "):
            model(x)
    model.aux.inplace = "copy"
    eager = tuple(t.detach() for t in model(x))
    eager_grads = _grads(model, model(x))
    model.aux.inplace = "error"

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    outputs = compiled(x)

    # The features the head consumed after the branch ran are the untouched ones.
    torch.testing.assert_close(outputs[2], clean_features, rtol=0, atol=0)
    torch.testing.assert_close(outputs[0], main_only.detach())
    for got, want in zip(outputs, eager, strict=True):
        torch.testing.assert_close(got, want)
    compiled_grads = _grads(model, outputs)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, want in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], want, msg=name)
    # The Detached branch adds nothing upstream: trunk and head get the main loss's gradient.
    for name, want in main_grads.items():
        torch.testing.assert_close(compiled_grads[name], want, msg=name)
    aux_weight = compiled_grads["aux.module.1.weight"]
    if branch is ZeroInPlace:
        # The branch's own edit did take effect, on its own copy: its linear saw zeros.
        assert torch.equal(aux_weight, torch.zeros_like(aux_weight))
        assert torch.equal(outputs[1], model.aux.module[1].bias.detach().expand(6, 3))
    else:
        assert aux_weight.abs().sum() > 0


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


class _Probe(nn.Parameter):
    """A parameter that records, at each flag flip, whether dynamo was tracing the flip."""

    traced: ClassVar[list[bool]] = []

    def requires_grad_(self, requires_grad: bool = True) -> _Probe:
        _Probe.traced.append(torch.compiler.is_compiling())
        return super().requires_grad_(requires_grad)  # type: ignore[return-value]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_flag_flips_inside_a_compiled_function_run_eagerly_at_every_call(backend: str) -> None:
    """freeze/unfreeze/restore are kept out of compiled code (torch.compiler.disable): dynamo
    never traces their flag flips, which run as plain Python at each call. Without the
    decorator, dynamo inlines them and the flips run under tracing (is_compiling() is True),
    where a flip could be baked into a graph or replayed from a cache."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight = _Probe(model[0].weight.detach())
    seen: list[tuple[bool, ...]] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        outer = isolate.freeze(model, "0")
        inner = isolate.freezing.unfreeze(model, "0.weight")
        seen.append(tuple(p.requires_grad for p in model.parameters()))
        out = model(x).sum()
        inner.restore()
        outer.restore()
        return out

    compiled = torch.compile(step, backend=backend)
    _Probe.traced.clear()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        compiled(torch.randn(2, 3)).backward()
        assert model[0].weight.grad is not None and model[0].bias.grad is None
        assert model[1].weight.grad is not None
        assert all(p.requires_grad for p in model.parameters())
    # four flips of the probe per call (freeze, unfreeze, and their restores), none traced
    assert _Probe.traced == [False] * 12
    assert seen == [(True, False, True, True)] * 3
