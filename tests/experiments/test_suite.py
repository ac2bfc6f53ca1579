"""The suite, quick mode, on the real MNIST test split: the report is written and shows what
the project claims. Runs are seeded and use deterministic ops, so the values asserted on are
the same at every run; the thresholds are the claims themselves (exactly 0.0, > 0, above
chance), not tuned margins.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import isolate
from experiments.model import IsolationNet
from experiments.suite import run_suite
from isolate import IsolationSpec
from tests._launch import REPO, child_env
from tests.experiments._shared import (
    BEFORE_THE_LAST_LAYER,
    SHARED_DATA,
    VARIANTS,
    needs_data,
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
def test_the_frozen_trunk_run_is_certified_from_its_first_and_last_weights(
    suite: tuple[Path, dict[str, Any]],
) -> None:
    output, results = suite
    cert = results["runs"]["frozen_trunk"]["certificate"]
    assert cert["clean"] is True and cert["file"] == "certificate.json"
    assert cert["summary"] == [
        "trunk: 8 frozen, bitwise unchanged; 6 held, bitwise unchanged",
        "head: 2 trainable, moved",
    ]
    written = json.loads((output / "runs" / "frozen_trunk" / "certificate.json").read_text())
    assert written["clean"] is True
    assert "certificate" not in results["runs"]["frozen_trunk_naive"]  # it declares none
    report = (output / "report.md").read_text()
    assert "| frozen_trunk | clean | trunk: 8 frozen, bitwise unchanged" in report
    assert "[certificate.json](runs/frozen_trunk/certificate.json)" in report
    # The certificate sees a change of one bit in a frozen tensor of the last weights.
    last = torch.load(output / "runs" / "frozen_trunk" / "last.pt", weights_only=True)
    last["trunk.0.weight"].view(-1).view(torch.int32)[0] ^= 1
    torch.save(last, output / "tampered.pt")
    spec = IsolationSpec(freeze=["trunk"], mode="eval")
    first = output / "runs" / "frozen_trunk" / "first.pt"
    tampered = isolate.certify(first, output / "tampered.pt", spec=spec)
    assert not tampered.clean and "trunk.0.weight" in str(tampered)


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
        env=child_env(),
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
    assert all(check["ok"] for check in results["checks"]) and len(results["checks"]) == 16
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
    env = child_env()
    env.pop("OMP_NUM_THREADS")  # --threads says it
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
