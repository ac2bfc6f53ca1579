"""From finetuning-scheduler to isolate: FTS's regexes become globs or names, a schedule file
converted (by the function and by ``isolate migrate``) runs as its phases, and LightningCLI
parses the selectors and thaw fields a converted schedule uses.
"""

from __future__ import annotations

import math
import subprocess
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
from tests._launch import REPO, child_env
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


# --------------------------------------------------------------------------------------------
# The converter's output to the key, its refusals to the letter, and the migrate verb.

# Phase 1's latest epoch (0) is over when it starts: phase 2 starts the epoch after.
LATEST = {
    0: {"params": ["a.weight"], "max_transition_epoch": 1},
    1: {"params": ["b.weight"], "max_transition_epoch": 0},
    2: {"params": ["c.weight"], "lr": 0.5},
}


def test_the_converted_spec_has_every_option_it_was_given_and_no_default() -> None:
    first = {"select": ["b.weight"], "name": "phase_1", "lr": 1e-5}
    second = {"select": ["c.weight"], "name": "phase_2", "lr": 0.5}
    plateau = {"monitor": "val_loss", "patience": 3}
    assert from_finetuning_scheduler(LATEST) == {
        "freeze": ["*", "!a.weight"],
        "bn": "train",
        "thaw": [
            {**first, **plateau, "epoch": 1},
            {**second, **plateau, "carry_best": True, "epoch": 0, "after_previous": 1},
        ],
    }
    given = from_finetuning_scheduler(
        LATEST, base_max_lr=0.002, monitor="val_acc", patience=1, min_delta=0.1, mode="max"
    )
    plateau = {"monitor": "val_acc", "patience": 1, "min_delta": 0.1, "mode": "max"}
    assert given["thaw"] == [
        {**first, "lr": 0.002, **plateau, "epoch": 1},
        {**second, **plateau, "carry_best": True, "epoch": 0, "after_previous": 1},
    ]
    epochs = from_finetuning_scheduler(LATEST, epoch_transitions_only=True, bn="eval")
    assert epochs == {
        "freeze": ["*", "!a.weight"],
        "bn": "eval",
        "thaw": [{**first, "epoch": 1}, {**second, "epoch": 0, "after_previous": 1}],
    }
    spec = IsolationSpec.from_dict(epochs)
    assert [(t.epoch, t.after_previous) for t in spec.thaw] == [(1, 0), (0, 1)]


@pytest.mark.parametrize(
    ("schedule", "options", "message"),
    [
        (["a"], {}, "expected a mapping of phase number -> phase, got ['a']"),
        ({}, {}, "expected a mapping of phase number -> phase, got {}"),
        ({"a": {}}, {}, "phase keys must be integers 0..N, got ['a']"),
        ({0: {"params": ["a"]}, 1: "x"}, {}, "phase 1 must be a mapping, got 'x'"),
        (
            {0: {"params": ["a"]}, 1: {"params": ["b"], "new_optimizer": {}}},
            {},
            "phase 1 uses ['new_optimizer'], which rebuild the optimizer or the LR scheduler "
            "mid-run",
        ),
        ({0: {"params": "a.weight"}}, {}, "phase 0: params must be a non-empty list"),
        ({0: {"params": []}}, {}, "phase 0: params must be a non-empty list"),
        ({0: {"params": [1]}}, {}, "phase 0: params must be a non-empty list"),
        (
            {0: {"params": ["weight"]}, 1: {"params": ["nothing"]}},
            {"model": nn.Linear(1, 1)},
            "phase 1: 'nothing' matches no parameter name of the model (as "
            "finetuning-scheduler would refuse it)",
        ),
        (
            {0: {"params": ["a"]}, 1: {"params": ["b"]}},
            {"epoch_transitions_only": True},
            "epoch_transitions_only, but phase 0 has no max_transition_epoch, so phase 1 "
            "would never start; set one",
        ),
    ],
    ids=[
        "list",
        "empty",
        "keys",
        "phase",
        "refused-key",
        "params-string",
        "params-empty",
        "params-not-strings",
        "no-match",
        "no-latest-epoch",
    ],
)
def test_a_schedule_the_converter_cannot_take_is_refused_naming_the_phase(
    schedule: Any, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError) as refused:
        from_finetuning_scheduler(schedule, **options)
    assert str(refused.value).startswith(f"from_finetuning_scheduler(): {message}")


def migrate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``isolate migrate argv``: its status, what it printed and what it said on stderr."""
    try:
        status = main(["migrate", *argv])
    except SystemExit as stop:  # argparse's own errors and --help
        status = stop.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    return status, captured.out, captured.err


SCHEDULE_FILE = (
    "0:\n  params: [model.classifier.weight, model.classifier.bias]\n  max_transition_epoch: 2\n"
    '1:\n  params: ["model\\\\.pooler\\\\..*"]\n  max_transition_epoch: 3\n'
    "2:\n  params: [model.encoder]\n  lr: 0.5\n"
)


def test_the_migrate_command_passes_every_option_and_writes_the_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("s.yaml").write_text(SCHEDULE_FILE)
    head = (
        "# isolate spec converted from s.yaml\n"
        'freeze: ["*", "!model.classifier.weight", "!model.classifier.bias"]\n'
        "bn: train\nthaw:\n"
    )
    assert migrate(capsys, "s.yaml") == (
        0,
        head + "  - {select: [model.pooler.*], name: phase_1, lr: 1.0e-05, monitor: val_loss, "
        "patience: 3, epoch: 2}\n"
        "  - {select: [model.encoder], name: phase_2, lr: 0.5, monitor: val_loss, patience: 3, "
        "carry_best: true, epoch: 3, after_previous: 1}\n",
        "",
    )
    options = ["--base-max-lr", "0.002", "--monitor", "val_acc", "--patience", "5"]
    assert migrate(capsys, "s.yaml", *options) == (
        0,
        head + "  - {select: [model.pooler.*], name: phase_1, lr: 0.002, monitor: val_acc, "
        "patience: 5, epoch: 2}\n"
        "  - {select: [model.encoder], name: phase_2, lr: 0.5, monitor: val_acc, patience: 5, "
        "carry_best: true, epoch: 3, after_previous: 1}\n",
        "",
    )
    assert migrate(capsys, "s.yaml", "--epoch-transitions-only", "--base-max-lr", "0.002") == (
        0,
        head + "  - {select: [model.pooler.*], name: phase_1, lr: 0.002, epoch: 2}\n"
        "  - {select: [model.encoder], name: phase_2, lr: 0.5, epoch: 3, after_previous: 1}\n",
        "",
    )
    assert migrate(capsys, "s.yaml", "--base-max-lr", "abc") == (
        2,
        "",
        "isolate migrate: error: argument --base-max-lr: invalid float value: 'abc' "
        "(see 'isolate migrate --help')\n",
    )


def test_a_schedule_file_that_is_not_yaml_says_where_and_what(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    fix = "; fix the file (a finetuning-scheduler schedule maps phase numbers to params)\n"
    Path("broken.yaml").write_text("0: {params: [a\n1: x\n")  # the list is not closed
    assert migrate(capsys, "broken.yaml") == (
        2,
        "",
        "isolate migrate: error: broken.yaml is not valid YAML at line 2: expected ',' or ']', "
        "but got ':'" + fix,
    )
    Path("bell.yaml").write_text("0: \x07\n")  # the reader's error has no problem and no mark
    assert migrate(capsys, "bell.yaml") == (
        2,
        "",
        "isolate migrate: error: bell.yaml is not valid YAML: unacceptable character #x0007: "
        'special characters are not allowed in "bell.yaml", position 3' + fix,
    )


def test_the_migrate_help_names_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = migrate(capsys, "--help")
    assert status == 0
    out = " ".join(out.split())
    assert out.startswith(
        "usage: isolate migrate [-h] [--model module:callable] [--epoch-transitions-only] "
        "[--base-max-lr BASE_MAX_LR] [--monitor MONITOR] [--patience PATIENCE] schedule "
    )
    for line in (
        "schedule the finetuning-scheduler schedule file (e.g. Model_ft_schedule.yaml)",
        "--model module:callable build the model (called without arguments) and resolve the "
        "schedule's regexes against its parameter names, exactly as finetuning-scheduler does",
        "--epoch-transitions-only phases move only at max_transition_epoch, as FTS's "
        "epoch_transitions_only",
        "--base-max-lr BASE_MAX_LR lr of phases that give none (FTS's base_max_lr; default 1e-5)",
        "--monitor MONITOR metric that ends a phase (default val_loss)",
        "--patience PATIENCE checks without improvement (default 3)",
    ):
        assert line in out


def test_the_schedule_file_is_read_as_utf8_whatever_the_locale(tmp_path: Path) -> None:
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        "# Modèle BERT\n0:\n  params: [a.weight]\n1:\n  params: [b]\n", encoding="utf-8"
    )
    # An ASCII locale without Python's UTF-8 mode: open() without an encoding reads ASCII.
    ascii_locale = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "isolate", "migrate", str(schedule)],
        cwd=REPO,  # under mutmut, its trampolines in the child read its configuration there
        env=child_env(ascii_locale),
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    spec = IsolationSpec.from_dict(yaml.safe_load(done.stdout))
    assert spec.freeze == ("*", "!a.weight")
    assert [t.selectors for t in spec.thaw] == [("b",)]
