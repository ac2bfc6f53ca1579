"""A real Lightning run certified from its own first and last checkpoints: with the trunk
frozen by IsolationCallback, the trunk (and its BatchNorm statistics) bitwise unchanged and
the head moved; without it, the certificate names the trunk's tensors that moved."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from isolate.certificates import certify
from isolate.lightning import IsolationCallback
from isolate.spec import IsolationSpec
from tests.lightning._models import Net, loader

SPEC = IsolationSpec(freeze=["trunk"], bn="eval")


class _FirstCheckpoint(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _run(tmp_path: Path, callbacks: list[Any]) -> tuple[Path, Path]:
    first, last = tmp_path / "first.ckpt", tmp_path / "last.ckpt"
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, _FirstCheckpoint(first)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few-workers and small-dataset notices
        trainer.fit(Net(aux=False), loader())
    trainer.save_checkpoint(last)
    return first, last


def test_a_frozen_trunk_run_certifies_trunk_unchanged_head_moved(tmp_path: Path) -> None:
    first, last = _run(tmp_path, [IsolationCallback(spec=SPEC, verify_every_n_steps=0)])
    cert = certify(first, last, spec=SPEC, ignore=["aux"])
    assert cert.clean, str(cert)
    assert cert.base.group == cert.tuned.group == "state_dict"
    assert sorted(cert.summary()) == [
        "head: 2 trainable, moved",
        "trunk: 6 frozen, bitwise unchanged; 3 held, bitwise unchanged",
    ]


def test_the_same_run_without_the_freeze_is_named(tmp_path: Path) -> None:
    first, last = _run(tmp_path, [])
    cert = certify(first, last, spec=SPEC, ignore=["aux"])
    failed = {v.key for v in cert.failures}
    assert {"trunk.0.weight", "trunk.3.weight", "trunk.1.running_mean"} <= failed
    assert all(v.claim in ("frozen", "held") for v in cert.failures)
