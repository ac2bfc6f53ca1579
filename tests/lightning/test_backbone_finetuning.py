"""Migrating from BackboneFinetuning: the scenarios of Lightning's own finetuning-callback tests
(tests/tests_pytorch/callbacks/test_finetuning_callback.py in Lightning's repository), each
with an IsolationCallback config of comparable length and isolation checked at every step.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader

from isolate import IsolationSpec, Thaw
from isolate.errors import SpecError
from isolate.lightning import IsolationCallback
from tests.lightning._models import Four, fit, trainer

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
