"""IsolationCallback under Lightning's ModelParallelStrategy (FSDP2): the spec applied to the
sharded module, frozen tensors bitwise unchanged under AdamW weight decay, the ranks identical
after every epoch, and a resume from a distributed checkpoint that continues exactly, under
each Lightning (``pytorch_lightning`` and ``lightning.pytorch``).

The runs happen in ``_lightning_fsdp_script.py`` (2 CPU processes, gloo); each rank writes what
it measured, and the tests assert on it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests._launch import launch, ranks

SCRIPT = Path(__file__).with_name("_lightning_fsdp_script.py")


@pytest.fixture(scope="module", params=["pytorch_lightning", "lightning.pytorch"])
def lightning(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("fsdp_lightning")
    launch([sys.executable, str(SCRIPT), str(out), request.param], cwd=out)
    return {run: ranks(out, run) for run in ("full", "resume")}


FROZEN = ["trunk.0.weight", "trunk.0.bias", "trunk.1.weight", "trunk.1.bias"]


@pytest.mark.slow
def test_callback_under_model_parallel_strategy(
    lightning: dict[str, list[dict[str, Any]]],
) -> None:
    ranks = lightning["full"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["world_size"] == 2
    for rank in ranks:
        # applied at fit start, against the sharded module: the optimizer holds DTensors;
        # frozen ones were taken out (6 left), trunk.3 joined once at epoch 1 (2 more)
        assert rank["optimizer_types"] == ["DTensor"]
        assert rank["groups"] == [[6], [6], [6, 2], [6, 2]]
        assert rank["state"]["thawed"] == [{"name": "trunk.3", "epoch": 1, "global_step": 2}]
        assert rank["state"]["frozen"] == FROZEN
        assert rank["requires_grad_after_fit"]  # restored at teardown
        # configure_optimizers ran before the spec froze anything: nothing to warn about
        assert rank["warnings"] == []
        prints = rank["prints"]  # fit start and the end of each of 3 epochs
        for name in FROZEN:  # frozen under AdamW weight decay: bitwise unchanged
            assert len({p[name] for p in prints}) == 1, name
        w = [p["trunk.3.weight"] for p in prints]
        assert w[0] == w[1] and w[2] != w[1] and w[3] != w[2]  # learns from epoch 1
        assert len({p["aux.module.0.weight"] for p in prints}) == 4
    # every check ran each step (verify_every_n_steps=1), the rank check among them; the
    # ranks hold identical full tensors after every epoch, the thaw included
    assert ranks[0]["prints"] == ranks[1]["prints"]


@pytest.mark.slow
def test_resume_from_a_distributed_checkpoint_is_exact(
    lightning: dict[str, list[dict[str, Any]]],
) -> None:
    for full, resumed in zip(lightning["full"], lightning["resume"], strict=True):
        assert "epoch=1-step=4.ckpt" in full["checkpoints"]
        # the thawed group exists before the strategy loads the optimizer state into it
        assert resumed["groups"] == [[6, 2], [6, 2]]
        assert resumed["optim"][0] == full["optim"][2]  # AdamW state of epoch 2's start
        assert resumed["state"] == full["state"]  # not frozen again
        assert resumed["prints"][0] == full["prints"][2]
        assert resumed["prints"][-1] == full["prints"][-1]  # bitwise, after epoch 2
