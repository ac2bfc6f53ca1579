"""IsolationCallback under Lightning's ``ddp`` strategy: 2 CPU processes, gloo, under each
Lightning (``pytorch_lightning`` and ``lightning.pytorch``).

The runs happen in ``_lightning_ddp_script.py`` (Lightning's ddp strategy launches the second
process by re-running the command line, which pytest's own command line cannot survive).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests._launch import launch, ranks

SCRIPT = Path(__file__).with_name("_lightning_ddp_script.py")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(p, marks=pytest.mark.slow) for p in ("pytorch_lightning", "lightning.pytorch")
    ],
)
def runs(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ddp")
    launch([sys.executable, str(SCRIPT), str(out), request.param], cwd=out)
    return {mode: ranks(out, mode) for mode in ("isolate", "backbone", "raise")}


def _differing(ranks: list[dict[str, Any]], at: int) -> list[str]:
    """Parameters whose checksums differ between the ranks (at 0: fit start; at e + 1: the
    end of epoch e)."""
    a, b = (r["checksums"][at] for r in ranks)
    return sorted(name for name in a if a[name] != b[name])


def test_thaws_keep_ranks_identical(runs: dict[str, list[dict[str, Any]]]) -> None:
    ranks = runs["isolate"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world_size"] == 2
    # Frozen before DDP wraps the model, DDP syncs head and aux only (6 tensors); the thaws
    # (trunk.0 before step 1, the rest of the trunk at epoch 1) rebuild it with all 12.
    assert ranks[0]["synced"] == ranks[1]["synced"] == [6, 12, 12]
    for at in range(4):
        assert _differing(ranks, at) == []
    sums = ranks[0]["checksums"]
    assert sums[1]["trunk.0.weight"] != sums[0]["trunk.0.weight"]  # learns from step 1
    assert sums[1]["trunk.3.weight"] == sums[0]["trunk.3.weight"]  # frozen in epoch 0
    assert sums[2]["trunk.3.weight"] != sums[1]["trunk.3.weight"]  # learns from epoch 1
    assert not ranks[0]["warnings"] and not ranks[1]["warnings"]
    assert ranks[0]["requires_grad_after_fit"]  # restored at teardown


def test_backbone_finetuning_diverges_and_is_reported(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    ranks = runs["backbone"]
    assert _differing(ranks, 1) == []  # identical until the thaw at epoch 1
    assert {"trunk.0.weight", "trunk.3.weight"} <= set(_differing(ranks, 3))
    # BackboneFinetuning leaves BatchNorm trainable (train_bn=True), so DDP syncs head, aux
    # and trunk.1: 8 tensors, and never the thawed trunk.0 / trunk.3.
    assert ranks[0]["synced"] == [8, 8, 8]
    for rank in ranks:
        assert rank["warnings"], "the rank check did not report the divergence"
        first = rank["warnings"][0]
        assert first.startswith("IsolationCallback: parameters differ across the 2 ranks")
        assert "'trunk.0.weight'" in first and "'trunk.3.weight'" in first


def test_rank_divergence_raises_on_every_rank(runs: dict[str, list[dict[str, Any]]]) -> None:
    for rank in runs["raise"]:
        assert rank["error"] is not None, "the divergence was not raised"
        assert rank["error"].startswith(
            "RankDivergenceError: IsolationCallback: parameters differ across the 2 ranks "
            "(after thawing"
        ) or rank["error"].startswith(
            "RankDivergenceError: IsolationCallback: parameters differ across the 2 ranks (at step"
        )
        assert "'trunk.0.weight'" in rank["error"]
        assert rank["requires_grad_after_fit"]  # on_exception restored everything
