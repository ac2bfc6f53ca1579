"""The suite, quick mode, on the real MNIST test split: the report is written and shows what
the project claims. Runs are seeded and use deterministic ops, so the values asserted on are
the same at every run; the thresholds are the claims themselves (exactly 0.0, > 0, above
chance), not tuned margins.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import experiments.cli
import experiments.formats
import experiments.model
import experiments.simsiam
from experiments.__main__ import main
from experiments.claims import evaluate_checks
from experiments.model import Branch, IsolationNet
from experiments.suite import _split, run_suite
from experiments.variants import discover, load
from tests._launch import REPO

SHARED_DATA = REPO.parent / "shared" / "data"

VARIANTS = discover()

needs_data = pytest.mark.skipif(
    not (SHARED_DATA / "MNIST" / "raw").is_dir(),
    reason="needs the MNIST test split in ../shared/data beside the repository",
)
pytestmark = [
    pytest.mark.filterwarnings("ignore::experiments.data.TestSplitOnlyWarning"),
    # Lightning 2.6's CLI calls jsonargparse APIs that jsonargparse 4.49 deprecates.
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]
PLOTS = (
    "gradient_delta.png",
    "accuracy.png",
    "drift.png",
    "collapse.png",
    *(f"gradient_shares_{run}.png" for run in ("attached", "detached", "detached_early")),
)
# A few steps are enough where the point is the machinery, not the claims.
FIVE_STEPS = ["--data.limit_train=640", "--data.limit_val=128", "--data.limit_test=128"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    output = tmp_path_factory.mktemp("suite")
    results = run_suite(
        output,
        quick=True,
        data_root=str(SHARED_DATA),
        cache_dir=str(output / "cache"),
        download=False,
    )
    return output, results


def _runs(suite: tuple[Path, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return suite[1]["runs"]


# --------------------------------------------------------------------------------------------
# Pieces that need no data


def test_doctests_of_the_experiment_modules() -> None:
    for module in (experiments.cli, experiments.formats, experiments.model, experiments.simsiam):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_branches_do_not_touch_the_main_random_stream() -> None:
    torch.manual_seed(0)
    plain = IsolationNet()
    torch.manual_seed(0)
    branched = IsolationNet(
        branches=[Branch(name="probe", dropout=0.5), Branch(name="other", connect="attached")]
    )
    for key, value in plain.state_dict().items():
        assert torch.equal(value, branched.state_dict()[key]), key
    images = torch.randn(16, 1, 28, 28)
    torch.manual_seed(1)
    expected = plain._outputs(images)["main"]
    state = torch.get_rng_state()
    torch.manual_seed(1)
    got = branched._outputs(images)  # the probe's dropout draws from its own stream
    assert torch.equal(expected, got["main"])
    assert torch.equal(torch.get_rng_state(), state)


def test_branch_spec_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^Branch\(name='probe'\): connect='plain' is unknown"):
        IsolationNet(branches=[Branch(connect="plain")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"branch names must be unique; repeated: \['probe'\]"):
        IsolationNet(branches=[Branch(), Branch()])
    with pytest.raises(ValueError, match=r"^Branch\(name='probe'\): detach_early=1 needs conn"):
        IsolationNet(branches=[Branch(connect="attached", detach_early=1)])
    with pytest.raises(ValueError, match=r"^Branch\(name='probe'\): detach_early=-1 needs"):
        IsolationNet(branches=[Branch(detach_early=-1)])
    with pytest.raises(ValueError, match=r"detach_early=11 must be at most the trunk's 10 layers"):
        IsolationNet(branches=[Branch(detach_early=11)])
    with pytest.raises(ValueError, match=r"one branch at most may set detach_early.*\['a', 'b'\]"):
        IsolationNet(branches=[Branch(name="a", detach_early=1), Branch(name="b", detach_early=2)])


# The trunk's parameters before its last layer: conv, BatchNorm, conv, BatchNorm.
BEFORE_THE_LAST_LAYER = [
    "trunk.0.weight",
    "trunk.1.weight",
    "trunk.1.bias",
    "trunk.4.weight",
    "trunk.5.weight",
    "trunk.5.bias",
]


def test_a_detach_one_layer_early_cuts_the_layers_before_it_off() -> None:
    import isolate

    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    cut = {}
    for early in (0, 1):
        torch.manual_seed(0)
        net = IsolationNet(branches=[Branch(name="probe", detach_early=early)])
        with isolate.cutoff.trace_forward(net) as trace:
            images_out = net._outputs(images)
            total = torch.nn.functional.cross_entropy(images_out["main"], labels)
            total = total + torch.nn.functional.cross_entropy(images_out["probe"], labels)
        cut[early] = isolate.cutoff.cut_off_parameters(total, net, trace=trace).parameters
        if early:
            assert isinstance(net.trunk[9], isolate.Detached)  # moved from the branch
            assert not isinstance(net.branches["probe"], isolate.Detached)
            # The probe's loss now trains the trunk's last layer, and nothing before it.
            reached = isolate.reachability.reachable_parameters(
                torch.nn.functional.cross_entropy(net._outputs(images)["probe"], labels), net
            )
            assert sorted(n for n in reached if n.startswith("trunk")) == [
                "trunk.9.module.bias",
                "trunk.9.module.weight",
            ]
    assert dict(cut[0]) == {}
    assert list(cut[1]) == BEFORE_THE_LAST_LAYER
    assert cut[1]["trunk.4.weight"].startswith("'trunk.4' (Conv2d) ran, but its output does not")
    assert cut[1]["trunk.4.weight"].endswith(
        "starts again at 'trunk.9.module' (Linear), whose input carries no graph"
    )
    # The same weights, the same names in state_dict: only the placement differs.
    torch.manual_seed(0)
    right = IsolationNet(branches=[Branch(name="probe")]).state_dict()
    torch.manual_seed(0)
    early = IsolationNet(branches=[Branch(name="probe", detach_early=1)]).state_dict()
    assert list(right) == list(early)
    assert all(torch.equal(right[k], early[k]) for k in right)


@needs_data
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_checkpoint_resumes_with_the_branch_streams(tmp_path: Path) -> None:
    from experiments.cli import cli_main

    def cli(epochs: int) -> Any:
        return cli_main(
            [
                f"--config={REPO / 'configs' / 'detached.yaml'}",
                f"--trainer.max_epochs={epochs}",
                "--trainer.enable_checkpointing=true",
                "--trainer.limit_val_batches=1",
                "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={tmp_path}",
                f"--data.data_root={SHARED_DATA}",
                f"--data.cache_dir={tmp_path / 'cache'}",
                "--data.download=false",
                "--data.limit_train=256",  # 2 steps per epoch
                "--data.limit_test=64",
                "--record.verbose=false",
            ],
            run=False,
        )

    first = cli(1)
    first.trainer.fit(first.model, datamodule=first.datamodule)
    (checkpoint,) = tmp_path.glob("*/version_0/checkpoints/*.ckpt")  # the logger's folder
    # Plain types only: the checkpoint loads without unpickling arbitrary objects.
    assert torch.load(checkpoint, weights_only=True)["hyper_parameters"]["branches"][0] == {
        **vars(first.model.specs["probe"])
    }
    loaded = IsolationNet.load_from_checkpoint(checkpoint, weights_only=True)
    assert loaded.specs == first.model.specs
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    for name, state in first.model._branch_rng.items():
        assert torch.equal(loaded._branch_rng[name], state), name

    second = cli(2)
    second.trainer.fit(
        second.model, datamodule=second.datamodule, ckpt_path=checkpoint, weights_only=True
    )
    assert second.trainer.global_step == 4


# --------------------------------------------------------------------------------------------
# The quick suite


@needs_data
@pytest.mark.slow
def test_report_files_are_written(suite: tuple[Path, dict[str, Any]]) -> None:
    output, results = suite
    report = (output / "report.md").read_text()
    for plot in PLOTS:
        assert (output / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
        assert f"({plot})" in report
    assert json.loads((output / "results.json").read_text())["checks"] == results["checks"]
    for section in (
        "## Checks",
        "## Reachability audit",
        "## Frozen trunk",
        "## SimSiam",
        "## Runs stopped by an error",
        "## Gradient reversal: reversal",  # the section the run declares
        "## Parameters cut off from the loss (first step)",
        "## Where each loss sends its gradient (first step)",
        "## Thawing a frozen layer",
    ):
        assert section in report
    assert set(results["runs"]) == {v.name for v in VARIANTS}
    # The reproduce lines of the compared runs read it: kept.
    assert (output / "runs" / "baseline" / "grads.pt").is_file()
    failed = [c for c in results["checks"] if not c["ok"]]
    # gradient_equal gives 2 checks, and so do cut_off naming parameters (they stay put)
    # and thaws (the thawed layer, and the rest of the trunk).
    two = [c for v in VARIANTS for c in v.claims if c["check"] in ("gradient_equal", "thaws")]
    two += [
        c for v in VARIANTS for c in v.claims if c["check"] == "cut_off" and c["expect"] != "none"
    ]
    declared = sum(len(v.claims) for v in VARIANTS)
    assert failed == [] and len(results["checks"]) == declared + len(two) == declared + 4
    # Every run logged its metrics with the logger, per step and per epoch.
    metrics = output / "runs" / "detached" / "detached" / "version_0" / "metrics.csv"
    header = metrics.read_text().splitlines()[0].split(",")
    assert {"train/loss_step", "train/loss_epoch", "val/acc/main", "test/acc/probe"} <= set(header)


@needs_data
@pytest.mark.slow
def test_detached_branches_leave_the_trunk_gradient_exactly_unchanged(
    suite: tuple[Path, dict[str, Any]],
) -> None:
    runs = _runs(suite)
    steps = runs["baseline"]["steps"]
    assert steps > 0
    for name in ("detached", "inplace_cloned"):
        assert runs[name]["grad_delta"] == [0.0] * steps, name
        assert suite[1]["trunk_vs_reference"][name]["bitwise_equal"] is True
        assert runs[name]["test"]["acc/main"] == runs["baseline"]["test"]["acc/main"]
    for name in ("attached", "reversal"):
        deltas = runs[name]["grad_delta"]
        assert len(deltas) == steps and all(d > 0.0 for d in deltas), name
        assert suite[1]["trunk_vs_reference"][name]["bitwise_equal"] is False


@needs_data
@pytest.mark.slow
def test_audit_and_branch_accuracy(suite: tuple[Path, dict[str, Any]]) -> None:
    runs = _runs(suite)
    assert runs["detached"]["audit"]["probe"]["trunk"] == [0, 8]
    assert runs["attached"]["audit"]["probe"]["trunk"] == [8, 8]
    assert runs["reversal"]["audit"]["adversary"]["trunk"] == [8, 8]
    assert runs["reversal"]["audit"]["ink_probe"]["trunk"] == [0, 8]
    for name, branch in (("detached", "probe"), ("inplace_cloned", "editor")):
        chance = runs[name]["chance"][f"acc/{branch}"]
        assert chance < 0.2  # ten digits
        assert runs[name]["test"][f"acc/{branch}"] > 2 * chance, name


@needs_data
@pytest.mark.slow
def test_the_misplaced_detach_is_named_at_step_0_and_the_right_one_cuts_nothing(
    suite: tuple[Path, dict[str, Any]],
) -> None:
    runs = _runs(suite)
    early, right = runs["detached_early"]["cut_off"], runs["detached"]["cut_off"]
    assert list(early["parameters"]) == BEFORE_THE_LAST_LAYER and early["step"] == 0
    assert early["changed"] == []  # no gradient, so Adam leaves them exactly as initialised
    assert right["parameters"] == {} and right["trainable"] == early["trainable"] == 14
    assert runs["detached_early"]["audit"]["main"]["trunk"] == [2, 8]
    # Training looks normal: the main head learns as well as with the trunk training.
    early_acc = runs["detached_early"]["test"]["acc/main"]
    assert early_acc > 5 * runs["detached_early"]["chance"]["acc/main"]
    for run in ("attached", "detached", "detached_early"):
        groups = runs[run]["gradients"]["groups"]
        reached = [g for g, s in groups.items() if s["norm"]["probe"] is not None]
        assert (
            reached
            == {
                "attached": [
                    "trunk.0",
                    "trunk.1",
                    "trunk.4",
                    "trunk.5",
                    "trunk.9",
                    "branches.probe",
                ],
                "detached": ["branches.probe"],
                "detached_early": ["trunk.9", "branches.probe"],
            }[run]
        )
    report = (suite[0] / "report.md").read_text()
    assert "| detached_early | 14 | " + ", ".join(BEFORE_THE_LAST_LAYER) + " | 6 of 6 |" in report
    assert "| detached | 14 | none |  |" in report


@needs_data
@pytest.mark.slow
def test_guarded_inplace_edit_stops_with_its_error(suite: tuple[Path, dict[str, Any]]) -> None:
    record = _runs(suite)["inplace_guarded"]
    assert record["status"] == "error" and record["steps"] == 0
    assert record["error"]["type"] == "InplaceModificationError"
    assert record["error"]["message"].startswith("Detached(editor): the branch edited input 0")


@needs_data
@pytest.mark.slow
def test_frozen_trunk_does_not_drift(suite: tuple[Path, dict[str, Any]]) -> None:
    runs = _runs(suite)
    frozen, naive = runs["frozen_trunk"], runs["frozen_trunk_naive"]
    steps = frozen["steps"]
    for kind in ("parameters", "buffers", "counters"):
        assert frozen["drift"][kind] == [0.0] * steps, kind
    assert frozen["drift_final"]["moved"] == {}
    assert len(frozen["drift_final"]["checked"]) == 14  # 8 parameters, 6 BatchNorm buffers
    assert naive["drift"]["parameters"] == [0.0] * steps
    assert all(d > 0.0 for d in naive["drift"]["buffers"])  # requires_grad alone: BN moves
    assert frozen["test"]["acc/main"] > frozen["chance"]["acc/main"]


@needs_data
@pytest.mark.slow
def test_the_thawed_layer_alone_moves_and_only_after_its_thaw(
    suite: tuple[Path, dict[str, Any]],
) -> None:
    run = _runs(suite)["frozen_trunk_thaw"]
    steps, layers = run["steps"], run["drift_layers"]
    assert run["thaw"]["step"] == 2 and steps == 20
    assert sorted(layers) == ["0", "1", "4", "5", "9"]
    assert layers["9"][:2] == [0.0, 0.0] and all(d > 0.0 for d in layers["9"][2:])
    assert all(layers[k] == [0.0] * steps for k in ("0", "1", "4", "5"))
    assert run["drift"]["buffers"] == run["drift"]["counters"] == [0.0] * steps
    assert sorted(run["drift_final"]["moved"]) == ["9.bias", "9.weight"]
    # One process: every step from the thaw on is checked, and trivially identical.
    assert run["thaw"]["world_size"] == 1 and run["thaw"]["parameters"] == 10
    assert run["thaw"]["checked_steps"] == list(range(2, steps))
    assert run["thaw"]["differing"] == [0] * (steps - 2)


@needs_data
@pytest.mark.slow
def test_simsiam_collapses_without_the_stop_gradient(suite: tuple[Path, dict[str, Any]]) -> None:
    runs = _runs(suite)
    with_sg = runs["simsiam"]["train"]["z_std"]
    without = runs["simsiam_no_stopgrad"]["train"]["z_std"]
    reference = runs["simsiam"]["train"]["z_std_ref"][-1]
    assert with_sg[-1] > 0.5 * reference
    assert without[-1] < 0.5 * with_sg[-1]
    assert without[-1] < without[0]


def _suite_in_processes(tmp_path: Path, *flags: str) -> dict[str, Any]:
    """``suite --quick`` with ``flags`` in a fresh process (it starts the runs' processes);
    returns its ``results.json``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments",
            "suite",
            "--quick",
            *flags,
            f"--output={tmp_path / 'suite'}",
            f"--data.data_root={SHARED_DATA}",
            f"--data.cache_dir={tmp_path / 'cache'}",
            "--data.download=false",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "suite" / "results.json").read_text())


@needs_data
@pytest.mark.slow
def test_suite_under_ddp_reaches_the_same_conclusions(tmp_path: Path) -> None:
    results = _suite_in_processes(tmp_path, "--ddp", "--only=detached,attached,detached_early")
    runs = results["runs"]
    assert {r["world_size"] for r in runs.values()} == {2}
    steps = runs["baseline"]["steps"]
    assert steps > 0
    assert runs["detached"]["grad_delta"] == [0.0] * steps
    assert all(d > 0.0 for d in runs["attached"]["grad_delta"])
    assert results["trunk_vs_reference"]["detached"]["bitwise_equal"] is True
    # The cut-off trunk runs to the end under DDP too (find_unused_parameters), and is named.
    assert list(runs["detached_early"]["cut_off"]["parameters"]) == BEFORE_THE_LAST_LAYER
    assert runs["detached_early"]["cut_off"]["changed"] == []
    assert all(check["ok"] for check in results["checks"])


@needs_data
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["--ddp", "--fsdp"])
def test_ranks_are_identical_after_a_thaw_on_two_processes(tmp_path: Path, strategy: str) -> None:
    results = _suite_in_processes(tmp_path, strategy, "--only=frozen_trunk_thaw")
    run = results["runs"]["frozen_trunk_thaw"]
    steps = run["steps"]
    assert run["world_size"] == 2 and steps == 10  # each process sees half the batches
    assert run["thaw"]["step"] == 2 and run["thaw"]["world_size"] == 2
    assert run["thaw"]["checked_steps"] == list(range(2, steps))
    assert run["thaw"]["differing"] == [0] * (steps - 2)
    layers = run["drift_layers"]
    assert layers["9"][:2] == [0.0, 0.0] and all(d > 0.0 for d in layers["9"][2:])
    assert all(layers[k] == [0.0] * steps for k in ("0", "1", "4", "5"))
    mine = [c for c in results["checks"] if c["variant"] == "frozen_trunk_thaw"]
    assert all(c["ok"] for c in mine) and len(mine) == 5
    ranks = next(c for c in mine if c["check"].startswith("every process"))
    assert ranks["observed"] == (
        f"{steps - 2}/{steps - 2} steps with all 10 parameters bitwise equal on 2 processes; "
        "most differing: 0"
    )


@needs_data
@pytest.mark.slow
def test_suite_under_fsdp2_reaches_the_same_conclusions(tmp_path: Path) -> None:
    only = "--only=detached,attached,frozen_trunk,simsiam"
    results = _suite_in_processes(tmp_path, "--fsdp", only)
    runs = results["runs"]
    assert {(r["strategy"], r["world_size"]) for r in runs.values()} == {
        ("ModelParallelStrategy", 2)
    }
    steps = runs["baseline"]["steps"]
    assert steps > 0
    assert runs["baseline"]["trunk_tensors"]["sharded"] == 8  # every trunk parameter
    # Whole gradients, gathered from the shards, not this process's shard of them.
    grads = torch.load(tmp_path / "suite" / "runs" / "baseline" / "grads.pt")
    assert grads.shape == (steps, sum(p.numel() for p in IsolationNet().trunk.parameters()))
    assert runs["detached"]["grad_delta"] == [0.0] * steps
    assert len(runs["attached"]["grad_delta"]) == steps
    assert all(d > 0.0 for d in runs["attached"]["grad_delta"])
    assert results["trunk_vs_reference"]["detached"]["bitwise_equal"] is True
    drift = runs["frozen_trunk"]["drift"]
    assert drift == {kind: [0.0] * steps for kind in ("parameters", "buffers", "counters")}
    assert runs["baseline"]["drift"]["parameters"][-1] > 0.0  # the same measure moves there
    assert all(check["ok"] for check in results["checks"]) and len(results["checks"]) == 12
    # SimSiam has no configure_model: not run, and said so, with no check of its own.
    assert list(results["skipped"]) == ["simsiam"]
    assert "configure_model" in results["skipped"]["simsiam"]
    report = (tmp_path / "suite" / "report.md").read_text()
    assert "(FSDP2 (Lightning's ModelParallelStrategy), 2 CPU processes, 1 thread(s) each" in report
    assert "## Not run" in report and "`python -m experiments suite --quick --fsdp`" in report


@pytest.mark.skipif(
    not Path("/usr/share/datasets/fashion-mnist").is_dir(),
    reason="Fashion-MNIST comes from Debian's dataset-fashion-mnist package (.ci/run installs it)",
)
def test_the_same_suite_runs_on_fashion_mnist(tmp_path: Path) -> None:
    results = run_suite(
        tmp_path,
        quick=True,
        only=["baseline", "detached"],
        data_root=str(SHARED_DATA),  # holds no Fashion-MNIST: Debian's copy is found
        cache_dir=str(tmp_path / "cache"),
        dataset="fashion_mnist",
        overrides=["--data.limit_train=1280"],
    )
    assert results["setup"]["data"]["split"]["dataset"] == "fashion_mnist"
    assert results["setup"]["data"]["split"]["mode"] == "official"
    detached = results["runs"]["detached"]
    assert detached["status"] == "ok"
    assert all(check["ok"] for check in results["checks"]), results["checks"]
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Gradient isolation on Fashion-MNIST")
    assert "--data.dataset=fashion_mnist" in report


# --------------------------------------------------------------------------------------------
# Variants declare themselves


def _fake_results(**runs: dict[str, Any]) -> dict[str, Any]:
    """Results with declarations taken from the real configs, and the given records."""
    by_name = {v.name: v for v in VARIANTS}
    return {
        "runs": runs,
        "variants": {name: by_name[name].declaration() for name in runs},
        "trunk_vs_reference": {},
    }


def test_each_config_declares_its_role_claims_and_report() -> None:
    names = [v.name for v in VARIANTS]
    assert names[0] == "baseline"  # the run others are compared with goes first
    assert sorted(names) == sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    for variant in VARIANTS:
        assert variant.role and variant.claims, variant.name
    guarded = {v.name: v for v in VARIANTS}["inplace_guarded"]
    assert guarded.expect_error == "InplaceModificationError"
    assert {v.name for v in VARIANTS if v.compare_with == "baseline"} >= {"detached", "attached"}


def test_a_declaration_with_an_unknown_field_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("# bad\nvariant:\n  role: x\n  claim: []\n")
    with pytest.raises(ValueError, match=r"^bad.yaml: 'variant:' has unknown fields \['claim'\]"):
        load(bad)
    bad.write_text("# bad\nmodel: {}\n")
    with pytest.raises(ValueError, match=r"^bad.yaml: no 'variant:' block"):
        load(bad)


def test_no_variant_name_in_the_suite_or_report_code() -> None:
    code = "".join(
        (REPO / "experiments" / f"{m}.py").read_text()
        for m in ("suite", "report", "claims", "sections", "variants")
    )
    for variant in VARIANTS:
        assert not re.search(rf"[\"']{variant.name}[\"']", code), variant.name
    assert 'startswith("frozen")' not in code and 'SimSiam"' not in code


def test_claims_fail_when_the_run_breaks_them() -> None:
    steps = 3
    good = {"status": "ok", "steps": steps, "grad_delta": [0.0] * steps}
    base = {"status": "ok", "steps": steps, "audit": {"main": {"trunk": [8, 8]}}}
    results = _fake_results(baseline=base, detached=dict(good))
    results["trunk_vs_reference"] = {"detached": {"bitwise_equal": True, "max_delta": 0.0}}
    results["runs"]["detached"]["audit"] = {
        "probe": {"trunk": [0, 8]},
        "ink_probe": {"trunk": [0, 8]},
    }
    results["runs"]["detached"]["test"] = {"acc/probe": 0.5}
    results["runs"]["detached"]["chance"] = {"acc/probe": 0.11}
    results["runs"]["detached"]["cut_off"] = {"trainable": 14, "parameters": {}, "unseen": []}
    assert [c["ok"] for c in evaluate_checks(results)] == [True] * 7
    # One step off by the smallest amount, one parameter reached, a probe at chance, one
    # parameter cut off.
    results["runs"]["detached"]["grad_delta"] = [0.0, 1e-30, 0.0]
    results["runs"]["detached"]["audit"]["probe"]["trunk"] = [1, 8]
    results["runs"]["detached"]["test"] = {"acc/probe": 0.11}
    results["runs"]["detached"]["cut_off"]["parameters"] = {"head.2.bias": "why"}
    checks = evaluate_checks(results)
    assert [c["ok"] for c in checks] == [True, False, True, False, False, True, False]
    assert checks[6]["observed"] == "head.2.bias"
    assert checks[1]["observed"] == "2/3 steps exactly 0.0, max|Δ| = 1e-30"
    # A run that should finish and crashed: one failed check instead of its claims.
    results["runs"]["detached"] = {"status": "error", "error": {"type": "crash", "message": "x"}}
    assert [(c["check"], c["ok"]) for c in evaluate_checks(results)[1:]] == [
        ("the run finishes", False)
    ]
    results["variants"]["detached"]["claims"] = [{"check": "teleports"}]
    results["runs"]["detached"] = dict(good)
    with pytest.raises(ValueError, match=r"^detached: unknown claim 'teleports'"):
        evaluate_checks(results)


def test_the_recorder_takes_its_trace_off_when_the_first_step_fails(tmp_path: Path) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from experiments.recording import Recorder

    class FailsAfterTheTrunk(IsolationNet):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.trunk(batch[0])  # traced
            raise RuntimeError("the step failed")

    model = FailsAfterTheTrunk()
    data = TensorDataset(torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)))
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        callbacks=[Recorder(output=str(tmp_path / "run"), verbose=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    with pytest.raises(RuntimeError, match=r"^the step failed$"):
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=4))
    assert [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks] == []
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "error" and "cut_off" not in record


def test_cut_off_claims_name_exactly_the_parameters() -> None:
    why = {name: "no path" for name in BEFORE_THE_LAST_LAYER}
    early = {
        "status": "ok",
        "cut_off": {"trainable": 14, "parameters": why, "unseen": [], "changed": []},
        "test": {"acc/main": 0.85},
        "chance": {"acc/main": 0.116},
    }
    results = _fake_results(detached_early=early)
    checks = evaluate_checks(results)
    assert [(c["check"], c["ok"]) for c in checks] == [
        ("exactly these parameters are cut off from the loss at step 0 (graph audit)", True),
        ("the cut-off parameters keep their step-0 values to the end", True),
        ("the main head learns", True),
    ]
    assert checks[0]["observed"] == checks[0]["expected"] == ", ".join(BEFORE_THE_LAST_LAYER)
    assert checks[1]["observed"] == "6 of 6 bitwise unchanged"
    # One too few, one too many, one that moved, one the walk cannot see: each fails.
    for parameters, unseen, changed in (
        (BEFORE_THE_LAST_LAYER[:-1], [], []),
        ([*BEFORE_THE_LAST_LAYER, "trunk.9.module.bias"], [], []),
        (BEFORE_THE_LAST_LAYER, [], ["trunk.1.bias"]),
        (BEFORE_THE_LAST_LAYER, ["head.2.bias"], []),
    ):
        early["cut_off"] = {
            "trainable": 14,
            "parameters": dict.fromkeys(parameters, "no path"),
            "unseen": unseen,
            "changed": changed,
        }
        ok = [c["ok"] for c in evaluate_checks(results)][:2]
        assert ok == ([True, False] if changed else [False, True]), (parameters, unseen)
    assert evaluate_checks(results)[0]["observed"].endswith("; cannot be seen: head.2.bias")
    early["cut_off"]["unseen"], early["cut_off"]["changed"] = [], ["trunk.1.bias"]
    assert evaluate_checks(results)[1]["observed"] == (
        "5 of 6 bitwise unchanged; changed: trunk.1.bias"
    )
    del early["cut_off"]  # not audited: no claim passes by default
    assert [c["observed"] for c in evaluate_checks(results)][:2] == ["not audited", "n/a"]
    assert [c["ok"] for c in evaluate_checks(results)][:2] == [False, False]
    results["variants"]["detached_early"]["claims"] = [{"check": "cut_off", "expect": "all"}]
    with pytest.raises(ValueError, match=r"^cut_off: expect='all' must be 'none' or a list"):
        evaluate_checks(results)


def test_the_cut_off_and_gradient_sections_draw_what_the_recorder_measured(
    tmp_path: Path,
) -> None:
    import isolate
    from experiments.recording import _figure_groups, _groups
    from experiments.sections import gradient_report_of, render_declared

    records = {}
    for name, early in (("detached", 0), ("detached_early", 1)):
        torch.manual_seed(0)
        net = IsolationNet(branches=[Branch(name="probe", detach_early=early)])
        outputs, labels = net._outputs(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))
        losses = {k: torch.nn.functional.cross_entropy(v, labels) for k, v in outputs.items()}
        total = losses["main"] + losses["probe"]
        cut = isolate.cutoff.cut_off_parameters(total, net)
        report = isolate.gradient_report(
            losses, net, groups=_figure_groups(net, "trunk", _groups(net))
        )
        data = json.loads(json.dumps(experiments.formats.jsonable(report.to_dict())))
        assert str(gradient_report_of(data)) == str(report)  # the round trip through run.json
        records[name] = {
            "status": "ok",
            "test": {"acc/main": 0.5},
            "cut_off": {
                "trainable": cut.trainable,
                "parameters": dict(cut.parameters),
                "unseen": [],
                "changed": [],
            },
            "gradients": data,
        }
    lines = render_declared(_fake_results(**records), tmp_path)
    text = "\n".join(lines)
    for name in records:
        png = tmp_path / f"gradient_shares_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in text
    assert "| detached | 12 | none |  | 0.500 |" in text
    assert f"| detached_early | 12 | {', '.join(BEFORE_THE_LAST_LAYER)} | 6 of 6 | 0.500 |" in text
    # Without a trace, one reason for all six: one row.
    assert f"| detached_early | {', '.join(BEFORE_THE_LAST_LAYER)} | no path from any loss" in text
    assert "| detached | probe | no path | 0 of 5 | branches.probe |" in text
    assert re.search(r"\| detached_early \| main \| 9\d\.\d% \| 1 of 5 \| trunk\.9, head \|", text)


def test_frozen_and_collapse_claims_read_the_declared_series() -> None:
    zeros = {"parameters": [0.0, 0.0], "buffers": [0.0, 0.0], "counters": [0.0, 0.0]}
    moved = {"parameters": [0.0, 0.0], "buffers": [0.0, 0.5], "counters": [1.0, 2.0]}
    frozen = {
        "status": "ok",
        "drift": zeros,
        "test": {"acc/main": 0.6},
        "chance": {"acc/main": 0.1},
    }
    naive = {"status": "ok", "drift": moved}
    siam = {"status": "ok", "train": {"z_std": [0.1, 0.11], "z_std_ref": [0.125, 0.125]}}
    collapsed = {"status": "ok", "train": {"z_std": [0.1, 0.02], "z_std_ref": [0.125, 0.125]}}
    results = _fake_results(
        frozen_trunk=frozen, frozen_trunk_naive=naive, simsiam=siam, simsiam_no_stopgrad=collapsed
    )
    assert all(c["ok"] for c in evaluate_checks(results))
    frozen["drift"] = {**zeros, "counters": [0.0, 1.0]}  # the counter moved once
    collapsed["train"]["z_std"] = [0.1, 0.06]  # more than half of simsiam's 0.11
    failed = [(c["variant"], c["check"]) for c in evaluate_checks(results) if not c["ok"]]
    assert failed == [
        ("frozen_trunk", "BatchNorm running statistics and num_batches_tracked never move"),
        ("simsiam_no_stopgrad", "the output collapses: its spread falls far below simsiam's"),
    ]


def test_thaw_and_rank_claims_fail_when_the_run_breaks_them() -> None:
    steps = 5
    record: dict[str, Any] = {
        "status": "ok",
        "drift": {"parameters": [0.0] * steps, "buffers": [0.0] * steps, "counters": [0.0] * steps},
        "drift_layers": {
            "0": [0.0] * steps,
            "1": [0.0] * steps,
            "9": [0.0, 0.0, 0.1, 0.2, 0.3],
        },
        "thaw": {
            "step": 2,
            "world_size": 2,
            "parameters": 10,
            "checked_steps": [2, 3, 4],
            "differing": [0, 0, 0],
        },
        "test": {"acc/main": 0.6},
        "chance": {"acc/main": 0.1},
    }
    results = _fake_results(frozen_trunk_thaw=record)
    checks = evaluate_checks(results)
    assert all(c["ok"] for c in checks) and len(checks) == 5
    ranks = checks[3]
    assert ranks["observed"] == (
        "3/3 steps with all 10 parameters bitwise equal on 2 processes; most differing: 0"
    )
    record["drift_layers"]["9"] = [0.0, 0.1, 0.1, 0.2, 0.3]  # moved before its thaw
    record["drift_layers"]["1"] = [0.0, 0.0, 0.0, 0.0, 1e-9]  # a frozen layer moved
    record["thaw"]["differing"] = [0, 1, 0]  # one parameter differed on a process at step 3
    failed = [c["check"] for c in evaluate_checks(results) if not c["ok"]]
    assert failed == [
        "trunk.9 is still before its thaw and moves from then on",
        "the rest of the trunk (2 layers) never moves",
        "every process holds the same full parameters after the thaw",
    ]
    # One process: trivially identical, and said so; no step after a thaw is no pass.
    record["thaw"] = {**record["thaw"], "world_size": 1, "differing": [0, 0, 0]}
    (ranks,) = [c for c in evaluate_checks(results) if c["check"].startswith("every process")]
    assert (
        ranks["ok"]
        and ranks["observed"] == "1 process: trivially identical (3 steps after the thaw)"
    )
    record["drift_layers"] = {**record["drift_layers"], "1": [0.0] * steps, "9": [0.0] * steps}
    record["thaw"] = {**record["thaw"], "step": None, "checked_steps": [], "differing": []}
    failed = [c["check"] for c in evaluate_checks(results) if not c["ok"]]
    assert failed == [
        "trunk.9 is still before its thaw and moves from then on",
        "every process holds the same full parameters after the thaw",
    ]


def test_a_new_variant_is_one_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(REPO / "configs" / "baseline.yaml", configs)
    (configs / "two_probes.yaml").write_text(
        "# Two detached probes on the digit.\n"
        "model:\n  class_path: experiments.model.IsolationNet\n  init_args:\n    branches:\n"
        "      - {name: first, connect: detached}\n      - {name: second, connect: detached}\n"
        "variant:\n  role: two detached probes\n  compare_with: baseline\n  claims:\n"
        "    - {check: gradient_equal}\n    - {check: reaches, loss: second, expect: none}\n"
    )
    monkeypatch.chdir(REPO)
    results = run_suite(
        tmp_path / "suite",
        quick=True,
        only=["two_probes"],
        variants=discover(configs),
        data_root=str(SHARED_DATA),
        cache_dir=str(tmp_path / "cache"),
        overrides=FIVE_STEPS,
    )
    assert list(results["runs"]) == ["baseline", "two_probes"]
    checks = [(c["variant"], c["check"], c["ok"]) for c in results["checks"]]
    assert checks == [
        ("baseline", "the main loss reaches every trunk parameter (graph audit)", True),
        ("two_probes", "trunk gradient equals the compared run's at every step", True),
        (
            "two_probes",
            "final trunk weights and BatchNorm statistics equal the compared run's",
            True,
        ),
        ("two_probes", "the second loss reaches no trunk parameter (graph audit)", True),
    ]
    assert (
        "| two_probes | two detached probes | ok | 5 |"
        in (tmp_path / "suite" / "report.md").read_text()
    )


# --------------------------------------------------------------------------------------------
# The command line


def test_help_lists_the_suite_and_names_the_program(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "usage: python -m experiments [-c CONFIG] {fit,validate,test,predict,suite}"
    )
    assert re.search(r"^    suite +Run every variant in configs/", out, flags=re.M)
    assert "__main__" not in out
    with pytest.raises(SystemExit) as info:
        main(["suite", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m experiments suite")
    for option in ("--data.data_root", "--data.download", "--data.dataset", "--threads"):
        assert option in out


def test_fit_without_a_config_says_which_flag_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fit"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "python -m experiments: error: fit needs a model: pass a variant's config, e.g. "
        "python -m experiments fit --config configs/detached.yaml (variants in configs/: "
        "attached, baseline,"
    )
    assert len(err.splitlines()) == 2  # the message and where the full usage is


def test_a_misspelt_subcommand_or_option_gets_a_suggestion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["fitt"])
    assert "invalid choice: 'fitt'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(REPO / "configs" / "baseline.yaml"), "--data.batch_sise=3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "python -m experiments fit: error: unrecognized arguments: --data.batch_sise=3; "
        "did you mean 'data.batch_size'?"
    )


def test_an_unknown_variant_is_refused_with_a_suggestion(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["suite", "--only=detachd", f"--output={tmp_path}"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(
        "python -m experiments suite: error: unknown variants ['detachd']; did you mean "
        "['detached']?; choose from ['attached', 'baseline',"
    )
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


def test_suite_options_are_spelled_like_fits_and_the_old_ones_still_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    mine, runs = _split(
        ["--quick", "--data.data_root=x", "--data.limit_train=64", "--trainer.max_steps", "3"]
    )
    assert mine == ["--quick", "--data.data_root=x"]
    assert runs == ["--data.limit_train=64", "--trainer.max_steps=3"]
    mine, runs = _split(["--data-root", "x", "--no-download", "--no-progress-bar"])
    assert mine == ["--data.data_root", "x", "--data.download=false"]
    assert runs == ["--trainer.enable_progress_bar=false"]
    err = capsys.readouterr().err
    assert "--data-root is deprecated; use --data.data_root" in err


@pytest.mark.parametrize("command", ["fit", "suite"])
def test_missing_data_is_one_message_with_the_flag_to_pass(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [
        f"--data.data_root={empty}",
        "--data.download=false",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    if command == "fit":
        args += [
            "--config",
            str(REPO / "configs" / "baseline.yaml"),
            f"--trainer.default_root_dir={tmp_path / 'runs'}",
        ]
    else:
        args += [f"--output={tmp_path / 'suite'}"]
    assert main([command, *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m experiments: data error: ")
    assert "--data.download=true" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) < 10  # the data module's message: what, where, fix


# --------------------------------------------------------------------------------------------
# Reproduce lines


@needs_data
@pytest.mark.slow
def test_a_reproduce_line_run_as_printed_gives_the_suites_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the suite's working directory, where the line is run from
    output = tmp_path / "suite"
    results = run_suite(
        output,
        quick=True,
        only=["attached"],
        data_root=str(SHARED_DATA),
        cache_dir=str(tmp_path / "cache"),
    )
    expected = results["runs"]["attached"]
    line = (output / "runs" / "attached" / "command.txt").read_text()
    assert line.startswith("python -m experiments fit --config configs/attached.yaml")
    assert "--threads=1" in line and "--record.reference=" in line
    (output / "runs" / "attached" / "run.json").unlink()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # --threads says it
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    env.pop("ISOLATE_DATA_ROOT", None)
    done = subprocess.run(
        ["sh", "-c", line],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    again = json.loads((output / "runs" / "attached" / "run.json").read_text())
    again.pop("seconds")
    for key in ("grad_delta", "grad_norm", "train", "val", "test", "drift", "steps"):
        assert again[key] == expected[key], key
    assert all(d > 0 for d in again["grad_delta"])  # it compared with the baseline's grads.pt
