"""IsolationCallback with a real, tiny Trainer: freezing, BatchNorm policy, detaching, the thaw
schedule, the checks while training, checkpoints and resume, and the spec's validation.

The model (``tests.lightning._models.Net``) is trunk (Linear, BatchNorm, ReLU, Linear) -> head, and
trunk -> aux; 64 samples in batches of 16 make 4 optimizer steps per epoch.
"""

from __future__ import annotations

import csv
import logging
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning_utilities.core.rank_zero as rank_zero
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BackboneFinetuning, BaseFinetuning, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.strategies import SingleDeviceStrategy
from torch import nn

import isolate.lightning.callback as callback_module
from isolate import Detached, IsolationError, IsolationSpec, IsolationWarning, Thaw
from isolate.errors import (
    CheckpointMismatchError,
    DriftError,
    GradientLeakError,
    RankDivergenceError,
    SelectorError,
    SpecError,
)
from isolate.lightning import IsolationCallback
from isolate.spec import checks, ranks
from isolate.spec.handle import Tally
from tests.lightning._models import BackboneNet, Net, TwoOptimizerNet, loader, state, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
]

TRUNK = ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]  # in model.trunk


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """What an isolation could leave behind: module classes, parameter identities and flags,
    training modes, hooks."""
    return {
        "modules": {n: type(m) for n, m in model.named_modules()},
        "params": {n: (id(p), p.requires_grad) for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: len(m._forward_pre_hooks) for n, m in model.named_modules()},
    }


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


class Probe(pl.Callback):
    """At each train epoch start: whether the trunk requires grad and (group index, lr) of
    every occurrence of a trunk parameter in the optimizer; at each epoch end: the trunk."""

    def __init__(self) -> None:
        self.flags: list[bool] = []
        self.groups: list[list[tuple[int, float]]] = []
        self.ends: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trunk = list(pl_module.trunk.parameters())
        self.flags.append(all(p.requires_grad for p in trunk))
        groups = trainer.optimizers[0].param_groups
        self.groups.append(
            [
                (i, g["lr"])
                for p in trunk
                for i, g in enumerate(groups)
                for q in g["params"]
                if q is p
            ]
        )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ends.append(state(pl_module.trunk))


# --------------------------------------------------------------------------------------------
# Freezing and the BatchNorm policy


def test_freeze_keeps_trunk_and_bn_statistics_bitwise_and_restores(tmp_path: Path) -> None:
    model = Net()
    before, shape = state(model), fingerprint(model)
    callback = IsolationCallback(freeze=["trunk"], verify_every_n_steps=1)
    # Validation every epoch: Lightning's _ModuleMode.restore then sets `training` back by
    # assignment, and model.train() runs every epoch; neither may wake the frozen BatchNorm.
    trainer(tmp_path, [callback]).fit(model, loader(), loader(n=32))
    moved = changed(before, state(model))
    assert not {k for k in moved if k.startswith("trunk.")}
    assert {"head.weight", "head.bias", "aux.0.weight"} <= moved
    assert fingerprint(model) == shape  # flags, identities, modes, hooks: as before fit

    # The control: with bn="train" the same run moves the statistics (and only them).
    model = Net()
    callback = IsolationCallback(freeze=["trunk"], bn="train", verify_every_n_steps=1)
    trainer(tmp_path / "bn-train", [callback]).fit(model, loader(), loader(n=32))
    moved = {k for k in changed(before, state(model)) if k.startswith("trunk.")}
    assert moved == {"trunk.1.running_mean", "trunk.1.running_var", "trunk.1.num_batches_tracked"}


# --------------------------------------------------------------------------------------------
# Detaching and cloning


def test_detached_aux_loss_leaves_trunk_as_without_it(tmp_path: Path) -> None:
    def run(model: Net, callbacks: list[pl.Callback], sub: str) -> dict[str, torch.Tensor]:
        trainer(tmp_path / sub, callbacks).fit(model, loader())
        return state(model)

    class Wrapped(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen.append(
                isinstance(pl_module.aux, Detached)
                and pl_module.aux.module is inner
                and [id(p) for p in pl_module.parameters()] == ids
                and list(pl_module.state_dict()) == keys
            )

    model = Net()
    inner, ids, keys = model.aux, [id(p) for p in model.parameters()], list(model.state_dict())
    initial, shape, seen = state(model), fingerprint(model), []
    # verify_every_n_steps=1: by default the named aux loss must not reach anything upstream
    # of the detached branch (the trunk); that is checked at every step here.
    detached = run(
        model, [IsolationCallback(detach=["aux"], verify_every_n_steps=1), Wrapped()], "d"
    )
    assert seen == [True]  # wrapped in place: same parameters, same state_dict keys
    assert fingerprint(model) == shape and model.aux is inner  # unwrapped at teardown
    assert "aux.0.weight" in changed(initial, detached)  # the branch still learns

    without_aux = run(Net(aux=False), [], "without")
    attached = run(Net(), [], "attached")
    cloned = run(Net(), [IsolationCallback(clone=["aux"], verify_every_n_steps=1)], "cloned")
    trunk = [k for k in initial if k.startswith("trunk.")]
    assert all(torch.equal(detached[k], without_aux[k]) for k in trunk)
    assert not all(torch.equal(attached[k], without_aux[k]) for k in trunk)  # the control
    assert not changed(attached, cloned)  # Cloned lets gradient through and changes no value


def test_global_norm_clipping_couples_a_detached_branch_and_is_reported(tmp_path: Path) -> None:
    def run(aux: bool, sub: str, **clip: Any) -> dict[str, torch.Tensor]:
        model = Net(aux=aux)
        callbacks = [IsolationCallback(detach=["aux"], verify_every_n_steps=0)] if aux else []
        trainer(tmp_path / sub, callbacks, **clip).fit(model, loader())
        return state(model)

    by_norm = {"gradient_clip_val": 0.05}
    with pytest.warns(IsolationWarning, match=r"^IsolationCallback: gradient_clip_val=0\.05 clips"):
        clipped = run(True, "norm", **by_norm)
    reference = run(False, "norm-reference", **by_norm)
    trunk = [k for k in reference if k.startswith("trunk.")]
    assert not all(torch.equal(clipped[k], reference[k]) for k in trunk)  # the leak is real
    by_value = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", IsolationWarning)
        per_element = run(True, "value", **by_value)
    reference = run(False, "value-reference", **by_value)
    assert all(torch.equal(per_element[k], reference[k]) for k in trunk)


# --------------------------------------------------------------------------------------------
# The thaw schedule


@pytest.mark.parametrize("all_params", [False, True], ids=["trainable-only", "all-params"])
def test_thaw_by_epoch_learns_from_then_once_with_its_lr(tmp_path: Path, all_params: bool) -> None:
    # all-params: the optimizer holds the frozen trunk in a weight-decay group, and a cosine
    # schedule must learn of the new group.
    model = Net(all_params=all_params, weight_decay=1e-4, scheduler=all_params)
    initial = state(model.trunk)
    probe = Probe()
    callback = IsolationCallback(freeze=["trunk"], thaw=[Thaw("trunk", epoch=1, lr=0.05)])
    fit = trainer(tmp_path, [callback, probe], max_epochs=3)
    if all_params:
        with pytest.warns(IsolationWarning, match=r"took 6 frozen parameters out") as caught:
            fit.fit(model, loader())
        message = str(next(w.message for w in caught if w.category is IsolationWarning))
        assert "'trunk.0.weight'" in message and "weight_decay=0.0001" in message
    else:
        fit.fit(model, loader())
    assert probe.flags == [False, True, True]
    assert probe.groups[0] == []  # out of the optimizer while frozen
    # Under the cosine schedule (T_max=4, stepped per epoch) the group joins where the schedule
    # is for its base lr 0.05, as the head's group (base 0.1) is: 0.05 * (1 + cos(pi e / 4)) / 2.
    at = [(1 + math.cos(math.pi * e / 4)) / 2 if all_params else 1.0 for e in range(3)]
    assert probe.groups[1] == [(1, pytest.approx(0.05 * at[1]))] * 6  # each parameter once
    assert not changed(initial, probe.ends[0])
    assert set(TRUNK) <= changed(initial, probe.ends[1])  # every trunk tensor learns once thawed
    assert probe.groups[2] == [(1, pytest.approx(0.05 * at[2]))] * 6  # scheduled from then on
    if all_params:
        scheduler = fit.lr_scheduler_configs[0].scheduler
        assert scheduler.base_lrs == [0.1, 0.05]  # type: ignore[attr-defined]


@pytest.mark.upstream_trap
def test_base_finetuning_adds_by_value() -> None:
    """Documents Lightning's BaseFinetuning.filter_on_optimizer: it compares parameters by
    value, so a thawed bias equal to one already in the optimizer is left out (the callback
    adds by identity). If this fails, the trap is gone upstream: update the docs."""
    model = Net()
    with torch.no_grad():
        model.aux[0].bias.copy_(model.trunk[0].bias)
    held = torch.optim.SGD(model.aux.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="already exist within another group"):
        kept = BaseFinetuning.filter_on_optimizer(
            held, [model.trunk[0].weight, model.trunk[0].bias]
        )
    assert [p is model.trunk[0].weight for p in kept] == [True]


def test_thaw_by_step_adds_by_identity_not_by_value(tmp_path: Path) -> None:
    model = Net()
    with torch.no_grad():  # a trainable parameter equal in shape and value to a thawed one
        model.aux[0].bias.copy_(model.trunk[0].bias)

    counts: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            groups = trainer.optimizers[0].param_groups
            counts.append(sum(q is model.trunk[0].bias for g in groups for q in g["params"]))

    before = state(model.trunk)
    callback = IsolationCallback(freeze=["trunk.0"], thaw=[Thaw("trunk.0", step=2, lr=0.05)])
    trainer(tmp_path, [callback, Count()], max_steps=4).fit(model, loader())
    assert counts == [0, 0, 1, 1]
    assert {"0.weight"} <= changed(before, state(model.trunk))


@pytest.mark.filterwarnings("ignore:.*took 6 frozen parameters out")
def test_thaw_without_lr_returns_to_the_settings_of_its_group(tmp_path: Path) -> None:
    model = Net(all_params=True, lr=0.1, momentum=0.5, weight_decay=0.01)
    callback = IsolationCallback(freeze=["trunk"], thaw=[Thaw("trunk", step=2)])
    fit = trainer(tmp_path, [callback], max_steps=3)
    fit.fit(model, loader())
    groups = fit.optimizers[0].param_groups
    assert [len(g["params"]) for g in groups] == [6, 6]  # head and aux; the trunk, once
    assert all(q is p for q, p in zip(groups[1]["params"], model.trunk.parameters(), strict=True))
    settings = ("lr", "momentum", "weight_decay")
    assert [groups[1][k] for k in settings] == [groups[0][k] for k in settings] == [0.1, 0.5, 0.01]


class Plateau(Net):
    """Every parameter in one SGD group under ReduceLROnPlateau on a val_loss that never
    improves: the lr halves after every validation but the first."""

    def __init__(self) -> None:
        super().__init__(all_params=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.tensor(1.0))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


class FlagsOnly(pl.Callback):
    """The same training written by hand: the trunk stays in its group, frozen by its flags
    (and its BatchNorm held in eval mode) until ``epoch``."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.trunk.requires_grad_(False)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch >= self.epoch:
            pl_module.trunk.requires_grad_(True)
            pl_module.trunk[1].train()  # Lightning puts back the mode it saw before validation
        else:
            pl_module.trunk[1].eval()


@pytest.mark.filterwarnings("ignore:.*took 6 frozen parameters out")
def test_thaw_without_lr_joins_at_the_lr_reduce_on_plateau_has_brought_its_group_to(
    tmp_path: Path,
) -> None:
    runs = {}
    for name, callback in [
        ("spec", IsolationCallback(freeze=["trunk"], thaw=[Thaw("trunk", epoch=2)])),
        ("by hand", FlagsOnly(epoch=2)),
    ]:
        model = Plateau()
        fit = trainer(tmp_path / name, [callback], max_epochs=3, limit_val_batches=1)
        fit.fit(model, loader(), loader())
        runs[name] = (state(model), [g["lr"] for g in fit.optimizers[0].param_groups])
    assert runs["by hand"][1] == [0.025]  # halved after the validations of epochs 1 and 2
    assert runs["spec"][1] == [0.025, 0.025]  # the trunk joined at 0.05, then was halved
    assert changed(runs["spec"][0], runs["by hand"][0]) == set()


def test_frozen_parameters_with_zero_grads_stay_put(tmp_path: Path) -> None:
    model = Net(all_params=True, weight_decay=0.1)
    initial = state(model.trunk)

    class ZeroGrads(pl.Callback):  # the trap: zero-filled grads instead of None
        def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
            for p in model.trunk.parameters():
                p.grad = torch.zeros_like(p)

    callback = IsolationCallback(freeze=["trunk"], verify_every_n_steps=1)
    with pytest.warns(IsolationWarning, match="took 6 frozen parameters out"):
        trainer(tmp_path, [callback, ZeroGrads()]).fit(model, loader())
    assert not changed(initial, state(model.trunk))


def test_thaw_into_the_chosen_optimizer_under_manual_optimization(tmp_path: Path) -> None:
    def callback(**thaw: Any) -> IsolationCallback:
        return IsolationCallback(
            freeze=["trunk"], detach=["aux"], thaw=[Thaw("trunk", **thaw)], verify_every_n_steps=2
        )

    # Two optimizers and none holds the trunk: which one gets it must be said.
    model = TwoOptimizerNet()
    with pytest.raises(SpecError, match=r"in no optimizer and there are 2 optimizers"):
        trainer(tmp_path / "a", [callback(epoch=1, lr=0.05)]).fit(model, loader())

    model = TwoOptimizerNet()
    before = state(model.trunk)
    fit = trainer(tmp_path / "b", [callback(epoch=1, lr=0.05, optimizer_idx=0)])
    fit.fit(model, loader())
    held = [
        (o, g)
        for o, opt in enumerate(fit.optimizers)
        for g, group in enumerate(opt.param_groups)
        for q in group["params"]
        if q is model.trunk[0].weight
    ]
    assert held == [(0, 1)]
    assert {"0.weight", "3.weight"} <= changed(before, state(model.trunk))


# --------------------------------------------------------------------------------------------
# Checks while training


def test_leaks_raise_or_warn_naming_parameters(tmp_path: Path) -> None:
    model = Net()
    shape = fingerprint(model)
    callback = IsolationCallback(protect={"aux": ["trunk"]}, verify_every_n_steps=1)
    with pytest.raises(GradientLeakError, match=r"^IsolationCallback: at step 0, loss 'aux' ") as e:
        trainer(tmp_path, [callback]).fit(model, loader())
    assert all(f"'trunk.{name}'" in str(e.value) for name in TRUNK[:4])
    assert "protect['aux']" in str(e.value) and "AddmmBackward0" in str(e.value)
    assert fingerprint(model) == shape  # the exception path restores too

    callback = IsolationCallback(
        protect={"aux": ["trunk.0"]}, verify_every_n_steps=3, on_violation="warn"
    )
    with pytest.warns(IsolationWarning, match=r"loss 'aux' reaches 2 protected") as caught:
        trainer(tmp_path / "warn", [callback]).fit(Net(), loader())
    assert len([w for w in caught if w.category is IsolationWarning]) == 3  # steps 0, 3, 6

    callback = IsolationCallback(  # detached: the same protection holds
        detach=["aux"], protect={"aux": ["trunk", "head"]}, verify_every_n_steps=1
    )
    trainer(tmp_path / "detached", [callback]).fit(Net(), loader())


def test_violations_name_what_went_wrong(tmp_path: Path, subtests: pytest.Subtests) -> None:
    with subtests.test("a forward that bypasses the Detached wrapper"):
        callback = IsolationCallback(detach=["aux"], verify_every_n_steps=1)
        with pytest.raises(GradientLeakError, match=r"detach branch 'aux' \['aux.0.weight'"):
            trainer(tmp_path / "a", [callback]).fit(Net(bypass=True), loader())
    with subtests.test("a frozen parameter moved by hand"):
        callback = IsolationCallback(freeze=["trunk"], verify_every_n_steps=2)
        with pytest.raises(DriftError, match=r"(?s)moved \(at step 0\).*trunk\.0\.weight  \("):
            trainer(tmp_path / "b", [callback]).fit(Net(nudge=True), loader())
    with subtests.test("protect names a loss that training_step does not set"):
        callback = IsolationCallback(protect={"aux": ["trunk"]}, verify_every_n_steps=1)
        with pytest.raises(SpecError, match=r"did not set self\.isolation_losses at step 0"):
            trainer(tmp_path / "c", [callback]).fit(Net(aux=False), loader())


def test_grad_norms_reach_the_logger(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="csv")
    callback = IsolationCallback(
        freeze=["trunk"],
        detach=["aux"],
        thaw=[Thaw("trunk", epoch=1, lr=0.05)],
        verify_every_n_steps=2,
    )
    trainer(tmp_path, [callback], logger=logger, log_every_n_steps=1).fit(Net(), loader())
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r["isolation/grad_norm/total"]}
    assert sorted(rows) == [0, 2, 4, 6]
    for step, row in rows.items():
        assert float(row["isolation/grad_norm/aux"]) > 0
        assert float(row["isolation/grad_norm/rest"]) > 0
        thawed = row["isolation/grad_norm/trunk"]
        assert (float(thawed) > 0) if step >= 4 else thawed == ""


# --------------------------------------------------------------------------------------------
# Validation before the first step


INVALID: list[tuple[str, dict[str, Any], dict[str, Any], type[Exception], str]] = [
    (
        "unknown selector",
        {"freeze": ["backbone"]},
        {},
        SelectorError,
        r"^IsolationCallback\(freeze\): 'backbone' matched no parameter of Net; its "
        r"children are \['trunk', 'head', 'aux'\]",
    ),
    (
        "unknown branch",
        {"detach": ["probe"]},
        {},
        SelectorError,
        r"^IsolationCallback\(detach\): 'probe' is not a submodule of Net",
    ),
    (
        "detach and clone of one branch",
        {"detach": ["aux"], "clone": ["aux"]},
        {},
        SpecError,
        r"^IsolationCallback: \['aux'\] are both in detach and clone",
    ),
    (
        "thaw outside freeze",
        {"freeze": ["trunk.0"], "thaw": [Thaw("head", epoch=1, lr=0.1)]},
        {},
        SpecError,
        r"^IsolationCallback: thaw group 'head': 'head' selects 2 parameters that freeze does "
        r"not freeze: \['head.weight', 'head.bias'\]; they are trainable already",
    ),
    (
        "overlapping thaws",
        {"freeze": ["trunk"], "thaw": [Thaw("trunk.0", epoch=1), Thaw("trunk.*", step=3)]},
        {},
        SpecError,
        r"^IsolationCallback: thaw groups 'trunk.0' and 'trunk.\*' both select "
        r"\['trunk.0.weight', 'trunk.0.bias'\]",
    ),
    (
        "thawed parameters in no optimizer",
        {"freeze": ["trunk"], "thaw": [Thaw("trunk", epoch=1)]},
        {},
        SpecError,
        r"^IsolationCallback: thaw group 'trunk': lr is not set and its parameters "
        r"\['trunk.0.weight', .*\] are in no optimizer group",
    ),
    (
        "no such optimizer",
        {"freeze": ["trunk"], "thaw": [Thaw("trunk", epoch=1, lr=0.1, optimizer_idx=1)]},
        {},
        SpecError,
        r"optimizer_idx=1 but there are 1 optimizer\(s\)",
    ),
    (
        "frozen parameters in a weight-decay group",
        {"freeze": ["trunk"], "frozen_in_optimizer": "error"},
        {"all_params": True, "weight_decay": 1e-4},
        SpecError,
        r"^IsolationCallback: 6 frozen parameters sit in an optimizer.*\n  trunk.0.weight: "
        r"optimizer 0, param group 0 \(weight_decay=0.0001 shrinks it on every step\)",
    ),
]


def test_invalid_spec_leaves_model_unchanged(tmp_path: Path, subtests: pytest.Subtests) -> None:
    for i, (case, spec, net, error, match) in enumerate(INVALID):
        with subtests.test(case):
            model = Net(**net)
            before, shape = state(model), fingerprint(model)
            with pytest.raises(error, match=match):
                trainer(tmp_path / str(i), [IsolationCallback(**spec)]).fit(model, loader())
            assert fingerprint(model) == shape
            assert not changed(before, state(model))


def test_batchnorm_replaced_after_setup_is_refused(tmp_path: Path) -> None:
    # What sync_batchnorm=True does (SyncBatchNorm needs GPUs): the held layer is gone.
    model = Net(replace_bn=True)
    callback = IsolationCallback(freeze=["trunk"])
    with pytest.raises(SpecError, match=r"1 frozen BatchNorm layers were replaced .*'trunk.1'"):
        trainer(tmp_path, [callback]).fit(model, loader())
    assert all(p.requires_grad for p in model.parameters())
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_constructor_rejects_bad_arguments(subtests: pytest.Subtests) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"thaw": [{"select": "trunk"}]}, r"^Thaw\('trunk'\): give exactly one of epoch"),
        ({"thaw": [{"select": "trunk", "epoc": 1}]}, r"thaw\[0\] has unknown keys \['epoc'\]"),
        ({"thaw": [Thaw("a", epoch=1), Thaw("a", step=1)]}, r"share the names \['a'\]"),
        ({"thaw": [{"select": "a", "epoch": 1, "lr": 0}]}, r"lr must be a finite number > 0"),
        ({"clone": [1]}, r"^IsolationCallback: clone must be a list of non-empty strings"),
        ({"on_violation": "ignore"}, r"^IsolationCallback: on_violation must be 'raise' or 'warn'"),
        ({"protect": {"aux": []}}, r"protect\['aux'\] select nothing"),
    ]
    for kwargs, match in cases:
        with subtests.test(match), pytest.raises(SpecError, match=match):
            IsolationCallback(**kwargs)
    assert IsolationCallback(freeze="trunk").spec.freeze == ("trunk",)  # one selector, not 5
    assert issubclass(SpecError, IsolationError) and issubclass(SpecError, ValueError)
    assert issubclass(CheckpointMismatchError, IsolationError)


# --------------------------------------------------------------------------------------------
# Checkpoints


def _spec() -> IsolationCallback:
    return IsolationCallback(
        freeze=["trunk"],
        detach=["aux"],
        thaw=[Thaw("trunk", epoch=1, lr=0.05)],
        verify_every_n_steps=2,
    )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], Path]:
    """Four epochs, thaw at epoch 1, a checkpoint after each epoch."""
    root = tmp_path_factory.mktemp("full")
    every = ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, every_n_epochs=1)
    model = Net()
    fit = trainer(root, [_spec(), every], max_epochs=4, enable_checkpointing=True)
    fit.fit(model, loader())
    return state(model), root / "ckpt"


def test_resume_continues_identically(
    tmp_path: Path, full_run: tuple[dict[str, torch.Tensor], Path]
) -> None:
    final, ckpts = full_run
    # After the thaw: not frozen again, same param groups, same final weights, bit for bit.
    probe = Probe()
    model = Net(seed=1)  # other initial values: everything must come from the checkpoint
    resumed = trainer(tmp_path / "after", [_spec(), probe], max_epochs=4)
    resumed.fit(model, loader(), ckpt_path=ckpts / "epoch=1-step=8.ckpt")
    assert probe.flags == [True, True]
    assert probe.groups[0] == [(1, 0.05)] * 6
    assert not changed(final, state(model))
    # Before the thaw: the schedule still thaws at epoch 1.
    probe = Probe()
    model = Net(seed=1)
    resumed = trainer(tmp_path / "before", [_spec(), probe], max_epochs=4)
    resumed.fit(model, loader(), ckpt_path=ckpts / "epoch=0-step=4.ckpt")
    assert probe.flags == [True, True, True]
    assert not changed(final, state(model))


@pytest.mark.upstream_trap
@pytest.mark.filterwarnings("ignore:The provided params to be frozen already exist")
def test_backbone_finetuning_freezes_again_on_resume(tmp_path: Path) -> None:
    """Documents Lightning's BackboneFinetuning: resumed after its thaw, it freezes the
    backbone again in setup(), and it never learns again (the fault the callback avoids; see
    the README's migration notes). If this fails, the trap is gone upstream: update the docs."""

    def finetuning() -> BackboneFinetuning:
        return BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.05)

    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    model = BackboneNet()
    fit = trainer(tmp_path, [finetuning(), every], max_epochs=3, enable_checkpointing=True)
    fit.fit(model, loader())
    probe = Probe()
    resumed = BackboneNet(seed=1)
    trainer(tmp_path / "resumed", [finetuning(), probe], max_epochs=3).fit(
        resumed, loader(), ckpt_path=tmp_path / "ckpt" / "epoch=1-step=8.ckpt"
    )
    assert probe.flags == [False]  # frozen again, although the checkpoint is past the thaw
    assert "0.weight" in changed(state(model.trunk), state(resumed.trunk))


def test_checkpoint_of_another_spec_is_refused(
    tmp_path: Path, full_run: tuple[dict[str, torch.Tensor], Path]
) -> None:
    _, ckpts = full_run
    model = Net()
    shape = fingerprint(model)
    other = IsolationCallback(
        freeze=["trunk.0"], detach=["aux"], thaw=[Thaw("trunk.0", epoch=1, lr=0.05)]
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"^IsolationCallback: the checkpoint was written under a different isolation spec",
    ) as e:
        trainer(tmp_path, [other], max_epochs=4).fit(
            model, loader(), ckpt_path=ckpts / "epoch=1-step=8.ckpt"
        )
    assert "freeze: only in the checkpoint ['trunk.1.weight', 'trunk.1.bias'" in str(e.value)
    assert fingerprint(model) == shape

    # A checkpoint written without the callback: unknown what was frozen.
    plain = trainer(tmp_path / "plain", [], max_epochs=1, enable_checkpointing=True)
    plain.fit(Net(), loader())
    path = next((tmp_path / "plain" / "checkpoints").glob("*.ckpt"))
    with pytest.raises(CheckpointMismatchError, match=r"holds no IsolationCallback state"):
        trainer(tmp_path, [_spec()], max_epochs=2).fit(model, loader(), ckpt_path=path)
    assert fingerprint(model) == shape


# --------------------------------------------------------------------------------------------
# Configuration


@pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning")
def test_lightning_cli_builds_and_runs_the_callback_from_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytorch_lightning.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads args=, not pytest's argv

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
        seed_everything: 0
        trainer:
          default_root_dir: {tmp_path}
          accelerator: cpu
          max_steps: 6
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          enable_model_summary: false
          callbacks:
            - class_path: isolate.lightning.IsolationCallback
              init_args:
                freeze: [trunk]
                detach: [aux]
                thaw:
                  - select: [trunk.3]
                    step: 4
                    lr: 0.001
                protect:
                  aux: [trunk, head]
                verify_every_n_steps: 2
                on_violation: warn
        model:
          lr: 0.05
        """
    )
    cli = LightningCLI(Net, run=False, args=["--config", str(config)], save_config_callback=None)
    callback = next(c for c in cli.trainer.callbacks if isinstance(c, IsolationCallback))
    assert callback.spec.thaw == (Thaw(["trunk.3"], step=4, lr=0.001),)
    assert callback.spec.protect == {"aux": ("trunk", "head")}
    assert (callback.cadence.every, callback.cadence.on_violation) == (2, "warn")
    before = state(cli.model.trunk)
    cli.trainer.fit(cli.model, loader())
    assert changed(before, state(cli.model.trunk)) == {"3.weight", "3.bias"}


# --------------------------------------------------------------------------------------------
# What the callback keeps, says and checks along the way


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    """The messages of the callback (``rank_zero_info``) that contain ``text``."""
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_new_callback_has_the_documented_defaults_and_keeps_nothing_yet() -> None:
    callback = IsolationCallback()
    assert (callback.cadence.every, callback.cadence.on_violation) == (50, "raise")
    assert callback.log_grad_norms is True and callback.log_figures is False
    assert callback.drift == "fingerprint" and callback.print_ledger is True
    assert callback.handle is None and callback.ledger is None and callback.verdicts == {}
    assert isinstance(callback.tally, Tally) and str(callback.tally) == str(Tally())
    assert callback.state_dict() == {}
    assert IsolationCallback(drift="copy").drift == "copy"
    assert IsolationCallback(ledger=False).print_ledger is False
    # Only the spec's own name becomes the callback's, not a selector that spells it.
    assert repr(IsolationCallback(freeze=["IsolationSpec"])) == (
        "IsolationCallback(freeze=['IsolationSpec'])"
    )


class Seen(pl.Callback):
    """What the IsolationCallback before it holds once training starts."""

    def __init__(self, callback: IsolationCallback) -> None:
        self.callback = callback
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        handle = self.callback.handle
        assert handle is not None
        self.seen = {
            "drift": handle.drift,
            "verdicts": self.callback.verdicts is handle.contracts.verdicts,
            "tally": self.callback.tally is handle.tally,
        }


def test_the_ledger_is_printed_once_with_the_named_losses_and_the_handle_keeps_the_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = IsolationCallback(freeze=["trunk"], detach=["aux"], drift="copy")
    seen = Seen(callback)
    with caplog.at_level(logging.INFO, logger=rank_zero.log.name):
        trainer(tmp_path / "a", [callback, seen]).fit(Net(), loader())
    assert seen.seen == {"drift": "copy", "verdicts": True, "tally": True}
    assert len(_said(caplog, "IsolationCallback: the parameters at step 0\n")) == 1
    assert len(_said(caplog, "the parameters at step")) == 1  # once, not at every step
    assert callback.ledger is not None and callback.ledger.losses == ("aux", "total")
    expects = {row.name: row.expects for row in callback.ledger.rows}  # read from the spec
    assert (expects["trunk.0.weight"], expects["head.weight"]) == ("still", "moves")
    assert callback.verdicts == {}  # no contracts: none judged, and a dict after the fit
    # ledger=False: nothing printed, nothing kept.
    caplog.clear()
    quiet = IsolationCallback(freeze=["trunk"], detach=["aux"], ledger=False)
    with caplog.at_level(logging.INFO, logger=rank_zero.log.name):
        trainer(tmp_path / "b", [quiet]).fit(Net(), loader())
    assert _said(caplog, "the parameters at step") == [] and quiet.ledger is None


def test_a_thaw_is_announced_and_says_when_the_ddp_wrapper_was_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fit(root: Path) -> list[str]:
        callback = IsolationCallback(freeze=["trunk"], thaw=[Thaw("trunk", epoch=1, lr=0.05)])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=rank_zero.log.name):
            trainer(root, [callback]).fit(Net(), loader())
        return _said(caplog, "thawed")

    assert fit(tmp_path / "a") == [
        "IsolationCallback: thawed 'trunk' (6 parameters) at epoch 1, step 4"
    ]
    # Under DDP the wrapper is rebuilt at the thaw (and only then), and the message says so.
    calls: list[tuple[pl.Trainer, str]] = []

    def rewrap(trainer: pl.Trainer, caller: str) -> bool:
        calls.append((trainer, caller))
        return True

    monkeypatch.setattr(callback_module, "rewrap", rewrap)
    assert fit(tmp_path / "b") == [
        "IsolationCallback: thawed 'trunk' (6 parameters) at epoch 1, step 4; DDP wrapper "
        "rebuilt so its gradients are synchronised"
    ]
    assert [(isinstance(t, pl.Trainer), caller) for t, caller in calls] == [
        (True, "IsolationCallback")
    ]


def test_a_group_thawed_at_an_epoch_the_forward_skips_is_caught_on_its_first_step(
    tmp_path: Path,
) -> None:
    class SkipsTrunk3(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            return nn.functional.cross_entropy(self.head(self.trunk[:3](x)), y)

    callback = IsolationCallback(
        freeze=["trunk"],
        thaw=[Thaw("trunk.3", epoch=1, lr=0.1)],  # thawed at the epoch's start, before step 4
        verify_every_n_steps=100,  # step 4 is no check step: the thaw itself makes it one
        expected_unused=["aux"],
        on_violation="warn",
    )
    with pytest.warns(
        IsolationWarning,
        match=r"at step 4, 2 of \d+ trainable parameters .*\n  trunk.3.weight, trunk.3.bias",
    ):
        trainer(tmp_path, [callback]).fit(SkipsTrunk3(), loader())


def test_the_sanity_check_is_no_validation_run_for_a_monitor_thaw(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # min_delta above any change of val_loss: the second validation counts as no improvement,
    # so the thaw is due after epoch 1's validation; the sanity check before it counts for nothing.
    callback = IsolationCallback(
        freeze=["trunk"],
        thaw=[Thaw("trunk", monitor="val_loss", patience=1, min_delta=1e3, lr=0.05)],
    )
    fit = trainer(tmp_path, [callback], max_epochs=3, num_sanity_val_steps=2)
    with caplog.at_level(logging.INFO, logger=rank_zero.log.name):
        fit.fit(Net(), loader(), loader(n=32))
    assert _said(caplog, "'trunk' is due") + _said(caplog, "thawed 'trunk'") == [
        "IsolationCallback: 'trunk' is due: its metric stopped improving",
        "IsolationCallback: thawed 'trunk' (6 parameters) at epoch 2, step 8",
    ]


def test_teardown_of_another_stage_or_with_no_spec_applied_changes_nothing(
    tmp_path: Path,
) -> None:
    model = Net()
    callback = IsolationCallback(freeze=["trunk"])
    fit = trainer(tmp_path, [callback])
    callback.teardown(fit, model, "fit")  # nothing applied: nothing to keep or undo
    assert callback.state_dict() == {}
    callback.handle = IsolationSpec(freeze=["trunk"]).apply(model)  # as during a fit
    callback.teardown(fit, model, "validate")
    assert callback.handle is not None and not model.trunk[0].weight.requires_grad
    callback.teardown(fit, model, "fit")
    assert callback.handle is None and model.trunk[0].weight.requires_grad
    assert callback.state_dict()["frozen"]  # the state at teardown is kept


def test_a_protected_loss_training_step_never_sets_is_named_with_the_fix(tmp_path: Path) -> None:
    callback = IsolationCallback(detach=["aux"], protect={"aux": ["trunk"]}, verify_every_n_steps=1)
    with pytest.raises(
        SpecError,
        match=r"^IsolationCallback: protect names the losses \['aux'\], but Net.training_step "
        r"did not set self.isolation_losses at step 0; set it to a dict \{'loss name': "
        r"loss_tensor\} in every training_step$",
    ):
        trainer(tmp_path, [callback]).fit(Net(aux=False), loader())


def _other_rank_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the rank check see a second rank whose every parameter differs from this one's."""

    def gather(out: list[Any], obj: Any) -> None:
        names, mine, reports = obj
        out[:] = [obj, (names, [(key, print_ + 1) for key, print_ in mine], reports)]

    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    monkeypatch.setattr(checks, "world_size", lambda: 2)
    monkeypatch.setattr(ranks.dist, "all_gather_object", gather)


def test_ranks_that_differ_at_fit_start_raise_or_warn_as_the_callback_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _other_rank_differs(monkeypatch)
    differ = r"^IsolationCallback: parameters differ across the 2 ranks \(at fit start\): "
    model = Net()
    with pytest.raises(RankDivergenceError, match=differ):
        trainer(tmp_path / "a", [IsolationCallback(freeze=["trunk"], verify_every_n_steps=0)]).fit(
            model, loader()
        )
    assert all(p.requires_grad for p in model.parameters())  # undone on the error
    warn = IsolationCallback(freeze=["trunk"], verify_every_n_steps=0, on_violation="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path / "b", [warn]).fit(Net(), loader())
    said = [str(w.message) for w in caught if issubclass(w.category, IsolationWarning)]
    assert said and re.match(differ, said[0])


class RestoresAfterSetup(SingleDeviceStrategy):
    """One device, but the checkpoint is restored after ``on_fit_start``, as under
    ``ModelParallelStrategy``."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def test_a_spec_applied_at_fit_start_freezes_quietly_and_resumes_its_thaws(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the callback does under ModelParallelStrategy (whose configure_model replaces the
    # parameters after setup), on one process: the spec waits for on_fit_start.
    asked: list[object] = []

    def applies_at_fit_start(trainer: object) -> bool:
        asked.append(trainer)
        return True

    monkeypatch.setattr(callback_module, "applies_at_fit_start", applies_at_fit_start)

    def callbacks(*more: pl.Callback) -> list[pl.Callback]:
        return [IsolationCallback(freeze=["trunk"], thaw=[Thaw("trunk", epoch=1, lr=0.05)]), *more]

    def run(root: Path, more: list[pl.Callback], **kw: Any) -> pl.Trainer:
        strategy = RestoresAfterSetup(torch.device("cpu"))
        return trainer(root, callbacks(*more), strategy=strategy, **kw)

    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    model = Net(all_params=True)  # its optimizer was built before anything was frozen
    trunk, probe = state(model.trunk), Probe()
    fit = run(tmp_path, [every, probe], enable_checkpointing=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IsolationWarning)  # frozen ones taken out without a word
        fit.fit(model, loader())
    assert asked and all(t is fit for t in asked)
    assert probe.flags == [False, True] and not changed(trunk, probe.ends[0])
    # A resume past the thaw: the checkpoint's thaw is back before the optimizer state loads.
    probe = Probe()
    again = run(tmp_path / "again", [probe], max_epochs=3)
    again.fit(
        Net(seed=1, all_params=True), loader(), ckpt_path=tmp_path / "ckpt" / "epoch=1-step=8.ckpt"
    )
    assert probe.flags == [True] and probe.groups[0] == [(1, 0.05)] * 6
    # A checkpoint written without the callback is refused before anything loads.
    plain = trainer(tmp_path / "plain", [], max_epochs=1, enable_checkpointing=True)
    plain.fit(Net(), loader())
    path = next((tmp_path / "plain" / "checkpoints").glob("*.ckpt"))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"^IsolationCallback: the checkpoint '.+' holds no IsolationCallback state: it "
        r"was written without this callback",
    ):
        run(tmp_path / "refused", []).fit(Net(), loader(), ckpt_path=path)


def test_with_the_periodic_checks_off_a_fit_checks_ranks_at_its_start_and_drift_at_its_end(
    tmp_path: Path,
) -> None:
    callback = IsolationCallback(freeze=["trunk"], verify_every_n_steps=0)
    trainer(tmp_path, [callback], max_epochs=1).fit(Net(), loader())
    # Two verifications: ranks at fit start (nothing to compare in one process), then params,
    # drift and ranks at the end of training; no other check ran.
    assert (callback.tally.runs, callback.tally.times) == (2, {"params": 1, "drift": 1})
