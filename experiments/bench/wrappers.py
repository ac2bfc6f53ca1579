"""The wrappers (``Detached``, ``Cloned``, ``GradientScale(-1)``) against the same by hand, in a
training step of the MNIST CNN and of ResNet-18 with a side branch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import isolate
from experiments.bench._rows import Row
from experiments.bench._timing import median_pair, paired
from experiments.bench.networks import ReverseByHand, mnist_net, resnet_net

__all__ = ["run"]

Branch = Callable[[torch.Tensor], torch.Tensor]


def _step_fn(
    trunk: nn.Module,
    head: nn.Module,
    aux: nn.Module,
    feed: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> Callable[[], None]:
    params = [*trunk.parameters(), *head.parameters(), *aux.parameters()]
    optimizer = torch.optim.SGD(params, lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        features = trunk(x)
        main = nn.functional.cross_entropy(head(features), y)
        side = nn.functional.cross_entropy(feed(features), y)
        (main + side).backward()
        optimizer.step()

    return step


def _pairs(side: nn.Module) -> dict[str, tuple[Branch, Callable[..., Any]]]:
    """Each wrapper around ``side``, and the same written by hand."""
    return {
        "Detached vs x.detach()": (isolate.Detached(side), lambda f, s=side: s(f.detach())),
        "Cloned vs x.clone()": (isolate.Cloned(side), lambda f, s=side: s(f.clone())),
        "GradientScale(-1) vs hand-written reversal": (
            nn.Sequential(isolate.GradientScale(-1.0), side),
            lambda f, s=side: s(ReverseByHand.apply(f)),
        ),
    }


def _nets(quick: bool) -> dict[str, tuple[Callable[[], Any], int]]:
    return {
        "MNIST CNN, batch 128": (mnist_net, 128),
        "ResNet-18, batch 16 of 64x64" if not quick else "ResNet-18, batch 4 of 32x32": (
            (lambda: resnet_net(64 if not quick else 32)),
            16 if not quick else 4,
        ),
    }


def run(quick: bool) -> list[Row]:
    """A training step with each wrapper against the step with the same by hand."""
    rows = []
    for label, (build, batch) in _nets(quick).items():
        torch.manual_seed(0)
        trunk, head, _ = build()
        x = build()[2](batch)
        y = torch.randint(0, 10, (batch,))
        width = head.in_features  # type: ignore[union-attr]
        side = nn.Linear(width, 10)
        pairs = _pairs(side)
        features = trunk(x).detach().requires_grad_(True)
        for name, (wrapped, by_hand) in pairs.items():
            candidate = _step_fn(trunk, head, side, wrapped, x, y)
            baseline = _step_fn(trunk, head, side, by_hand, x, y)
            c, b, ratio = paired(candidate, baseline, warmup=3, repeat=6 if quick else 60)
            # The wrapper's own cost, timed on the branch alone (forward + backward) where it is
            # not buried in the noise of a whole step: the step ratio it implies.
            branch_c, branch_b = median_pair(
                lambda w=wrapped, f=features: w(f).sum().backward(),
                lambda h=by_hand, f=features: h(f).sum().backward(),
                warmup=20,
                repeat=50 if quick else 400,
                collect=False,
            )
            overhead = branch_c - branch_b
            candidate_name, baseline_name = name.split(" vs ")
            rows.append(
                Row(
                    f"{name} ({label})",
                    candidate_name,
                    baseline_name,
                    c,
                    b,
                    "<= 1.02",
                    ratio <= 1.02,
                    {
                        "overhead per call (us)": round(1e6 * overhead, 1),
                        "step ratio implied by the overhead": round((b + overhead) / b, 5),
                    },
                    paired_ratio=ratio,
                    limit=1.02,
                )
            )
            if isinstance(wrapped, isolate.Detached | isolate.Cloned):
                wrapped.unwrap()
    return rows
