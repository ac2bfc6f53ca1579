"""The named losses' check of ``verify``, message by message: which loss leaks and why, the
owners, every named loss checked, the refusals of bad losses, and detach branches bypassed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from isolate import IsolationSpec
from isolate.errors import BlindSpotError, GradientLeakError, IsolationTypeError, SpecError
from tests.spec._models import Net
from tests.toolkit._shared import TanhOnce

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def test_every_named_loss_is_checked_and_a_leak_names_why_and_where() -> None:
    model = Net()
    with IsolationSpec(detach=["aux"]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        head, aux = model(torch.randn(5, 4))
        with pytest.raises(GradientLeakError) as raised:
            handle.verify({"aux": aux.sum(), "head": head.sum()})  # the clean one first
    message = str(raised.value)
    assert message.startswith(
        "IsolationSpec: at epoch 0, step 0, loss 'head' reaches 6 protected parameters (frozen, or "
        "upstream of a detach branch) ['trunk.0.weight', 'trunk.0.bias', "
    )
    assert "trunk.0.weight  in 'trunk.0' (Linear); consumed by" in message


def test_a_loss_protect_does_not_name_is_kept_from_the_frozen_parameters_only() -> None:
    model = Net()
    spec = IsolationSpec(freeze=["trunk.0"], protect={"aux": ["head"]})
    with spec.applied(model) as handle:
        handle.step(epoch=0, step=0)
        head, aux = model(torch.randn(5, 4))
        checked = handle.verify({"aux": aux.sum(), "head": head.sum()}, checks=("losses",))
        assert checked.losses == {"aux": 4, "head": 2}
        assert handle.verify(total=head.sum(), checks=("losses",)).losses == {}


def test_losses_that_are_not_named_tensors_or_miss_protect_are_refused() -> None:
    model = Net()
    with IsolationSpec(protect={"aux": ["head"]}).applied(model) as handle:
        handle.step(epoch=0, step=0)
        head, aux = model(torch.randn(5, 4))
        for bad in ({"aux": 1.0}, {1: aux.sum()}, [aux.sum()]):
            with pytest.raises(IsolationTypeError) as refused:
                handle.verify(bad)  # type: ignore[arg-type]
            assert str(refused.value) == (
                "IsolationSpec.verify(): losses must be a dict of loss name -> loss tensor, "
                f"got {bad!r}"
            )
        with pytest.raises(SpecError) as refused:
            handle.verify({"head": head.sum()})
        assert str(refused.value) == (
            "IsolationSpec: protect names the losses ['aux'], but verify() got ['head']; "
            "pass every loss that protect names"
        )


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 4)
        self.first, self.second = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        # The second branch is called around its wrapper: its input is not detached.
        return self.first(features), self.second.module(features)  # type: ignore[operator]


def test_a_branch_called_around_its_wrapper_is_named_after_one_that_ran() -> None:
    model = TwoBranches()
    with IsolationSpec(detach=["first", "second"]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        first, second = model(torch.randn(5, 4))
        said = (
            "IsolationSpec: at epoch 0, step 0, {} reaches the parameters of the detach branch "
            "'second' ['second.weight', 'second.bias'], but its Detached wrapper did not run"
        )
        with pytest.raises(GradientLeakError) as raised:
            handle.verify(total=[first.sum(), second.sum()], checks=("losses",))
        assert str(raised.value).startswith(said.format("the total loss"))
        with pytest.raises(GradientLeakError) as raised:
            handle.verify({"second": second.sum()}, checks=("losses",))
        assert str(raised.value).startswith(said.format("loss 'second'"))


@pytest.mark.parametrize("case", ["upstream", "protected", "total"])
def test_a_walk_that_cannot_see_is_refused_in_the_handles_name(case: str) -> None:
    """The trunk runs in a reentrant checkpoint whose saved arguments an earlier backward
    freed: each walk of the check (what is upstream of the branch, a named loss, the total
    loss around an unused wrapper) refuses, naming the handle."""
    model = Net()
    protect = {"head": ["trunk"]} if case == "protected" else None
    with IsolationSpec(detach=["aux"], protect=protect).applied(model) as handle:
        handle.step(epoch=0, step=0)
        x = torch.randn(5, 4, requires_grad=True)  # a reentrant segment needs an input that does
        features = checkpoint(model.trunk, x, use_reentrant=True)
        head = model.head(features).sum()
        losses = {"aux": model.aux(features).sum()} if case == "upstream" else {}
        if case == "protected":
            losses = {"head": head}
        head.backward()  # frees the segment's saved arguments: no walk can re-run it
        with pytest.raises(BlindSpotError) as refused:
            handle.verify(losses or None, total=head, checks=("losses",))
    assert str(refused.value).startswith("IsolationSpec: ")


def _through_a_once_differentiable_function(model: nn.Module) -> torch.Tensor:
    """A gradient penalty through a Function whose backward cannot be differentiated: its
    graph's edges past that node go to stand-in leaves, and a real backward raises there."""
    x = torch.randn(2, 3, requires_grad=True)
    out = model[1](TanhOnce.apply(model[0](x)))
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return g.pow(2).sum()


def test_a_named_loss_through_a_once_differentiable_function_is_refused_not_passed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    penalty = _through_a_once_differentiable_function(model)
    with IsolationSpec(protect={"penalty": ["1"]}).applied(model) as handle:
        handle.step(epoch=0, step=0)
        with pytest.raises(BlindSpotError) as refused:
            handle.verify({"penalty": penalty}, checks=("losses",))
    assert str(refused.value).startswith(
        "IsolationSpec: the loss's graph runs through torch::autograd::Error (consumed by "
        "MmBackward0), whose backward raises"
    )
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        penalty.backward()


def test_a_contract_that_walks_a_loss_through_a_once_differentiable_function_refuses() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    spec = IsolationSpec(contracts=[{"kind": "probe", "select": "1", "loss": "probe"}])
    with spec.applied(model) as handle:
        probe = model[1](model[0](torch.randn(2, 3)).detach()).sum()
        main = _through_a_once_differentiable_function(model)  # reaches the probe, unseen
        with pytest.raises(BlindSpotError, match=r"runs through torch::autograd::Error"):
            handle.verify({"probe": probe, "main": main}, checks=["contracts"])
