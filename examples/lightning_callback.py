"""The Lightning callback under the same isolation spec.

``training_step`` stays plain; it names its auxiliary loss in ``self.isolation_losses``, and
the callback applies the spec, thaws on schedule, checks every few steps and saves the
spec's state in Lightning's checkpoints (``last.ckpt`` in ``--root``, after every epoch)::

    python examples/lightning_callback.py --epochs 4 --root run
    python examples/lightning_callback.py --epochs 4 --root run --stop-after 2
    python examples/lightning_callback.py --epochs 4 --root run --resume   # from epoch 2

It prints what the callback's checks verified, and the head's checksum: the plain loop's
number, also after a resume.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.plain_loop import load_spec
from examples.toy import Net, batches, losses, summary
from isolate.cli import Parser
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


def train(
    epochs: int,
    root: Path,
    *,
    stop_after: int | None = None,
    resume: bool = False,
    verbose: bool = False,
) -> ToyModule:
    """Fit ``ToyModule`` under the spec of ``examples/isolation.yaml``, saving ``last.ckpt``
    in ``root`` after every epoch; ``resume`` continues from it, ``stop_after`` ends the fit
    after that many epochs (an interruption)."""
    spec = load_spec().prefixed("net")  # the LightningModule holds the model as `net`
    module = ToyModule()
    isolation = IsolationCallback(spec=spec, verify_every_n_steps=4)
    last = root / "last.ckpt"
    trainer = pl.Trainer(
        default_root_dir=root,
        max_epochs=epochs if stop_after is None else min(epochs, stop_after),
        accelerator="cpu",
        callbacks=[isolation, ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, ckpt_path=last if resume else None)
    if verbose:
        stopped = stop_after is not None and stop_after < epochs
        hint = "run the same command with --resume instead of --stop-after to finish."
        print(summary(module.net, isolation.tally, stopped=hint if stopped else ""))
    return module


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python examples/lightning_callback.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=4, help="epochs to train (default 4)")
    parser.add_argument(
        "--root",
        type=Path,
        default=Path("outputs/examples/lightning"),
        help="the folder of the checkpoints (default outputs/examples/lightning)",
    )
    parser.add_argument(
        "--stop-after", type=int, default=None, help="stop after this many epochs (an interruption)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from last.ckpt in --root")
    args = parser.parse_args(argv)
    if args.resume and not (args.root / "last.ckpt").is_file():
        parser.error(f"--resume: {args.root / 'last.ckpt'} does not exist; run --stop-after first")
    train(args.epochs, args.root, stop_after=args.stop_after, resume=args.resume, verbose=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
