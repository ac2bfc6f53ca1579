"""Checking that the processes of a distributed run hold the same parameters.

DDP synchronises only the parameters that required grad when it was built: a parameter
thawed by hand afterwards gets unsynchronised gradients, and the ranks drift apart quietly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from isolate.errors import IsolationError, RankDivergenceError
from isolate.plan import shown

__all__ = ["check_ranks", "world_size"]

_BUCKET = 1 << 22  # elements per all-reduce (32 MiB in float64)


def world_size() -> int:
    """The number of processes, 1 outside an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size())


def check_ranks(params: Mapping[str, torch.Tensor], when: str, caller: str) -> list[IsolationError]:
    """Compare ``params`` across ranks; a collective, so every rank must call it.

    Exact: the elementwise max and min over ranks agree only where every rank holds the same
    value. Buckets bound the extra memory (float64 holds every float16/32 value exactly).
    """
    if world_size() < 2:
        return []
    named = list(params.items())
    spread: dict[int, tuple[int, float]] = {}
    bucket: list[torch.Tensor] = []
    size = 0
    for i, (_, p) in enumerate(named):
        t = p.detach()
        bucket.append((torch.view_as_real(t) if t.is_complex() else t).reshape(-1))
        size += bucket[-1].numel()
        if size >= _BUCKET or i == len(named) - 1:
            _reduce(bucket, i - len(bucket) + 1, spread)
            bucket, size = [], 0
    if not spread:
        return []
    names = [named[i][0] for i in spread]
    lines = [
        f"  {named[i][0]}: {count} of {named[i][1].numel()} elements, max spread {top:.3e}"
        for i, (count, top) in spread.items()
    ]
    return [
        RankDivergenceError(
            f"{caller}: parameters differ across the {world_size()} ranks ({when}): "
            f"{shown(names)}\n"
            + "\n".join(lines[:8])
            + "\nDDP synchronises only the parameters that required grad when it was built: "
            "thaw with a Thaw step of the spec (the Lightning callback rebuilds the wrapper; "
            "in your own loop, wrap the model in DDP again after a thaw), not by setting "
            "requires_grad elsewhere"
        )
    ]


def _reduce(bucket: list[torch.Tensor], first: int, spread: dict[int, tuple[int, float]]) -> None:
    flat = torch.cat([t.double() for t in bucket])
    high, low = flat.clone(), flat
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    differ = (high != low) & ~(high.isnan() & low.isnan())
    if not bool(differ.any()):
        return
    gap = (high - low).abs()
    offset = 0
    for j, t in enumerate(bucket):
        n = t.numel()
        count = int(differ[offset : offset + n].sum())
        if count:
            spread[first + j] = (count, float(gap[offset : offset + n].max()))
        offset += n
