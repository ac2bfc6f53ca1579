"""Training with ``IsolationCallback`` (a detached probe, checks every 50 steps) against the
same training without it: the throughput a run keeps."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.bench._rows import Row
from experiments.bench._timing import alternating
from experiments.bench.networks import mnist_net

__all__ = ["run"]


def _fit_seconds(with_callback: bool, steps: int, root: Path) -> float:
    """Wall time of ``steps`` training steps of the MNIST CNN with a detached linear probe."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from isolate.lightning import IsolationCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.trunk, self.head, _ = mnist_net()
            self.probe = nn.Linear(128, 10)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            features = self.trunk(x)
            main = nn.functional.cross_entropy(self.head(features), y)
            aux = nn.functional.cross_entropy(self.probe(features), y)
            self.isolation_losses = {"probe": aux}
            return main + aux

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64 * steps, 1, 28, 28, generator=generator),
        torch.randint(0, 10, (64 * steps,), generator=generator),
    )
    callbacks = [IsolationCallback(detach=["probe"], verify_every_n_steps=50)]
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks if with_callback else [],
    )
    start = time.perf_counter()
    trainer.fit(Module(), DataLoader(data, batch_size=64))
    return time.perf_counter() - start


def run(quick: bool) -> list[Row]:
    """Whole fits with and without the callback, in alternating order after a warm-up fit."""
    import logging
    import tempfile
    import warnings

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    steps = 60 if quick else 200
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit_seconds(True, 5, Path(root))  # warm-up: imports, first-call overheads
        with_cb, without = alternating(
            lambda: _fit_seconds(True, steps, Path(root)),
            lambda: _fit_seconds(False, steps, Path(root)),
            2 if quick else 5,
        )
    c, b = statistics.median(with_cb), statistics.median(without)
    # Throughput is steps/time, so throughput ratio = baseline time / candidate time.
    return [Row(f"IsolationCallback (detach + checks every 50 steps), {steps} MNIST steps",
                "with callback", "without", c, b, "throughput >= 0.97 (time ratio <= 1.031)",
                b / c >= 0.97, {"throughput ratio": b / c}, limit=1 / 0.97)]  # fmt: skip
