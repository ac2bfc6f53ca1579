"""Starting a child process from a test: the checkout under test first on its path, a clean
environment, one call."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The checkout under test. A child process started with only the inherited environment would
# import whichever ``isolate`` the interpreter has installed (an editable install may point at
# another checkout); with this folder first on PYTHONPATH it imports this one, and ``tests``,
# ``experiments`` and ``examples`` import as packages from any working directory.
REPO = Path(__file__).resolve().parents[1]

# Left over from an enclosing distributed run, these would make the child join it.
_DISTRIBUTED = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: the checkout under test first on PYTHONPATH,
    one torch thread, no inherited rendezvous, then ``extra``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in _DISTRIBUTED:
        env.pop(key, None)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *inherited])
    env.update(extra or {})
    return env


def launch(
    command: Sequence[str], cwd: Path, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in :func:`child_env`; it must succeed."""
    done = subprocess.run(
        list(command),
        cwd=cwd,
        env=child_env(),
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
