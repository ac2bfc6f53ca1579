"""Every context manager and wrapper restores exact state when the body, the forward or the
backward raises."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import isolate
import isolate.freezing


class Boom(RuntimeError):
    pass


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner(x)
        raise Boom("forward failed")


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Boom("backward failed")


def state(model: nn.Module) -> Any:
    return (
        [(n, id(p), p.requires_grad) for n, p in model.named_parameters()],
        [(n, type(m), m.training, len(m._forward_pre_hooks)) for n, m in model.named_modules()],
    )


def test_frozen_forward_that_raises_leaves_grad_mode_and_flags() -> None:
    failing = Failing()
    wrapped = isolate.Frozen(failing)
    inside = state(failing)
    with pytest.raises(Boom):
        wrapped(torch.randn(4, 3))
    assert torch.is_grad_enabled()
    assert state(failing) == inside
    with pytest.raises(Boom):
        wrapped(torch.randn(4, 3, requires_grad=True))
    assert torch.is_grad_enabled()
    wrapped.unwrap()
    assert all(p.requires_grad for p in failing.parameters())


@pytest.mark.parametrize("wrapper", [isolate.Detached, isolate.Cloned])
def test_branch_forward_that_raises_leaves_the_inputs_and_the_branch(wrapper: Any) -> None:
    failing = Failing()
    before = state(failing)
    x = torch.randn(4, 3, requires_grad=True) * 1
    kept = x.detach().clone()
    with pytest.raises(Boom):
        wrapper(failing)(x)
    assert torch.equal(x, kept) and state(failing) == before


def test_backward_that_raises_inside_frozen_restores() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    before = state(model)
    with pytest.raises(Boom), isolate.frozen(model, "0", "1"):
        FailingBackward.apply(model(torch.randn(4, 3))).sum().backward()
    assert state(model) == before


def test_keyboard_interrupt_inside_unfrozen_restores() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with isolate.frozen(model):
        frozen_state = state(model)
        with pytest.raises(KeyboardInterrupt), isolate.freezing.unfrozen(model, "1"):
            raise KeyboardInterrupt
        assert state(model) == frozen_state
    assert all(p.requires_grad for p in model.parameters())


class Tripwire(nn.Parameter):
    """A parameter whose first requires_grad_ call is interrupted (as by Ctrl-C)."""

    tripped = False

    def requires_grad_(self, requires_grad: bool = True) -> Tripwire:
        if not Tripwire.tripped:
            Tripwire.tripped = True
            raise KeyboardInterrupt
        return super().requires_grad_(requires_grad)  # type: ignore[return-value]


def test_a_freeze_interrupted_halfway_undoes_what_it_flipped() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    model[2].weight = Tripwire(model[2].weight.detach())
    Tripwire.tripped = False
    before = state(model)
    active = set(isolate.freezing._active)
    with pytest.raises(KeyboardInterrupt):
        isolate.freeze(model)
    assert state(model) == before  # the first four flags and the BatchNorm hold: undone
    assert set(isolate.freezing._active) == active


def test_a_freeze_whose_optimizer_check_fails_changes_nothing() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)

    class Groups(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            raise Boom("param groups cannot be read")

    optimizer.param_groups = Groups(optimizer.param_groups)
    before = state(model)
    with pytest.raises(Boom):
        isolate.freeze(model, "0", "1", optimizer=optimizer)
    assert state(model) == before


class TrippingNorm(nn.BatchNorm1d):
    """A BatchNorm whose mode switch is interrupted once (armed after construction)."""

    armed = False

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "training" and self.armed:
            type(self).armed = False
            raise KeyboardInterrupt
        super().__setattr__(name, value)


def test_a_freeze_interrupted_after_holding_a_norm_drops_every_hold() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), TrippingNorm(3), nn.Linear(3, 1))
    before = state(model)
    TrippingNorm.armed = True
    with pytest.raises(KeyboardInterrupt):
        isolate.freeze(model)
    assert not TrippingNorm.armed  # the interrupt came after both norms were held
    assert state(model) == before  # flags, modes, and no hold left on either norm
    with isolate.frozen(model, "1") as handle:
        assert handle.held == ("1",)
    assert state(model) == before
