"""Leaving isolate: the weights of a run under IsolationCallback load into a plain model, and
the optimizer state resumes without the callback once ``plain_checkpoint`` has rewritten it to
the plain layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from isolate import Thaw
from isolate.errors import CheckpointMismatchError
from isolate.interop.leave import CALLBACK_KEY, plain_checkpoint, plain_optimizer_state
from isolate.lightning import IsolationCallback
from tests.lightning._models import Four, fit, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:.*Found .* module.* in eval mode"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed"),
]


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


def _thawed_sgd() -> tuple[nn.Sequential, torch.optim.Optimizer, list[list[str]]]:
    """A model whose first layer was thawed into a second group, and that group layout."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = torch.optim.SGD([net[1].weight, net[1].bias], lr=0.1)
    opt.add_param_group({"params": [net[0].weight, net[0].bias], "lr": 0.01})
    return net, opt, [["1.weight", "1.bias"], ["0.weight", "0.bias"]]


def test_nested_scheduler_states_are_rewritten_per_group() -> None:
    net, opt, layout = _thawed_sgd()
    inner = {"base_lrs": [0.1, 0.01], "last_epoch": 3}  # as SequentialLR keeps its children
    sched = {"base_lrs": [0.1, 0.01], "_schedulers": [inner], "milestones": [5]}
    checkpoint = {
        "callbacks": {CALLBACK_KEY: {"layout": [layout]}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched],
    }
    plain = torch.optim.SGD(net.parameters(), lr=0.5)
    out = plain_checkpoint(checkpoint, net, plain)
    assert out["lr_schedulers"] == [
        {
            "base_lrs": [0.1],
            "_schedulers": [{"base_lrs": [0.1], "last_epoch": 3}],
            "milestones": [5],
        }
    ]


def test_a_plain_group_takes_its_settings_from_a_group_no_thaw_added() -> None:
    net = nn.Sequential(nn.Linear(2, 1, bias=False), nn.Linear(1, 1))
    opt = torch.optim.SGD([net[0].weight], lr=0.1)
    opt.add_param_group({"params": [net[1].weight, net[1].bias], "lr": 0.01})  # the thaw
    layout = [["0.weight"], ["1.weight", "1.bias"]]
    state = {
        "layout": [layout],
        "spec": {"thaw": [{"name": "head", "params": ["1.weight", "1.bias"]}]},
        "thawed": [{"name": "head", "epoch": 1}],
    }
    checkpoint = {"callbacks": {CALLBACK_KEY: state}, "optimizer_states": [opt.state_dict()]}
    plain = torch.optim.SGD(net.parameters(), lr=0.5)
    out = plain_checkpoint(checkpoint, net, plain)
    # Most of the plain group's parameters were thawed; its settings are still the base's.
    assert [g["lr"] for g in out["optimizer_states"][0]["param_groups"]] == [0.1]


def test_a_layout_that_does_not_fit_the_saved_groups_is_refused() -> None:
    net, opt, layout = _thawed_sgd()
    plain = torch.optim.SGD(net.parameters(), lr=0.5)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"^plain_optimizer_state\(\): the saved optimizer has groups of sizes \[2, 2\], "
        r"the layout \[2\]; ",
    ):
        plain_optimizer_state(opt.state_dict(), layout[:1], plain, net)


def _three_layers() -> tuple[nn.Sequential, torch.optim.Optimizer, list[list[str]]]:
    """A run that trained layers 1 (lr 0.1) and 2 (lr 0.01, a group of its own from the
    start) and never layer 0."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    opt = torch.optim.SGD([net[1].weight, net[1].bias], lr=0.1)
    opt.add_param_group({"params": [net[2].weight, net[2].bias], "lr": 0.01})
    return net, opt, [["1.weight", "1.bias"], ["2.weight", "2.bias"]]


def test_each_plain_group_takes_the_settings_of_its_own_saved_group_or_keeps_its_own() -> None:
    net, opt, layout = _three_layers()
    plain = torch.optim.SGD(
        [
            {"params": [net[1].weight, net[1].bias]},
            {"params": [net[2].weight, net[2].bias]},
            {"params": [net[0].weight, net[0].bias], "lr": 0.3},  # nothing saved trained it
        ],
        lr=0.5,
    )
    state, origins = plain_optimizer_state(opt.state_dict(), layout, plain, net)
    assert origins == [0, 1, -1]
    assert [g["lr"] for g in state["param_groups"]] == [0.1, 0.01, 0.3]
    # Numbered as torch numbers the plain optimizer's own state: in order, from 0.
    assert [g["params"] for g in state["param_groups"]] == [
        g["params"] for g in plain.state_dict()["param_groups"]
    ]
    early = {"wait_count": 2, "best_score": 0.5}  # another callback's state: kept as it is
    checkpoint = {
        "callbacks": {CALLBACK_KEY: {"layout": [layout]}, "EarlyStopping": early},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [
            {"base_lrs": [0.1, 0.01], "_last_lr": [0.05, 0.005], "gamma": [2, 3], "last_epoch": 2}
        ],
    }
    out = plain_checkpoint(checkpoint, net, plain)
    assert out["callbacks"] == {"EarlyStopping": early}
    # A group no saved group held keeps its own learning rates (a scheduler built over it holds
    # them); a list with nothing of its own takes the first group's entry.
    assert out["lr_schedulers"] == [
        {"base_lrs": [0.1, 0.01, 0.3], "_last_lr": [0.05, 0.005, 0.3], "gamma": [2, 3, 2],
         "last_epoch": 2}
    ]  # fmt: skip


def test_a_resumed_scheduler_runs_a_group_nothing_saved_trained_at_its_own_lr() -> None:
    net, opt, layout = _three_layers()
    decay = 0.5

    def lam(epoch: int) -> float:
        return decay**epoch

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    for _ in range(3):
        opt.step()
        sched.step()
    checkpoint = {
        "callbacks": {CALLBACK_KEY: {"layout": [layout]}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
    }
    plain = torch.optim.SGD(
        [
            {"params": [net[1].weight, net[1].bias]},
            {"params": [net[2].weight, net[2].bias]},
            {"params": [net[0].weight, net[0].bias], "lr": 0.3},
        ],
        lr=0.5,
    )
    resumed = torch.optim.lr_scheduler.LambdaLR(plain, lam)  # as configure_optimizers builds
    out = plain_checkpoint(checkpoint, net, plain)
    plain.load_state_dict(out["optimizer_states"][0])
    resumed.load_state_dict(out["lr_schedulers"][0])
    plain.step()
    resumed.step()
    # Written out by hand: each saved group goes on from its own base lr; the new group
    # runs the same schedule from its own lr, not the first group's.
    expected = [0.1 * decay**4, 0.01 * decay**4, 0.3 * decay**4]
    assert [g["lr"] for g in plain.param_groups] == pytest.approx(expected)
    assert resumed.get_last_lr() == pytest.approx(expected)


def test_a_plain_group_takes_the_settings_of_the_group_most_of_its_parameters_were_in() -> None:
    net, opt, layout = _three_layers()
    plain = torch.optim.SGD([net[0].weight, net[1].weight, net[2].weight, net[2].bias], lr=0.5)
    state, origins = plain_optimizer_state(opt.state_dict(), layout, plain, net)
    assert origins == [1]  # one parameter of saved group 0, two of saved group 1
    assert state["param_groups"][0]["lr"] == 0.01


def test_groups_that_thaws_added_are_the_origin_when_nothing_else_is() -> None:
    net, opt, layout = _three_layers()
    plain = torch.optim.SGD(net[1:].parameters(), lr=0.5)
    state, origins = plain_optimizer_state(opt.state_dict(), layout, plain, net, thawed=layout)
    assert origins == [0]
    assert state["param_groups"][0]["lr"] == 0.1


def test_optimizers_and_scheduler_configurations_as_two_lists_are_read() -> None:
    net, opt, layout = _thawed_sgd()
    checkpoint = {
        "callbacks": {CALLBACK_KEY: {"layout": [layout]}},
        "optimizer_states": [opt.state_dict()],
    }
    plain = torch.optim.SGD(net.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(plain, step_size=1)
    out = plain_checkpoint(checkpoint, net, ([plain], [{"scheduler": sched, "interval": "step"}]))
    assert [g["lr"] for g in out["optimizer_states"][0]["param_groups"]] == [0.1]


def test_a_checkpoint_without_the_callback_state_or_the_optimizers_is_refused() -> None:
    net, opt, layout = _thawed_sgd()
    plain = torch.optim.SGD(net.parameters(), lr=0.5)
    refused = (
        r"^plain_checkpoint\(\): the checkpoint holds no IsolationCallback state with a "
        r"'layout'; it was written without the callback \(load it as it is\), or by an older "
        r"isolate \(load only the weights: model.load_state_dict\(checkpoint\['state_dict'\]\)\)$"
    )
    for callbacks in ({}, {CALLBACK_KEY: {"spec": {}}}):
        with pytest.raises(CheckpointMismatchError, match=refused):
            plain_checkpoint({"callbacks": callbacks, "optimizer_states": []}, net, plain)
    weights_only = {"callbacks": {CALLBACK_KEY: {"layout": [layout]}}}  # save_weights_only
    with pytest.raises(
        CheckpointMismatchError,
        match=r"^plain_checkpoint\(\): the checkpoint holds 0 optimizer states and 1 layouts, "
        r"but 1 optimizers were given$",
    ):
        plain_checkpoint(weights_only, net, plain)
    two_layouts = {
        "callbacks": {CALLBACK_KEY: {"layout": [layout, layout]}},
        "optimizer_states": [opt.state_dict()],
    }
    with pytest.raises(CheckpointMismatchError, match=r"holds 1 optimizer states and 2 layouts"):
        plain_checkpoint(two_layouts, net, plain)
