"""The networks the sections time, and a gradient reversal written by hand."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ReverseByHand", "mnist_net", "resnet_net", "transformer"]


def mnist_net() -> tuple[nn.Module, nn.Module, Callable[[int], torch.Tensor]]:
    """The MNIST CNN as (trunk, head, a batch of ``n`` random images)."""
    trunk = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
    )  # fmt: skip
    return trunk, nn.Linear(128, 10), lambda n: torch.randn(n, 1, 28, 28)


def resnet_net(size: int) -> tuple[nn.Module, nn.Module, Callable[[int], torch.Tensor]]:
    """ResNet-18 without its classifier as (trunk, head, ``n`` random ``size``-pixel images)."""
    import torchvision

    resnet = torchvision.models.resnet18(weights=None)
    resnet.fc = nn.Identity()  # type: ignore[assignment]
    return resnet, nn.Linear(512, 10), lambda n: torch.randn(n, 3, size, size)


def transformer(layers: int, width: int, heads: int) -> nn.TransformerEncoder:
    """A seeded transformer encoder (the same on every rank), without dropout."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class ReverseByHand(torch.autograd.Function):
    """The gradient reversal as one would write it without isolate."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad
