"""IsolationCallback under Lightning's ModelParallelStrategy (FSDP2): 2 CPU processes, gloo.

Usage: ``python tests/distributed/_lightning_fsdp_script.py OUT_DIR [LIGHTNING]``
(``pytorch_lightning`` by default, or ``lightning.pytorch``). Lightning starts the second
process by running this same command again; both processes then run:

* ``full``: 3 epochs of 2 steps; the trunk frozen, the aux branch detached, ``trunk.3``
  thawed at epoch 1, AdamW with weight decay; a distributed checkpoint after every epoch;
* ``resume``: the same fit resumed from the checkpoint after epoch 1 (the thaw done).

Each rank writes ``OUT_DIR/<run>-rank<r>.json``: fingerprints of every full parameter (one
tensor gathered at a time) at fit start and after each epoch, the optimizer's param groups,
the callback's state and warnings.
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard

from isolate import IsolationWarning, Thaw
from isolate._sharding import canonical_parameters
from isolate.drift import fingerprint
from isolate.lightning import IsolationCallback
from tests.lightning._models import loader, net, trainer

# The Lightning to run under: the second argument when run as a script (pytest imports this file
# too, to collect doctests, with argv of its own).
RUN_AS_SCRIPT = __name__ == "__main__" and len(sys.argv) > 2
pl = importlib.import_module(sys.argv[2] if RUN_AS_SCRIPT else "pytorch_lightning")
Net = net(pl)


class ShardedNet(Net):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        # training_step calls the children, never self(x): every parameter sits in a child
        # unit (the trunk one mixes frozen and thawed parameters), the root holds none.
        for module in (self.trunk, self.head, self.aux, self):
            fully_shard(module, mesh=mesh)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class Record(pl.Callback):
    def __init__(self) -> None:
        self.prints: list[dict[str, str]] = []
        self.groups: list[list[int]] = []
        self.types: list[str] = []
        self.optim: list[Any] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opt = trainer.optimizers[0]
        self.optim.append(
            [
                [
                    g["lr"],
                    [
                        sorted((k, fingerprint(v)) for k, v in opt.state[p].items())
                        for p in g["params"]
                    ],
                ]
                for g in opt.param_groups
            ]
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_train_epoch_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A unit can still hold unsharded temporaries here (a frozen one is not resharded
        # after backward): read the sharded parameters, and gather one tensor at a time.
        named = canonical_parameters(pl_module, dict(pl_module.named_parameters()))
        self.prints.append(
            {n: f"{fingerprint(p.detach().full_tensor()):032x}" for n, p in named.items()}
        )
        opt = trainer.optimizers[0]
        self.groups.append([len(g["params"]) for g in opt.param_groups])
        self.types = sorted({type(p).__name__ for g in opt.param_groups for p in g["params"]})


def run(out: Path, name: str, ckpt: str | None) -> dict[str, Any]:
    callback = IsolationCallback(
        freeze=["trunk"],
        detach=["aux"],
        thaw=[Thaw("trunk.3", epoch=1, lr=0.05)],
        verify_every_n_steps=1,
    )
    record = Record()
    saver = pl.callbacks.ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, every_n_epochs=1)
    model = ShardedNet()
    fit = trainer(
        out / name,
        [callback, record, saver],
        max_epochs=3,
        devices=2,
        strategy=pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        enable_checkpointing=True,
        lightning=pl,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IsolationWarning)
        fit.fit(model, loader(), ckpt_path=ckpt)
    return {
        "rank": fit.global_rank,
        "world_size": fit.world_size,
        "prints": record.prints,
        "groups": record.groups,
        "optimizer_types": record.types,
        "optim": [str(o) for o in record.optim],
        "state": callback.state_dict(),
        "requires_grad_after_fit": all(p.requires_grad for p in model.parameters()),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, IsolationWarning)],
        "checkpoints": sorted(p.name for p in (out / "ckpt").iterdir()),
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    full = run(out, "full", None)
    (out / f"full-rank{full['rank']}.json").write_text(json.dumps(full, indent=1))
    resumed = run(out, "resume", str(out / "ckpt" / "epoch=1-step=4.ckpt"))
    (out / f"resume-rank{resumed['rank']}.json").write_text(json.dumps(resumed, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
