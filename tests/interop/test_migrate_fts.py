"""Migration and leaving under what users write: regexes converted exactly or refused, and
``plain_checkpoint`` taking whatever ``configure_optimizers()`` returns."""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from isolate.cli import main
from isolate.errors import CheckpointMismatchError, IsolationTypeError, SpecError
from isolate.interop.leave import plain_checkpoint
from isolate.interop.migrate import from_finetuning_scheduler, regex_to_glob
from isolate.spec import IsolationSpec, Thaw


def bert(layers: int = 12) -> nn.Module:
    """Parameter names as in a BERT encoder: an 'output.dense' under attention too."""
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.layer = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.attention = nn.Module()
        layer.attention.output = nn.Module()
        layer.attention.output.dense = nn.Linear(2, 2)
        layer.output = nn.Module()
        layer.output.dense = nn.Linear(2, 2)
        model.encoder.layer.append(layer)
    model.classifier = nn.Linear(2, 2)
    root = nn.Module()
    root.model = model
    return root


NAMES = [n for n, _ in bert().named_parameters()] + [
    "model.encoder.layer.1x.output.dense.weight",  # what '.' and '*' would let through
    "model_encoder.layer.1.output.dense.weight",
    "model.encoder.layer.12.output.dense.bias",
]

REGEXES = [
    r"model\.encoder\.layer\.\d+\.output\.dense\..*",
    r"model\.encoder\.layer\.[0-9]+\.output\..*",
    r"model\.encoder\.layer\.\d\.output\.dense\..*",
    r"model\.encoder\.layer\.1[01]\..*",
    r"model\.encoder\.layer\.1\..*",
    r"model.encoder.layer.1.output.dense.weight$",
    r"^model\.classifier\..+",
    r"model\.encoder\.layer\.\d*\.output",
    r"model\.encoder\.layer\.(0|1)\..*",
    r"model\.encoder\.layer\.[!1]\..*",
    r"model\.classifier\.(weight|bias)",
    r"model.classifier",
    r"model\.encoder\.layer\.1.?\.output",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_a_converted_regex_matches_exactly_what_the_regex_matches(regex: str) -> None:
    glob = regex_to_glob(regex)
    if glob is None:
        return  # refused: from_finetuning_scheduler says so (below)
    by_regex = [n for n in NAMES if re.match(regex, n)]
    by_glob = [n for n in NAMES if fnmatch.fnmatchcase(n, glob)]
    assert by_glob == by_regex, glob


def test_repeated_digits_are_refused_not_widened() -> None:
    regex = r"model\.encoder\.layer\.\d+\.output\.dense\..*"
    assert regex_to_glob(regex) is None  # 'layer.*.output.dense.*' also takes attention.output
    assert regex_to_glob(r"model\.layer\.[0-9]+\.w") is None
    assert regex_to_glob(r"model\.layer\.\d\.w") == "model.layer.[0-9].w*"
    fts = {0: {"params": ["model.classifier.weight"]}, 1: {"params": [regex], "lr": 1e-3}}
    with pytest.raises(
        SpecError, match=r"^from_finetuning_scheduler\(\): phase 1: the regex .* has no glob"
    ):
        from_finetuning_scheduler(fts)
    model = bert()
    spec = IsolationSpec.from_dict(from_finetuning_scheduler(fts, model=model))
    handle = spec.apply(model)
    try:
        group = handle.plan.group("phase_1").params
        assert list(group) == [n for n, _ in model.named_parameters() if re.match(regex, n)]
        assert len(group) == 24 and not any("attention" in n for n in group)
    finally:
        handle.restore()


# Each regex and the one glob it becomes, or None where no glob says the same.
GLOBS: dict[str, str | None] = {
    # A class, one of several, one of one character, and last in the pattern.
    r"model\.encoder\.layer\.1[01]\..*": "model.encoder.layer.1[01].*",
    r"layer\.[01]\.[ab]": "layer.[01].[ab]*",
    r"layer\.[1]\.w": "layer.[1].w*",
    r"layer\.[01]": "layer.[01]*",
    # '^' in a class negates it in a regex and is a literal in a glob.
    r"layer\.[^0]\.w": None,
    # A final '$' anchors the glob; a leading '^' is what re.match does anyway.
    r"model.encoder.layer.1.output.dense.weight$": "model?encoder?layer?1?output?dense?weight",
    r"layer\.[0-9]\.w$": "layer.[0-9].w",
    r"^model\.classifier\..+": "model.classifier.?*",
    r"layer\..*\.weight$": "layer.*.weight",
    # An escaped dot or digit last in the pattern, or followed by one character.
    r"model\.classifier\.": "model.classifier.*",
    r"layer\.\d": "layer.[0-9]*",
    r"layer\.\dx": "layer.[0-9]x*",
    r"layer\.\d+": None,
    r"a\-b\_c\/d": "a-b_c/d*",
    # A literal, an escaped dot, a digit and a class each followed by a plain 'X'.
    r"aX\.X\dX[01]X": "aX.X[0-9]X[01]X*",
    # An unknown escape or a lone backslash last (no valid regex), an escaped '$': refused.
    r"a\X": None,
    "a\\": None,
    r"a.b\$": None,
    # A glob the selector grammar would read as an exclusion or a type selector.
    "!x": None,
    "type:Linear": None,
}


def test_each_regex_becomes_its_one_glob_or_is_refused() -> None:
    assert {regex: regex_to_glob(regex) for regex in GLOBS} == GLOBS


def test_the_converter_command_resolves_regexes_on_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bert_factory.py").write_text(
        "from tests.interop.test_migrate_fts import bert\n"
        "def build():\n    return bert(3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        "0:\n  params: [model.classifier.weight, model.classifier.bias]\n"
        "1:\n  params: ['model\\.encoder\\.layer\\.\\d+\\.output\\.dense\\..*']\n  lr: 0.001\n"
    )
    assert main(["migrate", str(schedule)]) == 2
    assert "phase 1: the regex" in capsys.readouterr().err
    assert main(["migrate", str(schedule), "--model", "bert_factory:build"]) == 0
    spec = IsolationSpec.from_dict(yaml.safe_load(capsys.readouterr().out))
    assert spec.thaw[0].selectors == tuple(
        f"model.encoder.layer.{i}.output.dense.{k}" for i in range(3) for k in ("weight", "bias")
    )
    sys.modules.pop("bert_factory", None)


# --------------------------------------------------------------------------------------------
# plain_checkpoint: what configure_optimizers() returns, in every form Lightning takes.


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.trunk(x)))  # type: ignore[no-any-return]


def isolated_checkpoint() -> dict[str, Any]:
    """A checkpoint as the callback writes it, from a plain loop with the same handle."""
    model = Plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", epoch=1, lr=0.01)])
    handle = spec.apply(model)
    with pytest.warns(UserWarning, match="took 2 frozen parameters out"):
        handle.attach(opt, [sched])
    for epoch in range(2):
        handle.step(epoch=epoch, step=epoch)
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "callbacks": {"IsolationCallback": handle.state_dict()},
    }
    handle.restore()
    return checkpoint


def configured(form: str, model: nn.Module) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return {
        "optimizer": opt,
        "list": [opt],
        "dict": {"optimizer": opt, "lr_scheduler": sched},
        "dict-with-config": {"optimizer": opt, "lr_scheduler": {"scheduler": sched}},
        "dict-alone": {"optimizer": opt},
        "list-of-dicts": [{"optimizer": opt, "lr_scheduler": sched}],
        "two-lists": ([opt], [sched]),
        "two-lists-in-a-list": [[opt], [sched]],
    }[form]


@pytest.mark.parametrize(
    "form",
    [
        "optimizer",
        "list",
        "dict",
        "dict-with-config",
        "dict-alone",
        "list-of-dicts",
        "two-lists",
        "two-lists-in-a-list",
    ],
)
def test_plain_checkpoint_takes_what_configure_optimizers_returns(form: str) -> None:
    checkpoint = isolated_checkpoint()
    model = Plain()
    value = configured(form, model)
    rewritten = plain_checkpoint(checkpoint, model, value)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(rewritten["optimizer_states"][0])
    assert [len(g["params"]) for g in opt.param_groups] == [4]
    assert len(opt.state) == 4  # every momentum buffer, by name
    assert rewritten["lr_schedulers"][0]["base_lrs"] == [0.1]
    assert "IsolationCallback" not in rewritten["callbacks"]


def test_plain_checkpoint_refuses_what_holds_no_optimizer() -> None:
    checkpoint = isolated_checkpoint()
    model = Plain()
    with pytest.raises(IsolationTypeError, match=r"^plain_checkpoint\(\): optimizer must be"):
        plain_checkpoint(checkpoint, model, {"optimiser": None})
    with pytest.raises(CheckpointMismatchError, match=r"but 0 optimizers were given"):
        plain_checkpoint(checkpoint, model, None)
    opt = configured("optimizer", model)
    with pytest.raises(CheckpointMismatchError, match=r"but 2 optimizers were given"):
        plain_checkpoint(checkpoint, model, [opt, opt])


# --------------------------------------------------------------------------------------------
# Differential: the same schedule through finetuning-scheduler itself and through the
# converted spec and the callback, on the same model and metric script.


def scripted(base: type, script: list[float]) -> Any:
    """A tiny BERT-shaped LightningModule whose validation loss follows ``script`` by epoch,
    for either Lightning namespace (FTS uses ``lightning.pytorch``, the callback
    ``pytorch_lightning``)."""

    class Scripted(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.model = bert(3).model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            m = self.model
            for layer in m.encoder.layer:
                x = layer.output.dense(torch.tanh(layer.attention.output.dense(x)))
            return m.classifier(x)  # type: ignore[no-any-return]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0]).pow(2).mean()  # type: ignore[no-any-return]

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.tensor(script[self.current_epoch]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

        def train_dataloader(self) -> Any:
            torch.manual_seed(1)
            data = torch.utils.data.TensorDataset(torch.randn(4, 2))
            return torch.utils.data.DataLoader(data, batch_size=2)

        val_dataloader = train_dataloader

    return Scripted


def recorder(base: type, rows: list[Any]) -> Any:
    class Record(base):  # type: ignore[misc, valid-type]
        """What trains, in which param group, with which lr, at the first batch of each epoch."""

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            if i:
                return
            names = {id(p): n for n, p in module.named_parameters()}
            groups = [
                (sorted(names[id(p)] for p in g["params"]), g["lr"])
                for g in trainer.optimizers[0].param_groups
                if g["params"]
            ]
            trainable = sorted(n for n, p in module.named_parameters() if p.requires_grad)
            rows.append((trainer.current_epoch, trainable, sorted(groups)))

    return Record()


def run_fts(
    tmp: Path,
    schedule: dict[int, Any],
    script: list[float],
    *,
    epochs_only: bool,
    patience: int,
    base_max_lr: float,
) -> list[Any]:
    import lightning.pytorch as lp
    from finetuning_scheduler import FinetuningScheduler, FTSCheckpoint, FTSEarlyStopping

    rows: list[Any] = []
    callbacks: list[Any] = [
        FinetuningScheduler(
            ft_schedule={k: dict(v) for k, v in schedule.items()},
            epoch_transitions_only=epochs_only,
            restore_best=False,
            base_max_lr=base_max_lr,
        ),
        FTSCheckpoint(monitor="val_loss", dirpath=tmp / "ckpt", save_top_k=1),
    ]
    if not epochs_only:
        callbacks.append(FTSEarlyStopping(monitor="val_loss", patience=patience))
    callbacks.append(recorder(lp.Callback, rows))
    trainer = lp.Trainer(
        default_root_dir=tmp,
        max_epochs=len(script),
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        limit_train_batches=1,
        limit_val_batches=1,
    )
    torch.manual_seed(0)
    trainer.fit(scripted(lp.LightningModule, script)())
    return rows


def run_isolate(
    tmp: Path,
    schedule: dict[int, Any],
    script: list[float],
    *,
    epochs_only: bool,
    patience: int,
    base_max_lr: float,
    resolve: bool = True,
) -> list[Any]:
    import pytorch_lightning as pl

    from isolate.lightning import IsolationCallback

    torch.manual_seed(0)
    module = scripted(pl.LightningModule, script)()
    spec = from_finetuning_scheduler(
        schedule,
        model=module if resolve else None,  # else regexes become exact globs
        epoch_transitions_only=epochs_only,
        patience=patience,
        base_max_lr=base_max_lr,
    )
    rows: list[Any] = []
    trainer = pl.Trainer(
        default_root_dir=tmp,
        max_epochs=len(script),
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        limit_train_batches=1,
        limit_val_batches=1,
        callbacks=[IsolationCallback(**spec), recorder(pl.Callback, rows)],
    )
    trainer.fit(module)
    return rows


PHASE0 = ["model.classifier.weight", "model.classifier.bias"]
LAYER = r"model\.encoder\.layer\.{}\..*"

SCHEDULES: dict[str, tuple[dict[int, Any], list[float], bool]] = {
    # Plateaus one after another: FTS keeps its best (0.5) across phases: moves at 4, 6, 8.
    "plateaus-keep-their-best": (
        {
            0: {"params": PHASE0},
            1: {"params": [LAYER.format(2)], "lr": 0.01},
            2: {"params": [LAYER.format(1)]},
            3: {"params": [LAYER.format(0)], "lr": 0.003},
        },
        [1.0, 0.5, 0.6, 0.7, 0.65, 0.62, 0.61, 0.60, 0.59, 0.58, 0.57],
        False,
    ),
    # Regexes with repeated digits and a latest epoch that passes before the plateau, and a
    # phase whose latest epoch is already over when it starts: one phase per epoch start.
    "regexes-and-latest-epochs": (
        {
            0: {"params": PHASE0, "max_transition_epoch": 1},
            1: {
                "params": [r"model\.encoder\.layer\.\d+\.output\.dense\..*"],
                "lr": 0.02,
                "max_transition_epoch": 2,
            },
            2: {
                "params": [r"model\.encoder\.layer\.[01]\.attention\..*"],
                "max_transition_epoch": 2,
            },
            3: {
                "params": [
                    r"model\.encoder\.layer\.2\.attention\.output\.dense\.weight",
                    "model.encoder.layer.2.attention.output.dense.bias",
                ],
                "lr": 0.5,
            },
        },
        [1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.7],
        False,
    ),
    # Two phases with the same max_transition_epoch start at consecutive epochs.
    "epoch-transitions-only": (
        {
            0: {"params": PHASE0, "max_transition_epoch": 2},
            1: {"params": [LAYER.format(2)], "lr": 0.01, "max_transition_epoch": 2},
            2: {"params": [LAYER.format(1)], "max_transition_epoch": 4},
            3: {"params": [LAYER.format(0)], "max_transition_epoch": 6},
        },
        [1.0] * 7,
        True,
    ),
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    ("case", "resolve"),
    [(case, True) for case in SCHEDULES]
    + [("plateaus-keep-their-best", False), ("epoch-transitions-only", False)],
    ids=lambda v: v if isinstance(v, str) else ("names" if v else "globs"),
)
def test_a_converted_schedule_thaws_what_finetuning_scheduler_thaws(
    tmp_path: Path, case: str, resolve: bool
) -> None:
    schedule, script, epochs_only = SCHEDULES[case]
    kw = {"epochs_only": epochs_only, "patience": 2, "base_max_lr": 0.001}
    theirs = run_fts(tmp_path / "fts", schedule, script, **kw)
    ours = run_isolate(tmp_path / "isolate", schedule, script, **kw, resolve=resolve)
    # FTS ends the run when its last phase plateaus; the callback trains on.
    assert len(ours) == len(script) and len(theirs) > len(script) // 2
    assert theirs[-1][1] == ours[-1][1]  # every phase reached
    for a, b in zip(theirs, ours, strict=False):
        assert a[:2] == b[:2], f"epoch {a[0]}: trainable"
        assert [g for g, _ in a[2]] == [g for g, _ in b[2]], f"epoch {a[0]}: groups"
        assert [lr for _, lr in a[2]] == pytest.approx([lr for _, lr in b[2]]), a[0]


def test_plateau_phases_keep_the_best_score_and_move_one_per_epoch() -> None:
    """The converted spec alone, driven by hand: FTS moves at epochs 4, 6 and 8 on this
    script (its best, 0.5, carries across phases; only the wait count resets)."""
    schedule, script, _ = SCHEDULES["plateaus-keep-their-best"]
    model = bert(3)
    spec = IsolationSpec.from_dict(from_finetuning_scheduler(schedule, patience=2))
    assert [t.carry_best for t in spec.thaw] == [False, True, True]
    assert [t.after_previous for t in spec.thaw] == [0, 1, 1]
    opt = torch.optim.SGD(model.model.classifier.parameters(), lr=0.1)
    thawed_at: dict[str, int] = {}
    with spec.applied(model, opt) as handle:
        for epoch, loss in enumerate(script):
            for name in handle.step(epoch=epoch, step=epoch):
                thawed_at[name] = epoch
            handle.observe({"val_loss": loss})
    assert thawed_at == {"phase_1": 4, "phase_2": 6, "phase_3": 8}


def test_phases_with_the_same_latest_epoch_start_at_consecutive_epochs() -> None:
    schedule, _, _ = SCHEDULES["epoch-transitions-only"]
    model = bert(3)
    spec = IsolationSpec.from_dict(from_finetuning_scheduler(schedule, epoch_transitions_only=True))
    opt = torch.optim.SGD(model.model.classifier.parameters(), lr=0.1)
    with spec.applied(model, opt) as handle:
        at = {e: handle.step(epoch=e, step=e) for e in range(6)}
    assert at == {0: [], 1: [], 2: ["phase_1"], 3: ["phase_2"], 4: ["phase_3"], 5: []}


def test_carry_best_and_after_previous_are_checked_and_saved() -> None:
    with pytest.raises(SpecError, match=r"carry_best=True, but no thaw before it monitors"):
        IsolationSpec(thaw=[Thaw("a", monitor="val", carry_best=True)])
    with pytest.raises(SpecError, match=r"\['carry_best'\] apply to monitor="):
        Thaw("a", epoch=1, carry_best=True)
    for bad in (-1, 1.5, True):
        with pytest.raises(SpecError, match=r"after_previous must be an integer >= 0"):
            Thaw("a", epoch=1, after_previous=bad)
    spec = IsolationSpec(
        freeze=["model"],
        thaw=[
            Thaw("model.encoder.layer.2", monitor="val", patience=1),
            Thaw(
                "model.encoder.layer.1",
                monitor="val",
                patience=1,
                carry_best=True,
                after_previous=1,
            ),
        ],
    )
    assert IsolationSpec.from_dict(spec.to_dict()) == spec
    model = bert(3)
    opt = torch.optim.SGD(model.model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="frozen parameters out"):
        handle = spec.apply(model, opt)
    try:
        handle.step(epoch=0, step=0)
        assert handle.observe({"val": 0.5}) == []
        assert handle.observe({"val": 0.6}) == ["model.encoder.layer.2"]
        assert handle.step(epoch=1, step=1) == ["model.encoder.layer.2"]
        saved = handle.state_dict()  # the second phase has not seen a value yet
        assert saved["spec"]["thaw"][1]["carry_best"] is True
    finally:
        handle.restore()
    model = bert(3)
    opt = torch.optim.SGD(model.model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="frozen parameters out"):
        resumed = spec.apply(model, opt)
    try:
        resumed.load_state_dict(saved)
        assert resumed.observe({"val": 0.55}) == ["model.encoder.layer.1"]  # 0.5 carried
        assert resumed.step(epoch=1, step=1) == []  # not in the epoch of the thaw before
        assert resumed.step(epoch=2, step=2) == ["model.encoder.layer.1"]
    finally:
        resumed.restore()
