"""``isolate.freeze`` + ``restore`` from glob selectors against a bare ``requires_grad`` loop
and against Lightning's ``BaseFinetuning``."""

from __future__ import annotations

from torch import nn

import isolate
from experiments.bench._rows import Row
from experiments.bench._timing import median, median_pair

__all__ = ["run"]


def run(quick: bool) -> list[Row]:
    """Freeze and restore every tensor of a model of many small layers, three ways."""
    from pytorch_lightning.callbacks import BaseFinetuning

    count = 1000 if quick else 5000  # two parameter tensors per layer
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(count))  # type: ignore[assignment]
    params = list(model.parameters())

    def with_isolate() -> None:
        isolate.freeze(model, "blocks.*.weight", "blocks.*.bias").restore()

    def by_hand() -> None:
        flags = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(False)
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)

    def with_lightning() -> None:
        BaseFinetuning.freeze(model.blocks, train_bn=True)
        BaseFinetuning.make_trainable(model.blocks)

    repeat = 5 if quick else 15
    c, b = median_pair(with_isolate, by_hand, warmup=1, repeat=repeat)
    lightning = median(with_lightning, warmup=1, repeat=3 if quick else 5)
    return [
        Row(f"freeze+restore, {len(params)} tensors, glob selectors", "isolate.freeze",
            "bare requires_grad loop", c, b, "<= 1.5", c / b <= 1.5, limit=1.5),
        Row(f"freeze+restore, {len(params)} tensors", "isolate.freeze",
            "BaseFinetuning.freeze+make_trainable", c, lightning, "<= 0.1", c / lightning <= 0.1,
            limit=0.1),
    ]  # fmt: skip
