"""``reachable_parameters`` (a walk of the autograd graph) against one backward pass."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from experiments.bench._rows import Row
from experiments.bench._timing import median
from experiments.bench.networks import resnet_net
from isolate.reachability import reachable_parameters

__all__ = ["run"]


def run(quick: bool) -> list[Row]:
    """The walk of a loss's graph against the backward of the same loss: ResNet-18 and a
    transformer encoder."""
    rows = []
    torch.manual_seed(0)
    resnet, _, make = resnet_net(32 if quick else 128)
    batch = 4 if quick else 32
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(128 if quick else 512, 8, batch_first=True),
        num_layers=2 if quick else 12,
        enable_nested_tensor=False,
    )
    tokens = torch.randn(batch, 32 if quick else 128, 128 if quick else 512)
    cases = {
        f"ResNet-18, {batch} images": (resnet, lambda: resnet(make(batch)).square().mean()),
        "Transformer encoder": (encoder, lambda: encoder(tokens).square().mean()),
    }
    for label, (model, loss_fn) in cases.items():
        walks, backwards = [], []
        for _ in range(2 if quick else 3):
            loss = loss_fn()
            walks.append(
                median(lambda: reachable_parameters(loss, model), warmup=1, repeat=5)  # noqa: B023
            )
            start = time.perf_counter()
            loss.backward()
            backwards.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        c, b = statistics.median(walks), statistics.median(backwards)
        rows.append(Row(f"reachable_parameters ({label})", "graph walk", "one backward pass",
                        c, b, "<= 0.02", c / b <= 0.02, limit=0.02))  # fmt: skip
    return rows
