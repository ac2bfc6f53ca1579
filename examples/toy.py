"""The model and data the examples share: a trunk, a head, and a probe on the trunk's features.

The data are a seeded random teacher problem, so the examples run anywhere in seconds and
give the same numbers every time on the same machine, threads and versions.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["Net", "batches", "checksum", "losses", "summary"]


class Net(nn.Module):
    """``trunk`` (with BatchNorm) -> ``head`` for the main task; ``probe`` reads the features."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(
            nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32)
        )
        self.head = nn.Linear(32, 4)
        self.probe = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        return self.head(features), self.probe(features)


def _data(n: int = 512, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    teacher = torch.randn(16, 4, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def batches(epoch: int, batch_size: int = 64) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The training batches of ``epoch``, in an order fixed by the epoch number."""
    x, y = _data()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(100 + epoch))
    for start in range(0, len(x), batch_size):
        index = order[start : start + batch_size]
        yield x[index], y[index]


def losses(model: Net, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The main loss and the probe's loss, by name."""
    main, probe = model(x)
    return {
        "main": nn.functional.cross_entropy(main, y),
        "probe": nn.functional.cross_entropy(probe, y),
    }


def checksum(model: Net) -> float:
    """The sum of the head's weights, in float64: one number that any difference moves."""
    return float(model.head.weight.detach().double().sum())


WHY = (
    "Why this checksum: examples/plain_loop.py, fabric_loop.py and lightning_callback.py train "
    "the same Net from the same seed on the same batches under examples/isolation.yaml, and "
    "isolate adds no arithmetic to the training (the tests compare each with the same "
    "training written by hand with requires_grad_(False), .eval() and .detach(), bit for "
    "bit). So all three print the same checksum on one machine with the same versions and "
    "thread count, and so does a run stopped and resumed from its checkpoint, which carries "
    "what was thawed and when, and the optimizer's state."
)


def summary(model: Net, tally: object, *, stopped: str = "") -> str:
    """What the run's ``verify`` calls checked, the checksum, and why it is the same number
    in every example (``stopped``: how to finish a run that was interrupted on purpose)."""
    why = f"Stopped early on purpose: {stopped}" if stopped else WHY
    return f"{tally}\nhead weight checksum: {checksum(model):.6f}\n{textwrap.fill(why, 92)}"
