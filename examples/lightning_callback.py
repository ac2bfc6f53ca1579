"""The Lightning callback under the same isolation spec.

``training_step`` stays plain; it names its auxiliary loss in ``self.isolation_losses``, and
the callback applies the spec, thaws on schedule, checks every few steps and saves the
spec's state in Lightning's checkpoints::

    python examples/lightning_callback.py --epochs 4 --root /tmp/run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.plain_loop import load_spec
from examples.toy import Net, batches, losses
from isolate.lightning import IsolationCallback


class EpochBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The toy batches of the current epoch, as a dataset of whole batches."""

    def __init__(self) -> None:
        self.epoch = 0

    def __len__(self) -> int:
        return len(list(batches(0)))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return list(batches(self.epoch))[index]


class ToyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.data = EpochBatches()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = losses(self.net, x[0], y[0])
        self.isolation_losses = {"probe": loss["probe"]}  # checked by the callback
        self.log("main", loss["main"], prog_bar=True)
        return loss["main"] + loss["probe"]

    def on_train_epoch_start(self) -> None:
        self.data.epoch = self.current_epoch

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=1, shuffle=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Setup ran before this: frozen parameters do not require grad any more.
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trainable, lr=0.05, momentum=0.9, weight_decay=1e-4)


def train(epochs: int, root: Path) -> ToyModule:
    """Fit ``ToyModule`` under the spec of ``examples/isolation.yaml``."""
    spec = load_spec().prefixed("net")  # the LightningModule holds the model as `net`
    module = ToyModule()
    trainer = pl.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        callbacks=[IsolationCallback(spec=spec, verify_every_n_steps=4)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/lightning_callback.py", description=__doc__
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--root", type=Path, default=Path("outputs/examples/lightning"))
    args = parser.parse_args(argv)
    module = train(args.epochs, args.root)
    checksum = float(module.net.head.weight.detach().double().sum())
    print(f"head weight checksum: {checksum:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
