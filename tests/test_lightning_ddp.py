"""IsolationCallback under Lightning's ``ddp`` strategy: 2 CPU processes, gloo.

The runs happen in ``_lightning_ddp_script.py`` (Lightning's ddp strategy launches the second
process by re-running the command line, which pytest's own command line cannot survive).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("_lightning_ddp_script.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {
        mode: [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
        for mode in ("isolate", "backbone")
    }


def _differing(ranks: list[dict[str, Any]], epoch: int) -> list[str]:
    a, b = (r["checksums"][epoch] for r in ranks)
    return sorted(name for name in a if a[name] != b[name])


def test_thaw_keeps_ranks_identical(runs: dict[str, list[dict[str, Any]]]) -> None:
    ranks = runs["isolate"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world_size"] == 2
    # Frozen before DDP wraps the model: it syncs head and aux only (6 tensors); after the
    # thaw at epoch 1 the rebuilt wrapper syncs the trunk too (12).
    assert ranks[0]["synced"] == ranks[1]["synced"] == [6, 12, 12]
    for epoch in range(3):
        assert _differing(ranks, epoch) == []
    a = ranks[0]["checksums"]
    assert all(a[1][k] != a[0][k] for k in ("trunk.0.weight", "trunk.3.weight"))  # it learns
    assert not ranks[0]["warnings"] and not ranks[1]["warnings"]
    assert ranks[0]["requires_grad_after_fit"]  # restored at teardown


def test_backbone_finetuning_diverges_and_is_reported(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    ranks = runs["backbone"]
    assert _differing(ranks, 0) == []
    diverged = _differing(ranks, 2)
    assert {"trunk.0.weight", "trunk.3.weight"} <= set(diverged)
    assert ranks[0]["synced"] == [8, 8, 8]  # the thawed trunk (but its BatchNorm) never joins DDP
    for rank in ranks:
        assert rank["warnings"], "the rank check did not report the divergence"
        first = rank["warnings"][0]
        assert first.startswith("IsolationCallback: parameters differ across the 2 ranks")
        assert "'trunk.0.weight'" in first
