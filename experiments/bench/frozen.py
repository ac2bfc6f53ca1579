"""A training step through ``Frozen(trunk)`` against the trunk trained, frozen by hand, and
frozen by Lightning's ``BaseFinetuning``: time, and the activations saved for backward."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import isolate
from experiments.bench._rows import Row
from experiments.bench._timing import saved_bytes
from experiments.bench.networks import resnet_net

__all__ = ["run"]

# name -> (set up, the module to call, the optimizer, tear down)
Variants = dict[str, tuple[Callable[[], object], Callable[[], nn.Module], Any, Callable[..., Any]]]


def _variants(trunk: nn.Module, everything: Any, head_only: Any) -> Variants:
    from pytorch_lightning.callbacks import BaseFinetuning

    def by_hand_on() -> None:
        for p in trunk.parameters():
            p.requires_grad_(False)

    def by_hand_off() -> None:
        for p in trunk.parameters():
            p.requires_grad_(True)

    wrapped: list[isolate.Frozen] = []
    return {
        "trained trunk": (lambda: None, lambda: trunk, everything, lambda: None),
        "requires_grad=False by hand": (by_hand_on, lambda: trunk, head_only, by_hand_off),
        "BaseFinetuning.freeze": (
            lambda: BaseFinetuning.freeze(trunk, train_bn=False),
            lambda: trunk,
            head_only,
            lambda: BaseFinetuning.make_trainable(trunk),
        ),
        "Frozen": (
            lambda: wrapped.append(isolate.Frozen(trunk)),
            lambda: wrapped[-1],
            head_only,
            lambda: wrapped.pop().unwrap(),
        ),
    }  # fmt: skip


def _measure(
    variants: Variants, step: Callable[[nn.Module, Any], None], rounds: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Step times per variant over ``rounds`` rounds in alternating order, and the bytes each
    variant's step saves for backward (round 0, which also warms up)."""
    memory: dict[str, int] = {}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds + 1):  # round 0 warms up and measures memory
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            setup, module, optimizer, teardown = variants[name]
            setup()
            if r == 0:
                called = module()
                memory[name] = saved_bytes(lambda m=called, o=optimizer: step(m, o))
            else:
                start = time.perf_counter()
                step(module(), optimizer)
                times[name].append(time.perf_counter() - start)
            teardown()
    return times, memory


def run(quick: bool) -> list[Row]:
    """``Frozen(trunk)`` against the best of the other three, on a ResNet-18 trunk."""
    torch.manual_seed(0)
    trunk, head, make = resnet_net(32 if quick else 64)
    batch = 4 if quick else 16
    x, y = make(batch), torch.randint(0, 10, (batch,))
    trunk.train()
    everything = torch.optim.SGD([*trunk.parameters(), *head.parameters()], lr=1e-4)
    head_only = torch.optim.SGD(head.parameters(), lr=1e-4)
    variants = _variants(trunk, everything, head_only)

    def step(module: nn.Module, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(head(module(x)), y).backward()
        optimizer.step()

    rounds = 3 if quick else 9
    times, memory = _measure(variants, step, rounds)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    others = [n for n in variants if n != "Frozen"]
    per_round = [times["Frozen"][i] / min(times[n][i] for n in others) for i in range(rounds)]
    ratio = statistics.median(per_round)
    extra = {"saved activation bytes": memory, "step seconds (median)": medians}
    best = min(medians[n] for n in others)
    by_hand = memory["requires_grad=False by hand"]
    return [Row("Frozen(trunk) step, ResNet-18 trunk", "Frozen", "best of trained / by hand / "
                "BaseFinetuning", medians["Frozen"], best, "<= 1.03", ratio <= 1.03,
                extra, paired_ratio=ratio, limit=1.03),
            Row("Frozen(trunk) saved activations, ResNet-18 trunk", "Frozen",
                "requires_grad=False by hand", memory["Frozen"], by_hand, "<= 1.0",
                memory["Frozen"] <= by_hand, limit=1.0, unit="bytes")]  # fmt: skip
