"""Models, optimizers and tensors shared by the toolkit's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    """An encoder, a head scaled by a parameter of its own, and a probe on detached features."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)
        self.probe = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.encoder(x)
        return self.head(features) * self.scale, self.probe(features.detach())


X = torch.randn(5, 4)

Factory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


# The built-in optimizers, some with the settings (momentum, weight decay) that move a
# parameter whose gradient is a zero tensor.
OPTIMIZERS: dict[str, Factory] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "SGD-weight-decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.1),
    "RMSprop-momentum": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.1),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.1),
}


# Every dtype a parameter or buffer may hold.
ALL_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
]


def sample(dtype: torch.dtype, *shape: int, seed: int = 0) -> torch.Tensor:
    """A seeded tensor of ``dtype`` with values spread over its range."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(*shape, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(*shape, generator=generator).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=generator).to(
        dtype
    )


def every_single_bit_flip(t: torch.Tensor) -> Iterable[tuple[int, int, torch.Tensor]]:
    """``(byte, bit, copy of t with that bit flipped)`` for every bit of ``t``."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            yield byte, bit, flipped.view(t.dtype).reshape(t.shape)


class Tied(nn.Module):
    """One weight under two names (``a.weight``, ``b.weight``), one buffer under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("stat", torch.zeros(2))
        self.inner = nn.Module()
        self.inner.register_buffer("stat", self.stat)  # the same buffer under a second name


class ZeroInPlace(nn.Module):
    """A branch that zeroes its input in place: the edit a guard must catch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.zero_()


class Scaled(nn.Module):
    """A weight applied to ``x`` and a ``scale`` that must be passed by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x * self.weight * scale


def freed_checkpoint(lin: nn.Module) -> torch.Tensor:
    """A loss through a reentrant checkpoint of ``lin`` whose backward has already run, so
    its saved arguments are freed: brute force cannot say what it reaches, and the audits
    must refuse it."""
    out = checkpoint(lin, torch.randn(2, 3, requires_grad=True), use_reentrant=True).sum()
    out.backward()
    with pytest.raises(RuntimeError):  # brute force cannot answer either
        torch.autograd.grad(out, list(lin.parameters()))
    return out


class TanhOnce(torch.autograd.Function):
    """tanh whose backward cannot itself be differentiated."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a.tanh()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        return grad * (1 - a.tanh() ** 2)
