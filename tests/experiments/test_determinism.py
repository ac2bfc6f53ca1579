"""Two runs with the same options give the same bytes: the suite's report (``report.md``,
``results.json``, the PNG plots) and a single ``fit``'s final weights.

Each pair runs as two ``python -m experiments`` processes side by side, with different
``PYTHONHASHSEED`` values, so that what one process could hide (string hashing, set order,
state left over from a first run) shows up as a difference. The report must also hold no
wall-clock time (``timings.json`` does) and no absolute path.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._launch import REPO, child_env
from tests.experiments._shared import SHARED_DATA

pytestmark = pytest.mark.skipif(
    not (SHARED_DATA / "MNIST" / "raw").is_dir(),
    reason="needs the MNIST test split in ../shared/data beside the repository",
)

REPORT_FILES = (
    "report.md",
    "results.json",
    "gradient_delta.png",
    "accuracy.png",
    "drift.png",
    "collapse.png",
)
# Every variant, at 5 steps instead of the quick preset's 20: the point is the bytes, not
# the claims. At this length exactly these checks fail, the same way in both runs, so the
# suite exits with status 1 (a failed check), not with a crash.
SMALL = ("--data.limit_train=640", "--data.limit_val=128", "--data.limit_test=128")
FAILING_AT_5_STEPS = [
    "FAILED detached: the probe branch learns: ",
    "FAILED inplace_cloned: the editor branch learns: ",
    "FAILED simsiam_no_stopgrad: the output collapses: its spread falls far below simsiam's: ",
]
# An absolute path: a slash at the start of a word, then at least one more component.
ABSOLUTE = re.compile(r"(?:^|[\s\"'`(=:])/[\w.-]+/")
WALL_CLOCK = re.compile(r"\d(?:\.\d+)? ?s\b|\bseconds\b")


def _env(hash_seed: int) -> dict[str, str]:
    env = child_env({"PYTHONHASHSEED": str(hash_seed)})
    env.pop("ISOLATE_DATA_ROOT", None)
    return env


def _twice(commands: Sequence[Sequence[str]]) -> list[tuple[int, str]]:
    """Run each command of the pair at the same time, from the repository, and wait for both;
    returns each one's exit status and output."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "experiments", *command],
            cwd=REPO,
            env=_env(hash_seed),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for hash_seed, command in enumerate(commands, 1)
    ]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for output in outputs:
        assert "Traceback" not in output, output[-4000:]
    return [(proc.returncode, output) for proc, output in zip(procs, outputs, strict=True)]


@pytest.fixture(scope="module")
def suites(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folders = [tmp_path_factory.mktemp(f"suite_{run}") for run in "ab"]
    done = _twice(
        [
            [
                "suite",
                "--quick",
                f"--output={folder / 'report'}",
                f"--data.data_root={SHARED_DATA}",  # absolute: the report shows it relative
                f"--data.cache_dir={folder / 'cache'}",  # another per run: not in the report
                "--trainer.enable_progress_bar=false",
                *SMALL,
            ]
            for folder in folders
        ]
    )
    for code, output in done:
        # 1 is also what a crash gives: the exact failed checks tell them apart.
        assert code == 1, output[-4000:]
        failed = [line.strip() for line in output.splitlines() if line.startswith("  FAILED")]
        assert len(failed) == len(FAILING_AT_5_STEPS), output[-4000:]
        for line, expected in zip(failed, FAILING_AT_5_STEPS, strict=True):
            assert line.startswith(expected), (line, expected)
        assert "suite: 40/43 checks passed" in output
    return folders[0] / "report", folders[1] / "report"


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value).union(*(_keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_keys(v) for v in value))
    return set()


@pytest.mark.slow
@pytest.mark.parametrize("name", REPORT_FILES)
def test_suite_report_is_byte_identical(suites: tuple[Path, Path], name: str) -> None:
    first, second = suites
    assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.slow
def test_report_holds_no_absolute_path_and_no_wall_clock_time(
    suites: tuple[Path, Path],
) -> None:
    output = suites[0]
    results = json.loads((output / "results.json").read_text())
    variants = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert sorted(results["runs"]) == variants  # every variant ran
    assert "seconds" not in _keys(results)
    assert results["setup"]["data"]["data_root"] == "../shared/data"
    report = (output / "report.md").read_text()
    assert "in ../shared/data/MNIST/raw." in report
    machine = [str(REPO.parent), str(output.parent), str(Path.home())]
    for name in ("report.md", "results.json"):
        text = (output / name).read_text()
        assert not [m for m in machine if m in text], name
        assert ABSOLUTE.findall(text) == [], name
    assert WALL_CLOCK.findall(report) == []
    timings = json.loads((output / "timings.json").read_text())
    assert timings["seconds"] > 0
    assert set(timings["runs"]) == set(results["runs"])
    assert all(t["run"] > 0 for t in timings["runs"].values())


@pytest.mark.slow
def test_fit_twice_gives_bitwise_identical_weights(tmp_path: Path) -> None:
    folders = [tmp_path / run for run in "ab"]
    done = _twice(
        [
            [
                "fit",
                "--config=configs/detached.yaml",
                "--trainer.max_steps=3",
                "--trainer.enable_checkpointing=true",
                "--trainer.limit_val_batches=1",
                "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={folder}",
                f"--data.cache_dir={folder / 'cache'}",
                "--data.limit_train=512",
                "--data.limit_val=128",
                "--data.limit_test=128",
                f"--record.output={folder / 'run'}",
                "--record.verbose=false",
            ]
            for folder in folders
        ]
    )
    assert [code for code, _ in done] == [0, 0], done[0][1][-4000:] + done[1][1][-4000:]
    states = []
    for folder in folders:
        (checkpoint,) = folder.glob("detached/version_0/checkpoints/*.ckpt")
        states.append(torch.load(checkpoint, map_location="cpu", weights_only=False))
    first, second = (state["state_dict"] for state in states)
    assert list(first) == list(second)
    assert any(key.startswith("branches.") for key in first)  # the probes' weights too
    for key, value in first.items():
        assert torch.equal(value, second[key]), key
    first_rng, second_rng = (state["branch_rng"] for state in states)
    assert first_rng.keys() == second_rng.keys()
    for name, value in first_rng.items():
        assert torch.equal(value, second_rng[name]), name
    records = [json.loads((folder / "run" / "run.json").read_text()) for folder in folders]
    for record in records:
        assert record["steps"] == 3
        record.pop("seconds")
    assert records[0] == records[1]
