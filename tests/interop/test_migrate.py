"""From finetuning-scheduler to isolate: FTS's regexes become globs or names, a schedule file
converted (by the function and by ``isolate migrate``) runs as its phases, and LightningCLI
parses the selectors and thaw fields a converted schedule uses.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import EarlyStopping
from torch import nn
from torch.utils.data import DataLoader

from isolate import IsolationSpec, Thaw
from isolate.cli import main
from isolate.errors import SpecError
from isolate.interop.migrate import from_finetuning_scheduler, regex_to_glob
from isolate.lightning import IsolationCallback
from tests.lightning._models import trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:.*Found .* module.* in eval mode"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed"),
]


# --------------------------------------------------------------------------------------------
# finetuning-scheduler: a schedule file in FTS's format, converted and run.

FTS_SCHEDULE = r"""
0:
  params:
  - model.classifier.bias
  - model.classifier.weight
  max_transition_epoch: 2
1:
  params:
  - model.pooler.dense.bias
  - model.pooler.dense.weight
  - model.encoder.layer.1.(output|attention).*
  lr: 1.0e-03
2:
  params:
  - model\.encoder\.layer\.0\..*
  - model.embeddings.word_embeddings.weight
  lr: 1.0e-04
"""


class Encoder(pl.LightningModule):
    """A tiny BERT-shaped model whose validation loss follows a script, by epoch."""

    def __init__(self, script: list[float]) -> None:
        super().__init__()
        torch.manual_seed(0)
        model = nn.Module()
        model.embeddings = nn.Module()
        model.embeddings.word_embeddings = nn.Embedding(10, 8)
        model.encoder = nn.Module()
        model.encoder.layer = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.attention, layer.output = nn.Linear(8, 8), nn.Linear(8, 8)
            model.encoder.layer.append(layer)
        model.pooler = nn.Module()
        model.pooler.dense = nn.Linear(8, 8)
        model.classifier = nn.Linear(8, 2)
        self.model, self.script = model, script

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.embeddings.word_embeddings(x).mean(1)
        for layer in m.encoder.layer:
            h = layer.output(torch.relu(layer.attention(h)))
        return m.classifier(torch.tanh(m.pooler.dense(h)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.script[self.current_epoch])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            torch.utils.data.TensorDataset(torch.randint(0, 10, (4, 3))), batch_size=2
        )

    val_dataloader = train_dataloader


class Phase(pl.Callback):
    def __init__(self) -> None:
        self.groups: list[int] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.groups.append(len(trainer.optimizers[0].param_groups))


def test_fts_regexes_become_globs_or_names() -> None:
    assert regex_to_glob(r"model\.encoder\.layer\.0\..*") == "model.encoder.layer.0.*"
    assert regex_to_glob("model.encoder.layer.1.(output|attention).*") is None
    fts = yaml.safe_load(FTS_SCHEDULE)
    with pytest.raises(
        SpecError, match=r"phase 1: the regex .* has no glob equivalent; pass model="
    ):
        from_finetuning_scheduler(fts)
    spec = from_finetuning_scheduler(fts, model=Encoder([]))
    assert spec["freeze"] == ["*", "!model.classifier.bias", "!model.classifier.weight"]
    assert spec["thaw"][0]["select"] == [
        "model.pooler.dense.bias",
        "model.pooler.dense.weight",
        "model.encoder.layer.1.attention.weight",
        "model.encoder.layer.1.attention.bias",
        "model.encoder.layer.1.output.weight",
        "model.encoder.layer.1.output.bias",
    ]
    assert spec["thaw"][1]["select"] == [
        "model.encoder.layer.0.attention.weight",
        "model.encoder.layer.0.attention.bias",
        "model.encoder.layer.0.output.weight",
        "model.encoder.layer.0.output.bias",
        "model.embeddings.word_embeddings.weight",
    ]
    for bad, message in [
        (
            {0: {"params": ["a"]}, 1: {"params": ["b"], "new_lr_scheduler": {}}},
            "rebuild the optimizer",
        ),
        ({0: {"params": ["a"]}, 2: {"params": ["b"]}}, "without gaps"),
        ({0: {"params": ["a"], "paramz": 1}}, "unknown keys"),
    ]:
        with pytest.raises(SpecError, match=message):
            from_finetuning_scheduler(bad)


@pytest.mark.parametrize("epoch_only", [False, True], ids=["plateau", "epoch-transitions-only"])
def test_fts_schedule_runs_as_its_phases(tmp_path: Path, epoch_only: bool) -> None:
    model = Encoder(script=[1.0, 0.9, 0.95, 0.8, 0.8, 0.8, 0.8, 0.8])
    fts = yaml.safe_load(FTS_SCHEDULE)
    if epoch_only:
        fts[1]["max_transition_epoch"] = 5  # FTS wants one for every phase but the last then
    spec = from_finetuning_scheduler(
        fts, model=model, epoch_transitions_only=epoch_only, patience=2
    )
    callback = IsolationCallback(**spec, verify_every_n_steps=1)
    # Lightning's EarlyStopping on the same metric does not end the run (patience 10).
    phase = Phase()
    stopping = EarlyStopping("val_loss", patience=10)
    run = trainer(tmp_path, [callback, phase, stopping], max_epochs=8, limit_train_batches=1)
    run.fit(model)
    # plateau: phase 1 at epoch 2 (phase 0's max_transition_epoch; the plateau would have come
    # later), phase 2 after two checks without improvement on 0.8 (epochs 4, 5 -> epoch 6);
    # epochs only: at 2 and 5.
    assert phase.groups == (
        [1, 1, 2, 2, 2, 2, 3, 3] if not epoch_only else [1, 1, 2, 2, 2, 3, 3, 3]
    )
    lrs = [g["lr"] for g in run.optimizers[0].param_groups]
    assert lrs == [1e-2, 1e-3, 1e-4]
    assert run.current_epoch == 8  # not stopped early


def test_fts_converter_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "Module_ft_schedule.yaml"
    path.write_text(
        "0:\n  params:\n  - model.classifier.bias\n  - model.classifier.weight\n"
        "1:\n  params:\n  - model\\.pooler\\..*\n  lr: 1.0e-05\n  max_transition_epoch: 4\n"
    )
    assert main(["migrate", str(path), "--patience", "5"]) == 0
    spec = IsolationSpec.from_dict(yaml.safe_load(capsys.readouterr().out))
    assert spec.freeze == ("*", "!model.classifier.bias", "!model.classifier.weight")
    assert spec.thaw == (
        Thaw(["model.pooler.*"], name="phase_1", lr=1e-5, monitor="val_loss", patience=5),
    )
    assert math.isclose(spec.thaw[0].lr or 0, 1e-5)


def test_lightning_cli_parses_the_new_selectors_and_thaw_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytorch_lightning.cli import LightningCLI

    from tests.lightning._models import Net, loader

    monkeypatch.setattr(sys, "argv", ["train.py"])
    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
        trainer:
          default_root_dir: {tmp_path}
          accelerator: cpu
          max_epochs: 4
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          enable_model_summary: false
          callbacks:
            - class_path: isolate.lightning.IsolationCallback
              init_args:
                freeze: [trunk, "!trunk/type:_BatchNorm"]
                thaw:
                  - {{select: trunk.0, epoch: 1, warmup_ratio: 0.5, warmup_steps: 2, align: true}}
                  - {{select: [trunk, "!trunk.0"], monitor: val_loss, patience: 1, min_delta: 0.5,
                     lr: 0.01}}
        """
    )
    cli = LightningCLI(Net, run=False, args=["--config", str(config)], save_config_callback=None)
    callback = next(c for c in cli.trainer.callbacks if isinstance(c, IsolationCallback))
    assert callback.spec.freeze == ("trunk", "!trunk/type:_BatchNorm")
    assert callback.spec.thaw == (
        Thaw("trunk.0", epoch=1, warmup_ratio=0.5, warmup_steps=2, align=True),
        Thaw(["trunk", "!trunk.0"], monitor="val_loss", patience=1, min_delta=0.5, lr=0.01),
    )
    cli.trainer.fit(cli.model, loader(), loader())
    # The second phase watches from the first check after trunk.0 thawed (end of epoch 1); the
    # loss does not drop by 0.5 at the next check (end of epoch 2), so it thaws at epoch 3.
    assert callback.state_dict()["thawed"] == [
        {"name": "trunk.0", "epoch": 1, "global_step": 4},
        {"name": "trunk+!trunk.0", "epoch": 3, "global_step": 12},
    ]
