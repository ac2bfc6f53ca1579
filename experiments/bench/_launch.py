"""Run one function on several CPU processes joined in a gloo process group, and collect what
each rank returns."""

from __future__ import annotations

import gc
import json
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = ["launch"]

C = TypeVar("C")
# Left over from an enclosing distributed run, these would make the workers join it.
_RENDEZVOUS = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _worker(
    rank: int, world: int, port: int, run: Callable[[C], dict[str, Any]], cfg: C, out: str
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),  # a rank left waiting fails instead of hanging
    )
    try:
        result = run(cfg)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        gc.collect()  # the sharded model and its pending collectives go first
        dist.barrier()
        dist.destroy_process_group()


@contextmanager
def _worker_env() -> Iterator[None]:
    """One thread per worker and no inherited rendezvous, for the workers spawned inside."""
    saved = {key: os.environ.get(key) for key in (*_RENDEZVOUS, "OMP_NUM_THREADS")}
    for key in _RENDEZVOUS:
        os.environ.pop(key, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launch(run: Callable[[C], dict[str, Any]], cfg: C, world: int) -> list[dict[str, Any]]:
    """``run(cfg)`` on ``world`` spawned processes (gloo, one thread each); what each returned
    (JSON), by rank. ``run`` must be importable by name: the processes are spawned."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="isolate-bench-") as out, _worker_env():
        mp.spawn(_worker, args=(world, port, run, cfg, out), nprocs=world)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
