"""Every ``configs/*.yaml`` parses and runs for a few steps on the real MNIST test split, with
the outcome its comment promises; the presets parse, and the DDP preset runs 2 processes.

The data are the 10,000 real images in ``../shared/data`` (read-only); every output and cache
goes to ``tmp_path``.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from experiments.cli import cli_main
from isolate.errors import InplaceModificationError
from tests._launch import REPO, launch
from tests.experiments._shared import SHARED_DATA

CONFIGS = REPO / "configs"
PRESETS = CONFIGS / "presets"

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not (SHARED_DATA / "MNIST" / "raw").is_dir(),
        reason="needs the MNIST test split in ../shared/data beside the repository",
    ),
    pytest.mark.filterwarnings("ignore::experiments.data.TestSplitOnlyWarning"),
    # Lightning 2.6's CLI calls jsonargparse APIs that jsonargparse 4.49 deprecates.
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]

VARIANTS = sorted(CONFIGS.glob("*.yaml"))
STEPS = 3


def _args(config: Path, tmp_path: Path, *more: str) -> list[str]:
    return [
        "--config",
        str(config),
        f"--trainer.max_steps={STEPS}",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--data.data_root={SHARED_DATA}",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--data.download=false",
        "--data.limit_train=512",
        "--data.limit_val=128",
        "--data.limit_test=128",
        f"--record.output={tmp_path / 'run'}",
        *more,
    ]


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fit(config: Path, tmp_path: Path, *more: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """Build everything from the config, remember the trunk, fit and test, as the ``fit``
    subcommand does; returns (cli, trunk before)."""
    cli = cli_main(_args(config, tmp_path, *more), run=False)
    trunk = getattr(cli.model, "trunk", None) or cli.model.encoder
    before = _state(trunk)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
    return cli, before


def _logged(tmp_path: Path, name: str) -> dict[str, list[str]]:
    """The logger's metrics.csv of the run, column by column (empty cells dropped)."""
    (path,) = tmp_path.glob(f"{name}/version_*/metrics.csv")
    rows = list(csv.DictReader(path.read_text().splitlines()))
    return {key: [r[key] for r in rows if r[key]] for key in rows[0]}


def _run_record(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "run" / "run.json").read_text())


def _hooks(module: torch.nn.Module) -> list[str]:
    """Submodules that still carry forward hooks (the recorder's trace must take its off)."""
    return [n for n, m in module.named_modules() if m._forward_hooks or m._forward_pre_hooks]


# What the misplaced Detached of detached_early cuts off: the trunk before its last layer.
CUT_OFF_EARLY = [
    "trunk.0.weight",
    "trunk.1.weight",
    "trunk.1.bias",
    "trunk.4.weight",
    "trunk.5.weight",
    "trunk.5.bias",
]


def test_every_variant_is_a_small_file_with_a_comment() -> None:
    names = {path.stem for path in VARIANTS}
    assert {"baseline", "detached", "attached", "inplace_guarded", "inplace_cloned"} <= names
    assert {"frozen_trunk", "reversal", "simsiam", "simsiam_no_stopgrad"} <= names
    for path in [*VARIANTS, *PRESETS.glob("*.yaml")]:
        text = path.read_text()
        assert text.startswith("#"), f"{path.name} should say what it is for in a comment"
        assert isinstance(yaml.safe_load(text), dict)


@pytest.mark.parametrize("config", VARIANTS, ids=[p.stem for p in VARIANTS])
def test_config_runs_with_the_promised_outcome(config: Path, tmp_path: Path) -> None:
    name = config.stem
    if name == "inplace_guarded":
        cli = cli_main(_args(config, tmp_path), run=False)
        with pytest.raises(InplaceModificationError, match=r"^Detached\(editor\): the branch"):
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        record = _run_record(tmp_path)
        assert record["status"] == "error" and record["steps"] == 0
        assert record["error"]["type"] == "InplaceModificationError"
        assert "cut_off" not in record  # stopped in the sanity check, before any training step
        assert _hooks(cli.model) == []
        return

    cli, before = _fit(config, tmp_path)
    model = cli.model
    record = _run_record(tmp_path)
    assert record["status"] == "ok" and record["steps"] == STEPS
    assert record["name"] == name
    assert all(torch.isfinite(torch.tensor(record["train"]["loss"])))
    after = _state(getattr(model, "trunk", None) or model.encoder)
    moved = sorted(k for k in before if not torch.equal(before[k], after[k]))
    audit = record["audit"]
    assert _hooks(model) == []  # the first forward's trace is gone
    cut_off = record["cut_off"]
    assert cut_off["step"] == 0
    # At step 0 a frozen trunk is not trainable (its flags are restored when fit ends).
    frozen = len(before) - 6 if name.startswith("frozen_trunk") else 0  # less BN buffers
    assert cut_off["trainable"] == len(list(model.parameters())) - frozen

    # The logger is on by default: metrics per step and per epoch, and the test split's.
    logged = _logged(tmp_path, name)
    assert len(logged["train/loss_step"]) == STEPS and len(logged["train/loss_epoch"]) == 1
    test_key = "test/knn_acc" if "knn_acc" in record["test"] else "test/acc/main"
    assert float(logged[test_key][0]) == pytest.approx(record["test"][test_key[5:]], abs=1e-6)

    if hasattr(model, "stop_gradient"):  # SimSiam
        assert model.stop_gradient is (name == "simsiam")
        assert record["train"]["z_std_ref"] == [1 / math.sqrt(64)] * STEPS
        stds = record["train"]["z_std"]
        assert len(stds) == STEPS and len(set(stds)) == STEPS  # measured at every step
        assert moved == sorted(before)  # the encoder trains, BatchNorm statistics too
        # Digits cluster even in features of a barely trained CNN: well above 1 in 10.
        assert record["test"]["knn_acc"] > 0.5
        return
    trunk_params = {n for n, _ in model.trunk.named_parameters()}
    if name == "detached_early":
        # The probe's Detached sits around the trunk's last layer: the layers before it get
        # no gradient from any loss, and the recorder names them with the trace's reason.
        assert list(cut_off["parameters"]) == CUT_OFF_EARLY
        assert all(
            why.endswith("starts again at 'trunk.9.module' (Linear), whose input carries no graph")
            for why in cut_off["parameters"].values()
        )
        assert cut_off["changed"] == []
        weights = {k for k, v in model.trunk.state_dict().items() if v.is_floating_point()}
        weights -= {k for k in weights if "running_" in k}
        assert len(weights) == 8 and sorted(weights & set(moved)) == ["9.bias", "9.weight"]
        assert audit["main"]["trunk"] == audit["probe"]["trunk"] == [2, 8]
        assert audit["ink_probe"]["trunk"] == [0, 8]
        shares = record["gradients"]["groups"]
        assert [g for g, s in shares.items() if s["norm"]["main"] is not None] == [
            "trunk.9",
            "head",
        ]
        return
    assert cut_off["parameters"] == {} and cut_off["changed"] == []
    if name == "frozen_trunk":
        assert moved == []  # weights and BatchNorm statistics, bit for bit
        # The callback restores what it froze when fit ends.
        assert all(p.requires_grad for p in model.trunk.parameters())
        assert audit["main"]["trunk"][0] == 0
        # IsolationCallback logs to the trainer's loggers: its gradient norms are in the CSV.
        norms = {k: v for k, v in logged.items() if k.startswith("isolation/grad_norm/")}
        assert "isolation/grad_norm/total" in norms and all(norms.values())
    elif name == "frozen_trunk_thaw":
        # Thawed before step 2 of 3: the last layer alone moves, and only at that step.
        assert moved == ["9.bias", "9.weight"]
        assert record["thaw"]["step"] == 2 and record["thaw"]["checked_steps"] == [2]
        assert record["thaw"]["world_size"] == 1 and record["thaw"]["differing"] == [0]
        layers = record["drift_layers"]
        assert layers["9"][:2] == [0.0, 0.0] and layers["9"][2] > 0.0
        assert all(layers[k] == [0.0] * STEPS for k in ("0", "1", "4", "5"))
        assert audit["main"]["trunk"] == [0, 8]  # audited at step 0, before the thaw
        assert all(p.requires_grad for p in model.trunk.parameters())
    elif name == "frozen_trunk_naive":
        assert set(moved) == {k for k in before if k not in trunk_params}  # only BatchNorm
        assert all(p.requires_grad for p in model.trunk.parameters())
    else:
        assert trunk_params <= set(moved)
        assert audit["main"]["trunk"] == [len(trunk_params), len(trunk_params)]
    reaching = {"attached", "cloned", "reversal"}
    for spec in model.specs.values():
        reached, total = audit[spec.name]["trunk"]
        assert reached == (total if spec.connect in reaching else 0), spec
        assert audit[spec.name][f"branches.{spec.name}"] == [2, 2]
    if name in {"detached", "inplace_cloned"}:
        assert record["grad_delta"] is None  # no reference given: nothing compared
        assert len(record["grad_norm"]) == STEPS


def test_presets_parse_on_top_of_a_variant(tmp_path: Path) -> None:
    for preset in sorted(PRESETS.glob("*.yaml")):
        cli = cli_main(
            _args(CONFIGS / "baseline.yaml", tmp_path, "--config", str(preset)), run=False
        )
        trainer = cli.trainer
        if preset.stem == "ddp":
            assert type(trainer.strategy).__name__ == "DDPStrategy"
            assert trainer.num_devices == 2
            # detached_early's cut-off trunk must not stop the run (the recorder names it).
            assert trainer.strategy._ddp_kwargs == {"find_unused_parameters": True}
        elif preset.stem == "fsdp":
            assert type(trainer.strategy).__name__ == "ModelParallelStrategy"
            assert trainer.num_devices == 2
            assert trainer.strategy._data_parallel_size == 2
            assert trainer.strategy._tensor_parallel_size == 1
            assert trainer.strategy._save_distributed_checkpoint is False
        elif preset.stem == "quick":
            assert cli.datamodule.hparams.limit_train == 2560
            assert trainer.max_epochs == 1
        elif preset.stem == "fashion_mnist":
            assert cli.datamodule.hparams.dataset == "fashion_mnist"
            assert trainer.max_epochs == 2  # only the dataset differs
        elif preset.stem == "base":  # which every run loads first anyway
            assert trainer.max_epochs == 2
            assert cli.datamodule.hparams.dataset == "mnist"
            assert type(trainer.logger).__name__ == "CSVLogger"
            # Its logs go where the run's other files go (this base.yaml, given again, puts
            # default_root_dir back to outputs/runs; nothing is written without a fit).
            assert trainer.logger.save_dir == trainer.default_root_dir == "outputs/runs"
        else:
            pytest.fail(f"presets/{preset.name} has no check here; add one")


def test_quick_preset_runs(tmp_path: Path) -> None:
    cli = cli_main(
        _args(CONFIGS / "baseline.yaml", tmp_path, "--config", str(PRESETS / "quick.yaml")),
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert _run_record(tmp_path)["steps"] == STEPS


def test_simsiam_stop_gradient_changes_the_gradient_not_the_forward(tmp_path: Path) -> None:
    """The two SimSiam configs see the same first batch, views and weights; only the gradient
    differs, from the first step on, because the targets z are cut off in one of them."""
    records = {}
    for name in ("simsiam", "simsiam_no_stopgrad"):
        folder = tmp_path / name
        cli = cli_main(_args(CONFIGS / f"{name}.yaml", folder, "--record.trunk=encoder"), run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        records[name] = _run_record(folder)
    with_sg, without = records["simsiam"], records["simsiam_no_stopgrad"]
    assert with_sg["train"]["z_std"][0] == without["train"]["z_std"][0]
    assert with_sg["train"]["loss"][0] == without["train"]["loss"][0]
    assert len(with_sg["grad_norm"]) == STEPS
    assert all(a != b for a, b in zip(with_sg["grad_norm"], without["grad_norm"], strict=True))


def test_every_variant_declares_what_the_suite_checks() -> None:
    from experiments.claims import CLAIMS
    from experiments.sections import SECTIONS
    from experiments.variants import load

    for path in VARIANTS:
        variant = load(path)
        assert variant.role, path.name
        assert {c["check"] for c in variant.claims} <= set(CLAIMS), path.name
        assert {s["section"] for s in variant.report} <= set(SECTIONS), path.name


@pytest.mark.slow
def test_ddp_preset_runs_two_processes(tmp_path: Path) -> None:
    args = _args(CONFIGS / "detached.yaml", tmp_path, "--config", str(PRESETS / "ddp.yaml"))
    launch([sys.executable, "-m", "experiments", "fit", *args], cwd=REPO)
    record = _run_record(tmp_path)
    assert record["world_size"] == 2 and record["strategy"] == "DDPStrategy"
    assert record["status"] == "ok" and record["steps"] == STEPS
    assert record["audit"]["probe"]["trunk"][0] == 0
    assert record["audit"]["main"]["trunk"][0] == record["audit"]["main"]["trunk"][1]


def test_a_data_root_holding_the_test_split_is_read_without_a_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A writable copy (unlike ../shared/data): nothing but the CLI's default keeps the
    # datamodule's download=None from fetching the training split at every run.
    copy = tmp_path / "data"
    shutil.copytree(SHARED_DATA / "MNIST" / "raw", copy / "MNIST" / "raw")
    for path in (copy / "MNIST" / "raw").iterdir():
        path.chmod(0o644)
    monkeypatch.setenv("ISOLATE_DATA_ROOT", str(copy))
    requests: list[Any] = []

    def offline(request: Any, *args: Any, **kwargs: Any) -> Any:
        requests.append(request)
        raise OSError("no network in this test")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    args = [
        f"--config={CONFIGS / 'baseline.yaml'}",
        f"--trainer.default_root_dir={tmp_path}",
        f"--record.output={tmp_path / 'run'}",
    ]
    dm = cli_main(args, run=False).datamodule
    assert dm.hparams.download is False
    assert dm.data_root.resolve() == copy.resolve()
    dm.prepare_data()
    dm.setup()
    assert requests == []
    assert dm.split_info["mode"] == "test_split_only"

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("ISOLATE_DATA_ROOT", str(empty))
    # Nothing on disk: the datamodule's own default, a download, stays.
    assert cli_main(args, run=False).datamodule.hparams.download is None
    assert cli_main([*args, "--data.download=true"], run=False).datamodule.download is True


@pytest.mark.parametrize(
    ("typo", "culprit", "meant"),
    [
        ("model:\n  init_args:\n    droput: 0.1\n", "droput", "dropout"),
        ("data:\n  batch_sise: 64\n", "batch_sise", "data.batch_size"),
        (
            "trainer:\n  callbacks:\n    - class_path: isolate.lightning.IsolationCallback\n"
            "      init_args:\n        freze: [trunk]\n",
            "freze",
            "freeze",
        ),
    ],
    ids=["model key", "data key", "callback key"],
)
def test_a_typo_in_a_config_file_is_refused_naming_the_key(
    typo: str, culprit: str, meant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "typo.yaml"
    bad.write_text(typo)
    with pytest.raises(SystemExit) as info:
        cli_main(_args(CONFIGS / "baseline.yaml", tmp_path, "--config", str(bad)), run=False)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert culprit in err and f"did you mean '{meant}'?" in err
    assert len(err.splitlines()) == 2  # the message and where the usage is, not 40 lines of it
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("**/*.ckpt"))
