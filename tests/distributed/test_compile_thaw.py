"""Freezes and thaws under torch.compile take effect at the next step on 2 CPU processes
(gloo), compiled DDP in both orders and a compiled FSDP2 model, bitwise equal to one eager
process training on both ranks' batches (aot_eager runs eager's kernels; gloo averages two
gradients exactly as the eager mean of the two losses does).

The runs happen in ``_compile_thaw_script.py``; each rank writes what it measured.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests._launch import launch, ranks

SCRIPT = Path(__file__).with_name("_compile_thaw_script.py")


def _run(mode: str, out: Path) -> list[dict[str, Any]]:
    launch([sys.executable, str(SCRIPT), mode, str(out)], cwd=out)
    records = ranks(out, mode)
    for rank in records:
        assert "error" not in rank, rank["error"]
    return records


EXPECTED_B_GRADS = {"freeze": [True, False, False], "thaw": [False, True, True]}


@pytest.mark.slow
def test_compiled_ddp_trains_as_eager_after_a_freeze_and_a_thaw(tmp_path: Path) -> None:
    for rank in _run("ddp", tmp_path):
        for wrap in ("ddp_of_compiled", "compiled_ddp"):
            for event, b_grads in EXPECTED_B_GRADS.items():
                run = rank[f"{wrap}/{event}"]
                assert run == {"differs": [], "b_grads": b_grads}, (wrap, event)


@pytest.mark.slow
def test_compiled_fsdp2_trains_as_eager_after_a_freeze_and_a_thaw(tmp_path: Path) -> None:
    for rank in _run("fsdp", tmp_path):
        for event, b_grads in EXPECTED_B_GRADS.items():
            assert rank[f"fsdp/{event}"] == {"differs": [], "b_grads": b_grads}, event
