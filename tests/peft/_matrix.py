"""The runners of the fault matrix: one model, one :class:`Fault`, a few training steps with
isolation checks at every step, under a plain loop, each Lightning and transformers' Trainer.

A runner derives the spec with ``fault.spec`` (by default :func:`isolate.peft.spec_for`) and
trains :data:`STEPS` steps on :func:`data`. A fault that needs its own optimizer or loss
plants it each runner's own way: the loop and ``configure_optimizers`` build the optimizer
and call the loss; a ``Trainer`` subclass overrides ``create_optimizer`` and
``compute_loss``, the methods in which the Trainer builds its optimizer and takes its loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from isolate.errors import IsolationError
from isolate.peft import spec_for
from isolate.spec import IsolationSpec
from tests._llama import batch

STEPS = 3
ROWS = [3, 5, 17]


def model_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**data).loss  # type: ignore[no-any-return]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2, weight_decay=0.1)


def data(seed: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        one = batch(seed=seed * 100 + step)
        one["input_ids"][:, : len(ROWS)] = torch.tensor(ROWS)  # the trainable rows are used
        out.append(one)
    return out


@dataclass(frozen=True)
class Fault:
    """A model to build, what goes wrong in it, and the error that must name it (``None``:
    clean, nothing may be raised).

    ``spec`` derives the spec from the model; ``optimizer``, when given, builds the optimizer
    from the model after the spec is applied (else each runner's usual one: AdamW over what
    requires grad); ``loss`` takes the model and a batch; ``after``, for a clean run, asserts
    on the model once it has trained.
    """

    build: Callable[[int], nn.Module]
    error: type[IsolationError] | None = None
    match: str = ""
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] = field(default=model_loss)
    spec: Callable[[nn.Module], IsolationSpec] = field(default=spec_for)
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    after: Callable[[nn.Module], None] | None = None


Runner = Callable[[nn.Module, Fault, int, Path], None]


def run_loop(model: nn.Module, fault: Fault, seed: int, tmp_path: Path) -> None:
    """A plain loop driven by ``handle.check_every(1)``."""
    handle = fault.spec(model).apply(model)
    try:
        opt = (fault.optimizer or (lambda m: adamw(m.parameters())))(model)
        handle.attach(opt)
        loop = handle.check_every(1)
        model.train()
        for step, one in enumerate(data(seed)):
            loop.begin_step(epoch=0, step=step)
            loss = fault.loss(model, one)
            loop.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.end_step()
        loop.finish()
    finally:
        handle.restore()


@functools.cache
def _module(lightning: ModuleType) -> type[Any]:
    class Net(lightning.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, model: nn.Module, fault: Fault) -> None:
            super().__init__()
            self.model, self.fault = model, fault

        def training_step(self, data: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.fault.loss(self.model, data)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.fault.optimizer is not None:
                return self.fault.optimizer(self.model)
            return adamw(self.parameters())

    return Net


def run_lightning(lightning: ModuleType) -> Runner:
    def run(model: nn.Module, fault: Fault, seed: int, tmp_path: Path) -> None:
        from isolate.lightning import IsolationCallback
        from tests.lightning._models import trainer

        callback = IsolationCallback(
            spec=fault.spec(model).prefixed("model"),
            verify_every_n_steps=1,
            log_grad_norms=False,
            ledger=False,
        )
        loader = torch.utils.data.DataLoader(data(seed), batch_size=None)
        fit = trainer(tmp_path, [callback], lightning=lightning, max_epochs=1, max_steps=STEPS)
        fit.fit(_module(lightning)(model, fault), loader)

    return run


def run_trainer(model: nn.Module, fault: Fault, seed: int, tmp_path: Path) -> None:
    """transformers' ``Trainer`` (CPU, AdamW with weight decay, a constant lr) with the
    ``IsolationTrainerCallback`` checking every step."""
    from transformers import Trainer

    from isolate.transformers import IsolationTrainerCallback
    from tests.transformers._models import arguments

    class FaultTrainer(Trainer):
        def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
            if fault.optimizer is None or self.optimizer is not None:
                return super().create_optimizer(*args, **kwargs)  # type: ignore[no-any-return]
            self.optimizer = fault.optimizer(self.model)
            return self.optimizer

        def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if fault.loss is model_loss:
                return super().compute_loss(model, inputs, *args, **kwargs)
            return fault.loss(model, inputs)

    # The same sequences as the other runners, 2 per step.
    examples = [{k: v[i] for k, v in one.items()} for one in data(seed) for i in range(2)]
    args = arguments(
        tmp_path,
        steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        remove_unused_columns=False,
        seed=seed,
    )
    trainer = FaultTrainer(model=model, args=args, train_dataset=examples)
    IsolationTrainerCallback(trainer, fault.spec(model), verify_every_n_steps=1)
    trainer.train()


RUNNERS: dict[str, Callable[[], Runner]] = {
    "loop": lambda: run_loop,
    "pytorch_lightning": lambda: run_lightning(pytest.importorskip("pytorch_lightning")),
    "lightning.pytorch": lambda: run_lightning(pytest.importorskip("lightning.pytorch")),
    "transformers.Trainer": lambda: run_trainer,
}
