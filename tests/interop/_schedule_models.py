"""A model factory for ``isolate schedule`` in the tests (imports torch only)."""

from __future__ import annotations

from torch import nn


class Tower(nn.Module):
    """stem -> 3 stages -> head, below a wrapper (as a LightningModule holding self.model)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential()
        self.model.add_module("stem", nn.Conv2d(3, 4, 3))
        self.model.add_module("act", nn.ReLU())
        for i in range(3):
            self.model.add_module(f"stage{i}", nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)))
        self.model.add_module("head", nn.Linear(4, 2))


def build_tower() -> nn.Module:
    return Tower()
