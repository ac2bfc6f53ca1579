"""Reliability of IsolationCallback: a run interrupted at any step and resumed from its last
checkpoint ends bitwise where the uninterrupted run ends; checkpoints load with
``weights_only=True``; config files cannot run code; a checkpoint of another spec is refused by
name; an error anywhere in a step leaves the model as it was before ``fit``.

The model (``tests.lightning._models.Net``) is trunk (Linear, BatchNorm, ReLU, Linear) -> head,
and trunk -> aux; 64 samples in batches of 16 make 4 optimizer steps per epoch. The schedule thaws
``trunk.0`` before step 3 (mid-epoch 0) and ``trunk.1`` (the BatchNorm) and ``trunk.3`` at
epoch 1 (step 4).

Where a resume is exact (what the tests below pin down):

* after any step, given a train loader with ``state_dict`` / ``load_state_dict``
  (``resumable_loader``) and a checkpointed global RNG (``RNGState``) when training draws
  random numbers (dropout). Lightning checkpoints neither: a plain DataLoader restarts the
  epoch from its first batch while ``batch_idx`` goes on (Lightning warns "not resumable"),
  and the RNG restarts from the seed;
* at epoch ends, with a plain unshuffled DataLoader too;
* not from ``OnExceptionCheckpoint``: it is written in the middle of a step, which the loop
  then replays, while the loader has already handed out that step's batch and the RNG has
  drawn its dropout masks.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Checkpoint, ModelCheckpoint, OnExceptionCheckpoint
from torch import nn

from isolate import Thaw
from isolate.errors import CheckpointMismatchError
from isolate.lightning import IsolationCallback
from tests.lightning._models import Net, RNGState, loader, resumable_loader, state, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]

EPOCHS = 3  # 12 steps


class Boom(RuntimeError):
    pass


def spec(**changes: Any) -> IsolationCallback:
    args: dict[str, Any] = {
        "freeze": ["trunk"],
        "detach": ["aux"],
        "thaw": [Thaw("trunk.0", step=3, lr=0.05), Thaw(["trunk.1", "trunk.3"], epoch=1, lr=0.02)],
        "verify_every_n_steps": 2,
    }
    return IsolationCallback(**{**args, **changes})


class Failing(Net):
    """Net that raises ``error`` at optimizer step ``at``: in ``training_step`` after the
    forward, in the backward of that step, or in the first ``validation_step``."""

    def __init__(
        self, *, at: int, error: type[BaseException] = Boom, where: str = "training_step", **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.at, self.error, self.where = at, error, where

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.at and self.where == "training_step":
            raise self.error(f"training_step at step {self.at}")
        if self.global_step == self.at and self.where == "backward":
            loss.register_hook(self._raise)
        return loss

    def _raise(self, grad: torch.Tensor) -> None:
        raise self.error(f"backward at step {self.at}")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.where == "validation_step":
            raise self.error("validation_step")
        super().validation_step(batch, batch_idx)


MODULE_HOOKS = [a for a in vars(nn.Module()) if a.endswith("hooks") or "_hooks_" in a]


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """What an isolation could leave behind: module classes, parameter identities and flags,
    every module's training flag, and every hook on modules, parameters and globally."""
    globals_ = nn.modules.module
    return {
        "modules": {n: type(m) for n, m in model.named_modules()},
        "params": {n: (id(p), p.requires_grad) for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "module_hooks": {
            (n, a): len(getattr(m, a)) for n, m in model.named_modules() for a in MODULE_HOOKS
        },
        "param_hooks": {
            n: (len(p._backward_hooks or {}), len(p._post_accumulate_grad_hooks or {}))
            for n, p in model.named_parameters()
        },
        "global_hooks": [len(getattr(globals_, a)) for a in dir(globals_) if a.endswith("hooks")],
    }


def outcome(fit: pl.Trainer, model: nn.Module) -> dict[str, Any]:
    """Everything a resume must reproduce: weights and buffers (BatchNorm statistics), the
    optimizer (momentum buffers, param groups), the LR scheduler and the callback's record."""
    callback = next(c for c in fit.callbacks if isinstance(c, IsolationCallback))
    return {
        "model": state(model),
        "optimizer": fit.optimizers[0].state_dict(),
        "scheduler": fit.lr_scheduler_configs[0].scheduler.state_dict(),
        "isolation": callback.state_dict(),
    }


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, bit for bit for tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where} keys {list(a)} != {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length {len(a)} != {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def run(
    root: Path,
    model: Net,
    *callbacks: pl.Callback,
    data: Any = None,
    ckpt: Path | None = None,
    every_step: bool = False,
    **kwargs: Any,
) -> pl.Trainer:
    if every_step:
        callbacks += (
            ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_last=True),
        )
    checkpoints = any(isinstance(c, Checkpoint) for c in callbacks)
    fit = trainer(root, list(callbacks), max_epochs=EPOCHS, enable_checkpointing=checkpoints)
    fit.fit(
        model,
        resumable_loader() if data is None else data,
        ckpt_path=ckpt,
        weights_only=True if ckpt else None,
        **kwargs,
    )
    return fit


@pytest.fixture
def sigint() -> Iterator[None]:
    """Lightning answers a KeyboardInterrupt by ignoring SIGINT for good (then sys.exit(1))."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run: dropout, a cosine LR schedule, a shuffled resumable loader."""
    root = tmp_path_factory.mktemp("reference")
    model = Net(dropout=0.2, scheduler=True)
    fit = run(root, model, spec(), RNGState())
    return outcome(fit, model)


# --------------------------------------------------------------------------------------------
# 1. Interrupted training, then resume


@pytest.mark.parametrize(
    ("at", "error"),
    [
        pytest.param(2, Boom, id="mid-epoch-0-before-any-thaw"),
        pytest.param(3, Boom, id="at-the-step-thaw"),
        # The last checkpoint is after the last batch of epoch 0: Lightning's fit loop resumes
        # "mid-epoch" and skips on_train_epoch_start of epoch 1, where the epoch thaw was due.
        pytest.param(4, Boom, id="first-step-of-epoch-1"),
        pytest.param(6, Boom, id="mid-epoch-1-after-both-thaws"),
        pytest.param(9, KeyboardInterrupt, id="keyboard-interrupt-mid-epoch-2"),
    ],
)
@pytest.mark.usefixtures("sigint")
def test_resume_after_an_interruption_is_bitwise_identical(
    tmp_path: Path, reference: dict[str, Any], at: int, error: type[BaseException]
) -> None:
    model = Failing(at=at, error=error, dropout=0.2, scheduler=True)
    before = fingerprint(model)
    # Lightning turns a KeyboardInterrupt into on_exception, then sys.exit(1).
    expected: type[BaseException] = SystemExit if error is KeyboardInterrupt else Boom
    with pytest.raises(expected) as raised:
        run(tmp_path, model, spec(), RNGState(), every_step=True)
    if error is KeyboardInterrupt:
        assert raised.value.code == 1
    assert fingerprint(model) == before  # flags, modes, wrappers, hooks: as before fit

    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == at
    resumed = Net(dropout=0.2, scheduler=True, seed=1)  # everything must come from the file
    fit = run(tmp_path / "resumed", resumed, spec(), RNGState(), ckpt=last)
    assert differences(outcome(fit, resumed), reference) == []


def test_which_boundaries_resume_exactly_without_help(tmp_path: Path) -> None:
    """The controls: what makes the resumes above exact."""

    def interrupted(sub: str, at: int, data: Any, rng: bool) -> dict[str, Any]:
        extra: list[pl.Callback] = [RNGState()] if rng else []
        with pytest.raises(Boom):
            run(
                tmp_path / sub,
                Failing(at=at, dropout=0.2, scheduler=True),
                spec(),
                *extra,
                data=data(),
                every_step=True,
            )
        resumed = Net(dropout=0.2, scheduler=True, seed=1)
        fit = run(
            tmp_path / sub / "resumed",
            resumed,
            spec(),
            *extra,
            data=data(),
            ckpt=tmp_path / sub / "ckpt" / "last.ckpt",
        )
        return outcome(fit, resumed)

    # A plain DataLoader (no state_dict): exact at an epoch end, not mid-epoch, where Lightning
    # iterates it from the start again but counts batch_idx on (and warns that it is "not
    # resumable").
    model = Net(dropout=0.2, scheduler=True)
    plain = outcome(run(tmp_path / "plain", model, spec(), RNGState(), data=loader()), model)
    assert differences(interrupted("plain-4", 4, loader, rng=True), plain) == []
    assert differences(interrupted("plain-6", 6, loader, rng=True), plain) != []

    # A resumable loader without the RNG in the checkpoint: other dropout masks.
    model = Net(dropout=0.2, scheduler=True)
    shuffled = outcome(run(tmp_path / "shuffled", model, spec(), RNGState()), model)
    assert differences(interrupted("no-rng-6", 6, resumable_loader, rng=False), shuffled) != []


# With an OnExceptionCheckpoint, fit(ckpt_path=None) means "last" (here: none yet).
@pytest.mark.filterwarnings("ignore:.*fit\\(ckpt_path=None\\)` was called without a model")
@pytest.mark.filterwarnings("ignore:.*there is no last checkpoint available")
def test_on_exception_checkpoint_carries_the_state_at_the_error(tmp_path: Path) -> None:
    # OnExceptionCheckpoint (a Checkpoint, so Lightning runs it after every other callback)
    # saves once IsolationCallback.on_exception has undone the run: the state must survive.
    model = Failing(at=5, dropout=0.2, scheduler=True)
    with pytest.raises(Boom):
        run(tmp_path, model, spec(), RNGState(), OnExceptionCheckpoint(tmp_path))
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert saved["callbacks"]["IsolationCallback"]["frozen"] == []
    assert saved["callbacks"]["IsolationCallback"]["thawed"] == [
        {"name": "trunk.0", "epoch": 0, "global_step": 3},
        {"name": "trunk.1+trunk.3", "epoch": 1, "global_step": 4},
    ]
    assert [len(g["params"]) for g in saved["optimizer_states"][0]["param_groups"]] == [6, 2, 4]

    resumed = Net(dropout=0.2, scheduler=True, seed=1)
    fit = run(
        tmp_path / "resumed", resumed, spec(), RNGState(), ckpt=tmp_path / "on_exception.ckpt"
    )
    groups = fit.optimizers[0].param_groups
    assert [[id(p) for p in g["params"]] for g in groups[1:]] == [
        [id(p) for p in resumed.trunk[0].parameters()],
        [id(p) for p in [*resumed.trunk[1].parameters(), *resumed.trunk[3].parameters()]],
    ]


# --------------------------------------------------------------------------------------------
# 2. Safe loading


PLAIN = (dict, list, str, int, float, bool, type(None))


def plain_types(value: Any, where: str = "state") -> list[str]:
    """Where ``value`` holds anything but exact builtins."""
    if type(value) not in PLAIN:
        return [f"{where}: {type(value).__name__}"]
    if isinstance(value, dict):
        return [
            d
            for k, v in value.items()
            for d in plain_types(k, f"{where} key") + plain_types(v, f"{where}/{k}")
        ]
    if isinstance(value, list):
        return [d for i, v in enumerate(value) for d in plain_types(v, f"{where}[{i}]")]
    return []


def test_checkpoints_hold_plain_types_and_load_with_weights_only(tmp_path: Path) -> None:
    # A numpy float passes as a float (np.float64 subclasses it) but pickles as numpy, which
    # torch.load(weights_only=True), torch's default since 2.6, refuses.
    path = tmp_path / "numpy.pt"
    torch.save({"lr": np.float64(0.05)}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(path, weights_only=True)

    thaw = [Thaw("trunk.0", step=3, lr=np.float64(0.05)), {"select": "trunk.3", "epoch": 1}]
    callback = spec(thaw=thaw)
    with pytest.warns(Warning, match="took 6 frozen parameters out"):
        run(tmp_path, Net(all_params=True), callback, every_step=True)
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    saved = checkpoint["callbacks"]["IsolationCallback"]
    assert plain_types(saved) == []
    assert saved["spec"]["thaw"][0]["lr"] == 0.05 and type(saved["spec"]["thaw"][0]["lr"]) is float
    assert saved["thawed"] == [
        {"name": "trunk.0", "epoch": 0, "global_step": 3},
        {"name": "trunk.3", "epoch": 1, "global_step": 4},
    ]
    assert saved == callback.state_dict()  # kept after teardown, for a checkpoint written later

    model = Net(all_params=True, seed=1)  # and Lightning resumes it with weights_only=True
    with pytest.warns(Warning, match="took 2 frozen parameters out"):
        trainer(tmp_path / "resumed", [spec(thaw=thaw)], max_epochs=EPOCHS + 1).fit(
            model, resumable_loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt", weights_only=True
        )


CODE_TAGS = [
    pytest.param('!!python/object/apply:os.system ["touch {pwned}"]', id="object-apply"),
    pytest.param('!!python/object/new:subprocess.Popen [["touch", "{pwned}"]]', id="object-new"),
    pytest.param("!!python/name:os.system", id="name"),
]


@pytest.mark.parametrize("tag", CODE_TAGS)
def test_yaml_tags_that_run_code_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tag: str
) -> None:
    from pytorch_lightning.cli import LightningCLI

    from experiments.cli import cli_main  # here: only this test depends on the experiments

    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads args=, not pytest's argv
    pwned = tmp_path / "pwned"
    value = tag.format(pwned=pwned)
    config = tmp_path / "config.yaml"
    config.write_text(f"trainer:\n  max_steps: {value}\nmodel:\n  lr: 0.1\n")
    constructor = "could not determine a constructor for the tag 'tag:yaml.org,2002:python/"

    # LightningCLI (jsonargparse's safe YAML loader), and the experiments' entry point.
    for build in (
        lambda: LightningCLI(Net, run=False, args=["--config", str(config)]),
        lambda: cli_main(["--config", str(config)], run=False),
        lambda: cli_main(["fit", "--config", str(config)]),
    ):
        with pytest.raises(SystemExit) as exit_:
            build()
        assert exit_.value.code == 2
        assert constructor in capsys.readouterr().err
    assert not pwned.exists()


def test_class_path_in_a_thaw_step_is_refused_unbuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """jsonargparse builds any ``class_path`` it meets in a value typed ``Any``: with ``thaw``
    typed ``list[Thaw | dict[str, Any]]`` a config ran ``subprocess.Popen`` while parsing.
    Typed key by key (``ThawKeys``), every such value is refused before anything is built."""
    import yaml
    from pytorch_lightning.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads args=, not pytest's argv
    pwned = tmp_path / "pwned.log"
    handler = {"class_path": "logging.FileHandler", "init_args": {"filename": str(pwned)}}
    for thaw in (
        [handler],
        [{"select": "trunk", "epoch": 1, "lr": handler}],
        [{"select": handler, "epoch": 1}],
        [{"select": "trunk", "epoch": 1, "name": handler}],
    ):
        callback = {
            "class_path": "isolate.lightning.IsolationCallback",
            "init_args": {"freeze": ["trunk"], "thaw": thaw},
        }
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
        with pytest.raises(SystemExit) as exit_:
            LightningCLI(Net, run=False, args=["--config", str(config)], save_config_callback=None)
        assert exit_.value.code == 2
        assert "isolate.spec.thaw.ThawKeys" in capsys.readouterr().err
        assert not pwned.exists()  # FileHandler creates its file when constructed


# --------------------------------------------------------------------------------------------
# 3. A checkpoint written under another spec


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """After epoch 0 under spec(): trunk.0 thawed at step 3, trunk.1 and trunk.3 still frozen."""
    root = tmp_path_factory.mktemp("spec")
    fit = trainer(root, [spec()], max_epochs=1, enable_checkpointing=True)
    fit.fit(Net(), resumable_loader())
    return next((root / "checkpoints").glob("*.ckpt"))


FIX = r"\nFix: resume with the spec of the run that wrote it, or load only"
STEP_THAW = Thaw("trunk.0", step=3, lr=0.05)
MISMATCHES = [
    pytest.param(
        {"freeze": ["trunk", "head"]},
        r"  freeze: only in the checkpoint \[\], only in this run \['head.weight', 'head.bias'\]",
        id="freeze",
    ),
    pytest.param(
        {"detach": []},
        r"  detach: only in the checkpoint \['aux'\], only in this run \[\]",
        id="detach",
    ),
    pytest.param(
        {"detach": [], "clone": ["aux"]},
        r"  detach: only in the checkpoint \['aux'\], only in this run \[\]\n"
        r"  clone: only in the checkpoint \[\], only in this run \['aux'\]",
        id="detach-becomes-clone",
    ),
    pytest.param(
        {"thaw": [STEP_THAW, Thaw(["trunk.1", "trunk.3"], epoch=2, lr=0.02)]},
        r"  thaw group 'trunk.1\+trunk.3': epoch 1 in the checkpoint, 2 in this run",
        id="thaw-later",
    ),
    pytest.param(
        {"thaw": [Thaw("trunk.0", epoch=1, lr=0.01), Thaw(["trunk.1", "trunk.3"], epoch=1)]},
        r"  thaw group 'trunk.0': epoch None in the checkpoint, 1 in this run; step 3 in the "
        r"checkpoint, None in this run; lr 0.05 in the checkpoint, 0.01 in this run\n"
        r"  thaw group 'trunk.1\+trunk.3': lr 0.02 in the checkpoint, None in this run",
        id="thaw-by-epoch-not-step",
    ),
    pytest.param(
        {"thaw": [STEP_THAW]},
        r"  thaw: groups only in the checkpoint \['trunk.1\+trunk.3'\], only in this run \[\]",
        id="thaw-group-dropped",
    ),
    pytest.param(
        {"bn": "train"},
        r"  bn: checkpoint 'eval', this run 'train'\n  bn_held: only in the checkpoint",
        id="bn",
    ),
]


@pytest.mark.parametrize(("changes", "message"), MISMATCHES)
def test_checkpoint_of_another_spec_is_refused_by_name(
    tmp_path: Path, checkpoint: Path, changes: dict[str, Any], message: str
) -> None:
    model = Net(seed=1)
    before, weights = fingerprint(model), state(model)
    with pytest.raises(CheckpointMismatchError) as error:
        trainer(tmp_path, [spec(**changes)], max_epochs=2).fit(
            model, resumable_loader(), ckpt_path=checkpoint, weights_only=True
        )
    # Refused before the strategy loads the weights: the model keeps its own.
    assert all(torch.equal(v, state(model)[k]) for k, v in weights.items())
    assert error.match(
        r"^IsolationCallback: the checkpoint was written under a different isolation spec:\n"
        + message
        + r".*"
        + FIX
    )
    assert fingerprint(model) == before
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert differences(state(model), saved)  # the refused checkpoint's weights differ


# --------------------------------------------------------------------------------------------
# 4. Exception safety


@pytest.mark.parametrize("where", ["training_step", "backward", "validation_step"])
def test_an_error_in_a_step_leaves_the_model_as_before_fit(tmp_path: Path, where: str) -> None:
    callback = spec(
        detach=[],
        clone=["aux"],
        thaw=[Thaw("trunk.0", step=3, lr=0.05), Thaw(["trunk.1", "trunk.3"], epoch=2, lr=0.02)],
        verify_every_n_steps=1,
    )
    model = Failing(at=5, where=where)
    model.trunk[0].bias.requires_grad_(False)  # thawed at step 3, yet comes back False
    model.head.eval()  # Lightning keeps a mode set before fit; so must the callback
    before = fingerprint(model)
    with pytest.raises(Boom, match=where):
        run(tmp_path, model, callback, val_dataloaders=loader(n=32))
    assert fingerprint(model) == before
    assert not any(before["module_hooks"].values()) and not any(before["global_hooks"])
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_lightning_leaves_eval_mode_when_validation_raises(tmp_path: Path) -> None:
    """The control for the callback's restore of every training flag: without it, a
    validation step that raises leaves the whole model in eval mode."""
    model = Failing(at=0, where="validation_step")
    with pytest.raises(Boom):
        run(tmp_path, model, val_dataloaders=loader(n=32))
    assert not any(m.training for m in model.modules())
