"""Starting a multi-process run (DDP, FSDP2) from a test: a clean environment, one call."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Left over from an enclosing distributed run, these would make the child join it.
_DISTRIBUTED = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch(
    command: Sequence[str], cwd: Path, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with one torch thread and no inherited rendezvous; it must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in _DISTRIBUTED:
        env.pop(key, None)
    done = subprocess.run(
        list(command),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def ranks(out: Path, name: str, world: int = 2) -> list[dict[str, Any]]:
    """The ``<name>-rank<r>.json`` records the processes wrote into ``out``."""
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(world)]
