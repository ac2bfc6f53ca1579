"""One IsolationCallback under both Lightnings: the standalone ``pytorch_lightning`` and the
unified ``lightning.pytorch`` (the ``pl`` fixture runs each test under each).

The same network (``tests.lightning._models.net(pl)``) and the same specs as the single-package
tests: a fit with a thaw, a resume that equals the uninterrupted run bit for bit, a resume
refused under another spec, the strategies refused by name, the monitor thaw that needs a
validation loop, and the LightningCLI. Multi-process runs (DDP, FSDP2) take the package as an
argument of their scripts (``tests/distributed/test_lightning_ddp.py``, ``test_lightning_fsdp.py``).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from isolate import Thaw
from isolate.errors import CheckpointMismatchError, SpecError, UnsupportedStrategyError
from isolate.lightning import IsolationCallback
from isolate.lightning.strategies import check_trainer
from tests.lightning._models import loader, net, state, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:.*val_dataloader.*no `validation_step`"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no"),
    pytest.mark.filterwarnings("ignore:Found 1 module\\(s\\) in eval mode"),
    pytest.mark.filterwarnings("ignore:No seed found"),
]


def _spec() -> IsolationCallback:
    return IsolationCallback(
        freeze=["trunk"],
        detach=["aux"],
        thaw=[Thaw("trunk", epoch=1, lr=0.05)],
        verify_every_n_steps=1,
    )


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


def _shape(model: nn.Module) -> dict[str, Any]:
    return {
        "modules": {n: type(m) for n, m in model.named_modules()},
        "params": {n: (id(p), p.requires_grad) for n, p in model.named_parameters()},
    }


def _probe(pl: ModuleType) -> Any:
    """A callback of ``pl`` that records, at each epoch start, whether the trunk requires grad
    and (group index, lr) of each trunk parameter in the optimizer."""

    class Probe(pl.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            self.flags: list[bool] = []
            self.groups: list[list[tuple[int, float]]] = []

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
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

    return Probe()


def test_the_callback_is_a_callback_of_either_lightning(pl: ModuleType, tmp_path: Path) -> None:
    callback = _spec()
    assert isinstance(callback, pl.Callback)
    # A single callback (not a list) is taken only if it is a Callback of the Trainer's own package.
    fit = pl.Trainer(default_root_dir=tmp_path, callbacks=callback, logger=False)
    assert [c for c in fit.callbacks if c is callback] == [callback]
    is_overridden = pl.utilities.model_helpers.is_overridden
    assert is_overridden("state_dict", callback)  # what the Trainer asks before it saves state


def test_fit_thaws_at_its_epoch_and_restores(pl: ModuleType, tmp_path: Path) -> None:
    model = net(pl)()
    before, shape = state(model), _shape(model)
    probe = _probe(pl)
    trainer(tmp_path, [_spec(), probe], lightning=pl, max_epochs=3).fit(model, loader())
    assert probe.flags == [False, True, True]
    assert probe.groups[0] == []  # out of the optimizer while frozen
    assert probe.groups[1] == [(1, 0.05)] * 6  # each trunk parameter once, with its lr
    moved = _changed(before, state(model))
    assert {"trunk.0.weight", "trunk.3.weight", "head.weight", "aux.0.weight"} <= moved
    assert _shape(model) == shape  # flags, identities, classes: as before fit


@pytest.fixture(scope="module", params=["pytorch_lightning", "lightning.pytorch"])
def full_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModuleType, dict[str, torch.Tensor], Path]:
    """Three epochs under one Lightning, thaw at epoch 1, a checkpoint after each epoch."""
    pl = importlib.import_module(request.param)
    root = tmp_path_factory.mktemp("full")
    every = pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, every_n_epochs=1)
    model = net(pl)()
    fit = trainer(root, [_spec(), every], lightning=pl, max_epochs=3, enable_checkpointing=True)
    fit.fit(model, loader())
    return pl, state(model), root / "ckpt"


@pytest.mark.parametrize("at", ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"])
def test_resume_equals_the_uninterrupted_run(
    full_run: tuple[ModuleType, dict[str, torch.Tensor], Path], tmp_path: Path, at: str
) -> None:
    pl, final, ckpts = full_run
    probe = _probe(pl)
    model = net(pl)(seed=1)  # other initial values: everything must come from the checkpoint
    resumed = trainer(tmp_path, [_spec(), probe], lightning=pl, max_epochs=3)
    resumed.fit(model, loader(), ckpt_path=ckpts / at)
    assert all(probe.flags)  # thawed at epoch 1 (before it), or not frozen again (after it)
    assert not _changed(final, state(model))  # bit for bit


def test_resume_under_another_spec_is_refused_before_the_weights_load(
    full_run: tuple[ModuleType, dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    pl, _, ckpts = full_run
    model = net(pl)()
    before, shape = state(model), _shape(model)
    other = IsolationCallback(freeze=["trunk.0"], thaw=[Thaw("trunk.0", epoch=1, lr=0.05)])
    with pytest.raises(CheckpointMismatchError, match=r"different isolation spec") as raised:
        trainer(tmp_path, [other], lightning=pl, max_epochs=3).fit(
            model, loader(), ckpt_path=ckpts / "epoch=1-step=8.ckpt"
        )
    assert "freeze: only in the checkpoint ['trunk.1.weight', 'trunk.1.bias'" in str(raised.value)
    assert _shape(model) == shape and not _changed(before, state(model))


def test_a_checkpoint_of_one_lightning_resumes_under_the_other(
    full_run: tuple[ModuleType, dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    writer, final, ckpts = full_run
    (reader_name,) = {"pytorch_lightning", "lightning.pytorch"} - {writer.__name__}
    reader = importlib.import_module(reader_name)
    model = net(reader)(seed=1)
    resumed = trainer(tmp_path, [_spec()], lightning=reader, max_epochs=3)
    resumed.fit(model, loader(), ckpt_path=ckpts / "epoch=1-step=8.ckpt")
    assert not _changed(final, state(model))


def test_unsupported_strategies_are_refused_by_name(pl: ModuleType) -> None:
    callback = IsolationCallback(freeze=["trunk"])

    def check(strategy: object) -> None:
        fake = types.SimpleNamespace(callbacks=[callback], strategy=strategy)
        check_trainer(fake, callback, "IsolationCallback")  # type: ignore[arg-type]

    deepspeed = pl.strategies.DeepSpeedStrategy.__new__(pl.strategies.DeepSpeedStrategy)
    with pytest.raises(
        UnsupportedStrategyError, match=r"^IsolationCallback: the DeepSpeedStrategy"
    ):
        check(deepspeed)
    fsdp = pl.strategies.FSDPStrategy.__new__(pl.strategies.FSDPStrategy)
    fsdp.kwargs = {"use_orig_params": False}
    with pytest.raises(UnsupportedStrategyError, match=r"use_orig_params=False\) flattens"):
        check(fsdp)
    fsdp.kwargs = {"use_orig_params": True}
    check(fsdp)
    check(pl.strategies.SingleDeviceStrategy(torch.device("cpu")))
    check(pl.strategies.DDPStrategy())
    check(pl.strategies.ModelParallelStrategy())


def test_a_monitor_thaw_needs_a_validation_step(pl: ModuleType, tmp_path: Path) -> None:
    class NoValidation(net(pl)):  # type: ignore[misc]
        validation_step = pl.LightningModule.validation_step

    callback = IsolationCallback(
        freeze=["trunk"], thaw=[Thaw("trunk", monitor="val_loss", lr=0.05)]
    )
    with pytest.raises(SpecError, match=r"NoValidation defines no validation_step"):
        trainer(tmp_path / "none", [callback], lightning=pl).fit(
            NoValidation(), loader(), loader(n=32)
        )
    # With one, the fit runs and the metric is watched.
    # min_delta above any change of val_loss: the second validation counts as no improvement.
    callback = IsolationCallback(
        freeze=["trunk"],
        thaw=[Thaw("trunk", monitor="val_loss", patience=1, min_delta=1e3, lr=0.05)],
    )
    model = net(pl)()
    trainer(tmp_path / "some", [callback], lightning=pl, max_epochs=3).fit(
        model, loader(), loader(n=32)
    )
    assert callback.state_dict()["thawed"], "the monitor thaw never happened"


@pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning")
def test_lightning_cli_takes_the_callback_by_class_path(
    pl: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])
    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
        trainer:
          default_root_dir: {tmp_path}
          accelerator: cpu
          max_steps: 4
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          enable_model_summary: false
          callbacks:
            - class_path: isolate.lightning.IsolationCallback
              init_args:
                freeze: [trunk]
                thaw: [{{select: [trunk.3], step: 2, lr: 0.001}}]
                verify_every_n_steps: 1
        """
    )
    cli = importlib.import_module(f"{pl.__name__}.cli").LightningCLI(
        net(pl), run=False, args=["--config", str(config)], save_config_callback=None
    )
    callback = next(c for c in cli.trainer.callbacks if isinstance(c, IsolationCallback))
    before = state(cli.model.trunk)
    cli.trainer.fit(cli.model, loader())
    assert _changed(before, state(cli.model.trunk)) == {"3.weight", "3.bias"}
    assert callback.state_dict()["thawed"][0]["name"] == "trunk.3"


def _imports_without(*missing: str, broken: str | None = None) -> Any:
    """``importlib`` for ``_compat`` with the top-level packages ``missing`` not installed, and
    ``broken`` (if given) failing on a dependency of its own that is missing."""

    def import_module(name: str) -> ModuleType:
        top = name.split(".")[0]
        if top in missing:
            raise ModuleNotFoundError(f"No module named {top!r}", name=top)
        if name == broken:
            raise ModuleNotFoundError(
                "No module named 'lightning_utilities'", name="lightning_utilities"
            )
        return importlib.import_module(name)

    return types.SimpleNamespace(import_module=import_module)


@pytest.mark.parametrize(
    ("missing", "found"),
    [(("lightning",), ["pytorch_lightning"]), (("pytorch_lightning",), ["lightning.pytorch"])],
)
def test_a_lightning_that_is_not_installed_is_left_out(
    missing: tuple[str, ...], found: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    compat = importlib.import_module("isolate.lightning._compat")
    monkeypatch.setattr(compat, "importlib", _imports_without(*missing))
    assert [package.__name__ for package in compat._installed()] == found


def test_a_broken_lightning_is_not_taken_for_a_missing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    compat = importlib.import_module("isolate.lightning._compat")
    monkeypatch.setattr(compat, "importlib", _imports_without(broken="lightning.pytorch"))
    with pytest.raises(ModuleNotFoundError) as broken:
        compat._installed()
    assert broken.value.name == "lightning_utilities"
    monkeypatch.setattr(compat, "importlib", _imports_without("lightning", "pytorch_lightning"))
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'isolate\[lightning\]'") as none:
        compat._installed()
    assert none.value.name == "pytorch_lightning"  # what tools that name the missing module read
