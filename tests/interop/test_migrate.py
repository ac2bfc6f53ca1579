"""Migrating to IsolationCallback: the scenarios of Lightning's own BackboneFinetuning tests
(tests/tests_pytorch/callbacks/test_finetuning_callback.py) with a config of comparable
length and isolation checked at every step; a finetuning-scheduler schedule file converted
and run; and leaving isolate (weights into a plain model, resume without the callback).
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader

from isolate import IsolationSpec, Thaw
from isolate.cli import main
from isolate.errors import SpecError
from isolate.interop.leave import plain_checkpoint
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


class Steps(pl.Callback):
    """Each optimizer step: (epoch, the lr each param group stepped with, which groups)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, list[float]]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Registered before any thaw, so it runs before the spec's own post-hook: it sees
        # the lr the step used (ramped), not the one put back.
        opt = trainer.optimizers[0]
        opt.register_step_post_hook(
            lambda o, *_: self.rows.append(
                (trainer.current_epoch, [g["lr"] for g in o.param_groups])
            )
        )


def fit(
    root: Path, model: pl.LightningModule, callbacks: list[pl.Callback], **kw: Any
) -> pl.Trainer:
    options: dict[str, Any] = {"limit_val_batches": 0, "max_epochs": 2}
    options.update(kw)
    run = trainer(root, callbacks, **options)
    run.fit(model)
    return run


# --------------------------------------------------------------------------------------------
# Lightning's test_finetuning_callback: BackboneFinetuning(unfreeze_backbone_at_epoch=3) with
# its defaults (train_bn=True, backbone_initial_ratio_lr=0.1, x1.5 per epoch, should_align).


class Backbone(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.backbone = nn.Sequential(nn.Linear(32, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU())
        self.layer = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.backbone(x))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(RandomDataset(32, 64), batch_size=2)


BACKBONE_FINETUNING = """
freeze: [backbone, "!type:_BatchNorm"]          # train_bn=True
thaw:
  - {select: backbone, epoch: 3, warmup_ratio: 0.1, warmup_epochs: 6,
     warmup_shape: exponential, align: true}     # ratio 0.1, x1.47 per epoch, should_align
"""


def test_backbone_finetuning_scenario(tmp_path: Path) -> None:
    model = Backbone()
    initial = model.backbone[0].weight.detach().clone()
    callback = IsolationCallback(**yaml.safe_load(BACKBONE_FINETUNING), verify_every_n_steps=1)
    steps = Steps()
    run = fit(tmp_path, model, [callback, steps], max_epochs=10, limit_train_batches=2)
    assert run.current_epoch == 10
    by_epoch = {e: lrs for e, lrs in steps.rows}  # the last step of each epoch
    assert all(len(by_epoch[e]) == 1 for e in range(3))  # frozen: not in the optimizer
    for epoch in range(3, 10):
        head, backbone = by_epoch[epoch]
        factor = 0.1 ** (1 - min(epoch - 3, 6) / 6)
        assert backbone == pytest.approx(factor * head)  # the Lightning test: <= head, then ==
        assert (backbone < head) if epoch < 9 else (backbone == pytest.approx(head))
    assert by_epoch[9][0] == pytest.approx(0.1 * 0.7**9)  # the head's StepLR ran throughout
    # The frozen epochs left the backbone bitwise as initialised (the callback also checked
    # drift at every step), and it learns once thawed; the norms trained all along.
    assert not torch.equal(model.backbone[0].weight, initial)
    assert model.backbone[1].weight.requires_grad


def test_backbone_stays_put_while_frozen(tmp_path: Path) -> None:
    model = Backbone()
    initial = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    callback = IsolationCallback(**yaml.safe_load(BACKBONE_FINETUNING), verify_every_n_steps=1)
    fit(tmp_path, model, [callback], max_epochs=3, limit_train_batches=2)
    assert torch.equal(model.backbone[0].weight, initial["0.weight"])
    assert not torch.equal(model.backbone[1].running_mean, initial["1.running_mean"])  # train_bn


# --------------------------------------------------------------------------------------------
# test_finetuning_callback_warning: thawing parameters that already train. Lightning warns
# ("Did you init your optimizer in ...") and goes on; a spec refuses before training and says
# what to do.


def test_thaw_of_trainable_parameters_is_refused_before_training(tmp_path: Path) -> None:
    class Whole(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Linear(32, 2, bias=False)

    model = Whole()
    before = {n: (p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}
    callback = IsolationCallback(freeze=["layer"], thaw=[Thaw(["layer", "backbone"], epoch=0)])
    with pytest.raises(
        SpecError, match=r"'backbone' selects 1 parameters that freeze does not"
    ) as e:
        fit(tmp_path, model, [callback], limit_train_batches=1)
    assert "trainable already" in str(e.value) and "add them to freeze" in str(e.value)
    after = {n: (p.requires_grad, p.detach()) for n, p in model.named_parameters()}
    assert all(before[n][0] == a[0] and torch.equal(before[n][1], a[1]) for n, a in after.items())


# --------------------------------------------------------------------------------------------
# test_unfreeze_and_add_param_group_function, with the engine: new groups by identity, lrs.


def test_unfreeze_and_add_param_group_scenario() -> None:
    backbone = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(5)], nn.BatchNorm1d(32))
    model = nn.Sequential(OrderedDict(backbone=backbone))
    optimizer = torch.optim.SGD(backbone[0].parameters(), lr=0.01)
    spec = IsolationSpec(
        freeze=["backbone", "!backbone.0", "!type:_BatchNorm"],
        thaw=[
            Thaw("backbone.1", epoch=1, lr=0.001),  # Lightning's lr=None: group 0's / 10
            Thaw(["backbone", "!backbone.1"], epoch=2, lr=100, bn="eval"),  # train_bn=False
        ],
    )
    with spec.applied(model, optimizer) as handle:
        handle.step(epoch=1, step=0)
        handle.step(epoch=2, step=0)
        groups = optimizer.param_groups
        assert [g["lr"] for g in groups] == [0.01, 0.001, 100]
        assert [[id(p) for p in g["params"]] for g in groups] == [
            [id(backbone[0].weight)],
            [id(backbone[1].weight)],
            [id(backbone[i].weight) for i in (2, 3, 4)],  # the frozen part only
        ]
        assert all(p.requires_grad for p in model.parameters())


# --------------------------------------------------------------------------------------------
# test_base_finetuning_internal_optimizer_metadata: one layer per epoch, saved by name; the
# resume that fails for Lightning ("index 6 is out of range") continues here.


class Layers(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        biases = (False, True, False, True, False, True)
        self.layer = nn.Sequential(
            *[nn.Linear(32, 2 if i == 5 else 32, bias=b) for i, b in enumerate(biases)]
        )

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer[0].parameters(), lr=0.1)


def layer_spec() -> IsolationCallback:
    return IsolationCallback(
        freeze=["layer", "!layer.0"],
        thaw=[Thaw(f"layer.{i}", epoch=i - 1, lr=0.01) for i in range(1, 6)],
        verify_every_n_steps=1,
    )


def test_internal_optimizer_metadata_scenario_and_resume(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    callback = layer_spec()
    fit(
        tmp_path,
        Layers(),
        [callback, checkpoint],
        max_epochs=5,
        limit_train_batches=1,
        enable_checkpointing=True,
    )
    layout = [["layer.0.weight"], ["layer.1.weight", "layer.1.bias"], ["layer.2.weight"]]
    layout += [
        ["layer.3.weight", "layer.3.bias"],
        ["layer.4.weight"],
        ["layer.5.weight", "layer.5.bias"],
    ]
    assert callback.state_dict()["layout"] == [layout]  # Lightning's metadata, by name
    resumed, model = layer_spec(), Layers()
    run = trainer(tmp_path, [resumed], max_epochs=10, limit_train_batches=1, limit_val_batches=0)
    run.fit(model, ckpt_path=checkpoint.last_model_path)
    groups = run.optimizers[0].param_groups
    assert [[id(p) for p in g["params"]] for g in groups] == [
        [id(p) for p in m.parameters()] for m in model.layer
    ]
    assert resumed.state_dict()["thawed"] == [
        {"name": f"layer.{i}", "epoch": i - 1, "global_step": i - 1} for i in range(1, 6)
    ]


# --------------------------------------------------------------------------------------------
# test_callbacks_restore: layer[:3] frozen, layer[epoch - 1] thawed from epoch 1; the groups
# saved, and a resume to a third epoch.


class Four(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(
            nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 2)
        )

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def restore_spec() -> IsolationCallback:
    return IsolationCallback(
        freeze=["layer.0", "layer.1", "layer.2"],
        thaw=[Thaw("layer.0", epoch=1, lr=0.01), Thaw("layer.1", epoch=2, lr=0.01)],
        verify_every_n_steps=1,
    )


def test_callbacks_restore_scenario(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    kw = {"limit_train_batches": 1, "limit_val_batches": 1, "enable_checkpointing": True}
    run = fit(tmp_path, Four(), [restore_spec(), checkpoint], **kw)
    saved = torch.load(checkpoint.last_model_path, weights_only=True)
    assert saved["callbacks"]["IsolationCallback"]["layout"] == [
        [["layer.3.weight", "layer.3.bias"], ["layer.0.weight", "layer.0.bias"]]
    ]
    assert [g["lr"] for g in saved["optimizer_states"][0]["param_groups"]] == [0.1, 0.01]
    assert run.optimizers[0].param_groups[1]["momentum"] == 0  # SGD's defaults, and lr=
    resumed = restore_spec()
    run = trainer(tmp_path, [resumed], max_epochs=3, **kw)
    run.fit(Four(), ckpt_path=checkpoint.last_model_path)
    assert [len(g["params"]) for g in run.optimizers[0].param_groups] == [2, 2, 2]
    assert resumed.state_dict()["frozen"] == ["layer.2.weight", "layer.2.bias"]


# --------------------------------------------------------------------------------------------
# Leaving isolate: the weights load into a plain model; the optimizer state resumes without
# the callback once rewritten to the plain layout.


class Plain(Four):
    """The same LightningModule run without isolate: every parameter trains from the start."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Isolated(Plain):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(
            [p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9
        )


def test_leaving_isolate_weights_and_resume_without_the_callback(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    callback = IsolationCallback(
        freeze=["layer.0", "layer.1"],
        clone=["layer.3"],  # a wrapper: state_dict keys stay as they were
        thaw=[Thaw("layer.0", epoch=1, lr=0.01)],
    )
    kw = {"limit_train_batches": 2, "limit_val_batches": 0, "enable_checkpointing": True}
    fit(tmp_path, Isolated(), [callback, checkpoint], **kw)
    saved = torch.load(checkpoint.last_model_path, weights_only=True)

    # 1. Weights only: into a plain model, strictly.
    plain = Plain()
    plain.load_state_dict(saved["state_dict"])
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in saved["state_dict"].items())

    # 2. Resume without the callback: torch refuses the isolate layout as it is ...
    with pytest.raises(ValueError, match="different number of parameter groups"):
        trainer(tmp_path / "as-is", [], max_epochs=3, **kw).fit(
            Plain(), ckpt_path=checkpoint.last_model_path
        )

    # ... and takes the rewritten one: every momentum buffer lands on its parameter by name.
    model = Plain()
    rewritten = plain_checkpoint(saved, model, model.configure_optimizers())
    assert "IsolationCallback" not in rewritten["callbacks"]
    path = tmp_path / "plain.ckpt"
    torch.save(rewritten, path)
    names = {id(p): n for n, p in model.named_parameters()}
    saved_state = saved["optimizer_states"][0]
    layout = saved["callbacks"]["IsolationCallback"]["layout"][0]
    by_name = {
        name: saved_state["state"][i]["momentum_buffer"]
        for group, names_ in zip(saved_state["param_groups"], layout, strict=True)
        for i, name in zip(group["params"], names_, strict=True)
        if i in saved_state["state"]
    }
    seen: dict[str, torch.Tensor] = {}

    class Look(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            opt = trainer.optimizers[0]
            for p, s in opt.state.items():
                seen[names[id(p)]] = s["momentum_buffer"].clone()

    run = trainer(tmp_path / "plain", [Look()], max_epochs=3, **kw)
    run.fit(model, ckpt_path=path)
    assert run.current_epoch == 3
    assert [len(g["params"]) for g in run.optimizers[0].param_groups] == [8]
    assert (
        set(seen)
        == set(by_name)
        == {n for n, _ in model.named_parameters() if n != "layer.1.weight" and n != "layer.1.bias"}
    )
    assert all(torch.equal(seen[n], by_name[n]) for n in by_name)


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
    from tests.lightning._models import Net, loader
    from pytorch_lightning.cli import LightningCLI

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
