"""``gradient_report`` of K losses against K ``torch.autograd.grad`` passes."""

from __future__ import annotations

import torch
from torch import nn

from experiments.bench._rows import Row
from experiments.bench._timing import median_pair
from experiments.bench.networks import mnist_net
from isolate.gradients import gradient_report

__all__ = ["run"]


def run(quick: bool) -> list[Row]:
    """The report of 4 losses on the MNIST CNN (a head and 3 side branches) against the
    gradients of each loss by hand."""
    torch.manual_seed(0)
    trunk, head, make = mnist_net()
    aux = [nn.Linear(128, 10) for _ in range(3)]
    model = nn.ModuleDict({"trunk": trunk, "head": head, "aux": nn.ModuleList(aux)})
    x, y = make(64), torch.randint(0, 10, (64,))
    params = [p for p in model.parameters() if p.requires_grad]

    def losses() -> dict[str, torch.Tensor]:
        features = trunk(x)
        out = {"main": nn.functional.cross_entropy(head(features), y)}
        for i, branch in enumerate(aux):
            out[f"aux{i}"] = nn.functional.cross_entropy(branch(features), y)
        return out

    def with_report() -> None:
        gradient_report(losses(), model)

    def by_hand() -> None:
        named = losses()
        for loss in named.values():
            torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)

    c, b = median_pair(with_report, by_hand, warmup=1, repeat=5 if quick else 15)
    return [Row("gradient_report, K=4 losses (MNIST CNN)", "gradient_report",
                "K autograd.grad passes", c, b, "<= 1.1", c / b <= 1.1, limit=1.1)]  # fmt: skip
