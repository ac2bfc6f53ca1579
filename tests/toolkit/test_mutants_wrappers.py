"""The wrappers pass keyword arguments on, Frozen lets gradient through to a keyword input,
scale_gradient takes a one-element tensor as alpha, and the handle, guard and query messages
say what they should. Written to kill the mutants of isolate/freezing.py, detaching.py and
cloning.py that the rest of the suite let through (see the README's development section)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import isolate
import isolate.errors
import isolate.freezing
from isolate.errors import IsolationTypeError, SelectorError


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x * self.weight * scale


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


def test_frozen_lets_gradient_through_to_an_input_passed_by_keyword() -> None:
    frozen = isolate.Frozen(Scaled())
    scale = torch.ones(2, requires_grad=True)
    frozen(torch.ones(2), scale=scale).sum().backward()
    assert torch.equal(scale.grad, torch.full((2,), 2.0))  # type: ignore[arg-type]
    assert frozen.module.weight.grad is None
    frozen.unwrap()


def test_a_handle_without_optimizer_has_no_exposures_and_says_what_it_holds() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    handle = isolate.freeze(model)
    assert handle.exposures == ()
    assert (
        repr(handle)
        == "FreezeHandle(freeze on Sequential: 4 parameters, 1 BatchNorm layers, active)"
    )
    handle.restore()
    assert repr(handle).endswith(", restored)")
    inner = isolate.freezing.unfreeze(model, "0")
    assert (
        repr(inner)
        == "FreezeHandle(unfreeze on Sequential: 2 parameters, 0 BatchNorm layers, active)"
    )
    inner.restore()


def test_is_frozen_names_itself_in_its_errors() -> None:
    with pytest.raises(
        IsolationTypeError, match=r"^is_frozen\(\): model must be a torch\.nn\.Module, got str"
    ):
        isolate.freezing.is_frozen("model")  # type: ignore[arg-type]
    with pytest.raises(SelectorError, match=r"^is_frozen\(\): 'zz' matched no parameter of Linear"):
        isolate.freezing.is_frozen(nn.Linear(2, 1), "zz")


class _EditsBoth(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.zero_()
        b.mul_(2)
        return a + 1


def test_the_guard_lists_every_edited_input() -> None:
    a = torch.ones(2, requires_grad=True) * 1
    b = torch.ones(3, requires_grad=True) * 1
    with pytest.raises(
        isolate.errors.InplaceModificationError,
        match=r"^Detached\(_EditsBoth\): the branch edited input 0 \(shape \[2\]\), "
        r"input 1 \(shape \[3\]\) in place; ",
    ):
        isolate.Detached(_EditsBoth())(a, b)


def test_scale_gradient_takes_a_one_element_tensor_and_refuses_a_longer_one() -> None:
    x = torch.ones(2, requires_grad=True)
    isolate.scale_gradient(x * 1, torch.tensor(-0.5)).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), -0.5))  # type: ignore[arg-type]
    with pytest.raises(
        IsolationTypeError,
        match=r"^scale_gradient\(\): alpha must be a finite real number, "
        r"got tensor\(\[1\., 2\.\]\)",
    ):
        isolate.scale_gradient(x, torch.tensor([1.0, 2.0]))  # type: ignore[arg-type]
    with pytest.raises(IsolationTypeError, match=r"^scale_gradient\(\): expected a tensor"):
        isolate.scale_gradient("x", 1.0)
