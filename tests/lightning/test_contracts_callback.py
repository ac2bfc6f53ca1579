"""The Lightning callback with contracts, mode holding and the ledger, in a real tiny Trainer."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import isolate
from isolate.errors import ContractError
from isolate.lightning import IsolationCallback


class ProbeNet(pl.LightningModule):
    """A trunk with BatchNorm and dropout, a head, and a probe behind Detached."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3))
        self.head = nn.Linear(8, 3)
        self.probe = isolate.Detached(nn.Linear(8, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = self.trunk(x)
        main = F.cross_entropy(self.head(features), y)
        probe = F.cross_entropy(self.probe(features), y)
        self.isolation_losses = {"main": main, "probe": probe}
        return main + probe

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


class Metrics(Logger):
    """Keeps what is logged."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append(dict(metrics))


def fit(root: Path, callback: IsolationCallback, logger: Logger | bool = False) -> ProbeNet:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 4, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    )
    model = ProbeNet()
    trainer = pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        max_epochs=2,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*in eval mode at the start of training.*")
        trainer.fit(model, DataLoader(data, batch_size=16))
    return model


TEACHER = {"kind": "teacher", "select": "trunk"}
PROBE = {"kind": "probe", "select": "probe", "loss": "probe"}


@pytest.mark.slow
def test_contracts_hold_in_a_fit_and_the_ledger_is_printed_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, one_thread: None
) -> None:
    callback = IsolationCallback(
        freeze=["trunk"], mode="eval", contracts=[TEACHER, PROBE], verify_every_n_steps=2
    )
    logger = Metrics()
    with caplog.at_level(logging.INFO):
        fit(tmp_path, callback, logger)
    text = caplog.text
    assert (
        "2 of the 2 module(s) Lightning finds in eval mode at the start of training are held"
        in text
    )
    assert "trunk.1, trunk.2" in text
    assert "the parameters at step 0" in text
    assert (
        "trainable 54 of 110 parameters (49.09%) in 4 tensors; reached 4 of 4; irregular 0" in text
    )
    assert callback.ledger is not None and callback.ledger.summary()["irregular"] == 0
    summary = next(m for m in logger.logged if "isolation/ledger/trainable" in m)
    assert (
        summary["isolation/ledger/trainable"] == 54 and summary["isolation/ledger/irregular"] == 0
    )
    assert callback.handle is None  # restored at teardown; the verdicts stay
    assert set(callback.verdicts) == {"teacher:trunk", "probe:probe"}
    for verdict in callback.verdicts.values():
        for clause, seen in verdict["clauses"].items():
            assert seen["checked"] > 0 and seen["violated"] == 0, clause


@pytest.mark.slow
def test_a_broken_contract_stops_the_fit_with_its_clause(tmp_path: Path, one_thread: None) -> None:
    callback = IsolationCallback(contracts=[TEACHER], verify_every_n_steps=1, ledger=False)
    with pytest.raises(
        ContractError,
        match=r"contract 'teacher:trunk' \(teacher\) breaks its clause 'no loss reaches it': "
        r"loss 'main' reaches \['trunk.0.weight'",
    ):
        fit(tmp_path, callback)
    assert callback.handle is None  # undone on the exception
