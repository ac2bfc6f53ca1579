"""A tiny regression net with a dict-returning forward, its data, and a Trainer over them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments


class Net(nn.Module):
    """Two layers (``a`` then ``b``); ``unused=True`` adds a trainable layer ``c`` that no
    loss reaches."""

    def __init__(self, *, seed: int = 0, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)
        self.c = nn.Linear(4, 4) if unused else None

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.b(torch.tanh(self.a(x))).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """16 examples: 4 optimizer steps per epoch at batch size 4."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)}


def arguments(
    root: Path, *, steps: int = 4, save_steps: int = 0, evaluate: bool = False, **kwargs: Any
) -> TrainingArguments:
    """CPU ``TrainingArguments`` of ``steps`` optimizer steps, quiet (no reports, logs or
    progress bars), AdamW with weight decay and a linear schedule, saving every ``save_steps``
    steps (``0``: never), evaluating after every step with ``evaluate``; ``kwargs`` override
    any of these."""
    defaults: dict[str, Any] = dict(
        output_dir=str(root),
        use_cpu=True,
        report_to=[],
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=1,
    )
    return TrainingArguments(**{**defaults, **kwargs})


def trainer(
    root: Path,
    model: nn.Module,
    *,
    steps: int = 4,
    save_steps: int = 0,
    evaluate: bool = False,
    **kwargs: Any,
) -> Trainer:
    """A Trainer of :func:`arguments` over :class:`Data` (also its eval set with
    ``evaluate``)."""
    args = arguments(root, steps=steps, save_steps=save_steps, evaluate=evaluate, **kwargs)
    return Trainer(
        model=model, args=args, train_dataset=Data(), eval_dataset=Data() if evaluate else None
    )
