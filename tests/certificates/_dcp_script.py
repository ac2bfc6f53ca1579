"""Two CPU processes (gloo) writing torch.distributed.checkpoint folders of a state dict whose
tensors are sharded by rows across them (DTensor, ``Shard(0)``), for
``tests/certificates/test_sharded.py``.

Usage: ``python tests/certificates/_dcp_script.py OUT_DIR``; writes ``OUT_DIR/base`` (the base
state) and ``OUT_DIR/tuned`` (the state trained as declared), each with one shard file per rank.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.certificates._data import base_state, trained


def _worker(rank: int, port: int, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    try:
        mesh = init_device_mesh("cpu", (2,))
        base = base_state()
        for name, state in (("base", base), ("tuned", trained(base))):
            sharded = {
                k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() else v
                for k, v in state.items()
            }
            dcp.save({"model": sharded}, checkpoint_id=Path(out) / name)
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, sys.argv[1]), nprocs=2, join=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
