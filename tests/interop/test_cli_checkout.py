"""Child processes run the checkout under test: a multi-process test or a command line that
imported an installed copy of isolate would test that copy instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests._launch import REPO, child_env, launch


def test_a_child_process_imports_the_checkout(tmp_path: Path) -> None:
    code = "import isolate, isolate.spec; print(isolate.__file__); print(isolate.spec.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(f).resolve().is_relative_to(REPO / "isolate") for f in out), out
    launched = launch([sys.executable, "-c", code], cwd=tmp_path).stdout.split()
    assert launched == out


def test_the_command_line_runs_the_checkout(tmp_path: Path) -> None:
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text("0:\n  params: [a.weight]\n1:\n  params: ['a\\.b\\d+']\n")
    done = subprocess.run(
        [sys.executable, "-m", "isolate", "migrate", str(schedule)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    # The checkout refuses a repeated digit it cannot say as a glob (an older copy widened it).
    assert done.returncode == 2 and "phase 1: the regex" in done.stderr, done.stderr
