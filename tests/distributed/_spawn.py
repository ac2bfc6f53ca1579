"""What the hand-launched distributed scripts share: CPU processes joined over gloo on a free
port, each running one mode and writing what it measured to ``OUT_DIR/<mode>-rank<r>.json``
(read back by :func:`tests._launch.ranks`), a rank's seeded batch, and a shard's full tensor.

A script calls :func:`spawn` from its ``main`` with its modes; each mode is a function of no
arguments, run on every rank inside the process group, returning what to record.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Mode = Callable[[], dict[str, Any]]


def batch(step: int = 0, *, rank: int | None = None) -> torch.Tensor:
    """Six random 4-feature inputs, seeded by ``rank`` (by default this process's) and
    ``step``: the same on every run, different on every rank."""
    rank = dist.get_rank() if rank is None else rank
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a ``DTensor`` shard (gathered; one tensor at a time), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def worker(rank: int, world: int, port: int, run: Mode, mode: str, out: str) -> None:
    """One process: join the group, run the mode, write its record (or the traceback it
    raised, which the test reports), and leave the group with the others."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {"rank": rank, "world": world}
        try:
            result.update(run())
        except Exception:  # reported to the test, which fails on it
            result["error"] = traceback.format_exc()
        Path(out, f"{mode}-rank{rank}.json").write_text(json.dumps(result, default=str))
    finally:
        gc.collect()  # sharded models and their pending collectives go first
        dist.barrier()
        dist.destroy_process_group()


def spawn(modes: Mapping[str, Mode], mode: str, out: str, *, world: int = 2) -> None:
    """Run ``modes[mode]`` on ``world`` processes on a free port, each writing its record
    into ``out``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, modes[mode], mode, out), nprocs=world)
