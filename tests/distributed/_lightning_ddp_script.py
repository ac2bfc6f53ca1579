"""Two-process DDP runs on the CPU (gloo) for ``tests/distributed/test_lightning_ddp.py``.

Usage: ``python tests/distributed/_lightning_ddp_script.py OUT_DIR [LIGHTNING]``
(``pytorch_lightning`` by default, or ``lightning.pytorch``). Lightning's ``ddp`` strategy
starts the second process by running this same command again; both processes then run:

* ``isolate``: IsolationCallback freezes the trunk, detaches the aux branch, thaws
  ``trunk.0`` before step 1 and the rest of the trunk at epoch 1 (2 steps per epoch);
* ``backbone``: Lightning's BackboneFinetuning thaws the trunk at epoch 1 (the negative
  control), with an IsolationCallback that only checks (``on_violation="warn"``);
* ``raise``: the same with ``on_violation="raise"``: every rank stops with
  ``RankDivergenceError``.

Each rank writes ``OUT_DIR/<mode>-rank<r>.json``: a checksum of every parameter at fit start
and at the end of each epoch, the number of parameters DDP synchronises at each epoch start, and the
callback's warnings.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from isolate import IsolationWarning, Thaw
from isolate.errors import RankDivergenceError
from isolate.lightning import IsolationCallback
from tests.lightning._models import BackboneSteps, loader, net, trainer

# The Lightning to run under: the second argument when run as a script (pytest imports this file
# too, to collect doctests, with argv of its own).
RUN_AS_SCRIPT = __name__ == "__main__" and len(sys.argv) > 2
pl = importlib.import_module(sys.argv[2] if RUN_AS_SCRIPT else "pytorch_lightning")
Net, BackboneNet = net(pl), net(pl, BackboneSteps)


class Record(pl.Callback):
    def __init__(self) -> None:
        self.synced: list[int] = []
        self.checksums: list[dict[str, str]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # How many parameters the DDP wrapper synchronises (private API: the point of the test).
        ddp = trainer.strategy.model
        self.synced.append(int(ddp._get_ddp_logging_data()["num_parameter_tensors"]))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_train_epoch_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.checksums.append(
            {
                name: hashlib.sha256(p.detach().cpu().numpy().tobytes()).hexdigest()[:16]
                for name, p in pl_module.state_dict().items()
                if not name.endswith(("running_mean", "running_var", "num_batches_tracked"))
            }
        )


def run(out: Path, mode: str) -> None:
    model: Net
    callbacks: list[pl.Callback]
    if mode == "isolate":
        model = Net()
        callbacks = [
            IsolationCallback(
                freeze=["trunk"],
                detach=["aux"],
                thaw=[
                    Thaw("trunk.0", step=1, lr=0.05),
                    Thaw(["trunk.1", "trunk.3"], epoch=1, lr=0.05),
                ],
                verify_every_n_steps=1,
            )
        ]
    else:
        model = BackboneNet()
        callbacks = [
            pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.05),
            IsolationCallback(
                verify_every_n_steps=1, on_violation="raise" if mode == "raise" else "warn"
            ),
        ]
    record = Record()
    fit = trainer(
        out / mode,
        [*callbacks, record],
        max_epochs=3,
        devices=2,
        strategy="ddp",
        lightning=pl,
    )
    error: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IsolationWarning)
        try:
            fit.fit(model, loader())
        except RankDivergenceError as raised:  # mode "raise": every rank raises it
            error = raised
    result: dict[str, Any] = {
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "rank": fit.global_rank,
        "world_size": fit.world_size,
        "synced": record.synced,
        "checksums": record.checksums,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, IsolationWarning)],
        "requires_grad_after_fit": all(p.requires_grad for p in model.parameters()),
    }
    (out / f"{mode}-rank{fit.global_rank}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module=pl.__name__)
    for mode in ("isolate", "backbone", "raise"):
        run(out, mode)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
