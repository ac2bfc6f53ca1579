"""Checking that the processes of a distributed run hold the same parameters.

DDP synchronises only the parameters that required grad when it was built: a parameter
thawed by hand afterwards gets unsynchronised gradients, and the ranks drift apart quietly.
The check exchanges one 128-bit :func:`~isolate.drift.fingerprint` per tensor, not the
tensors: O(number of tensors) communication, one read of the local weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

import isolate.errors as errors
from isolate._text import shown
from isolate.errors import IsolationError, RankDivergenceError
from isolate.fingerprints import fingerprint

__all__ = ["check_ranks", "replica_key", "world_size"]


def world_size() -> int:
    """The number of processes, 1 outside an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size())


def replica_key(t: torch.Tensor) -> tuple[int, ...] | None:
    """Which piece of a tensor this rank holds, as far as other ranks must hold the same.

    A plain tensor is replicated: every rank holds all of it (``()``). A ``DTensor`` is cut
    along the mesh dimensions whose placement is a shard (or a pending partial sum) and
    copied along those that replicate it: ranks with the same coordinates on the cutting
    dimensions must hold identical local tensors (FSDP's shards: one owner each; HSDP: one
    copy per replica group). ``None``: this rank holds no piece (it is not in the mesh).

    >>> replica_key(torch.zeros(2))
    ()
    """
    placements = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
    if placements is None or mesh is None:
        return ()
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    return tuple(
        int(c) if not placement.is_replicate() else -1
        for c, placement in zip(coordinate, placements, strict=True)
    )


def check_ranks(
    params: Mapping[str, torch.Tensor],
    when: str,
    caller: str,
    found: Sequence[IsolationError] = (),
) -> list[IsolationError]:
    """Compare ``params`` across ranks; a collective, so every rank must call it.

    ``found`` are the violations this rank's own checks found in the same verification: they
    travel in the same exchange, and every rank gets back those the other ranks found (a
    frozen shard that moved is seen by its owner alone; raising there only would leave the
    other ranks waiting in the next collective).

    Each rank fingerprints its own piece of every tensor (the whole tensor, or its local
    shard of a ``DTensor``) and the ranks exchange the names and fingerprints with one
    ``all_gather_object``: O(number of tensors) bytes per rank, whatever their size (the
    tensors are read once, never sent). Pieces that must be equal (see :func:`replica_key`)
    are compared exactly: a change of any single bit is caught. Every rank gets the same
    answer, so a raise does not leave some ranks waiting in the next collective.

    Returns:
        The violations the other ranks found that this one did not (each of its own type,
        naming the rank), then one :class:`~isolate.errors.RankDivergenceError` naming the
        tensors that differ and the ranks that disagree, if any.
    """
    world = world_size()
    if world < 2:
        return []
    names = list(params)
    mine: list[tuple[Any, int]] = []
    for t in params.values():
        key = replica_key(t)
        mine.append((key, fingerprint(t) if key is not None else 0))
    gathered: list[Any] = [None] * world
    reports = [(type(e).__name__, str(e)) for e in found]
    dist.all_gather_object(gathered, (names, mine, reports))
    theirs_found = _found_elsewhere(gathered, reports, world, caller)
    # Every rank holds every rank's fingerprints, so every rank reaches the same verdict
    # (a check that raised on some ranks only would leave the others hanging in the next
    # collective).
    pieces: dict[tuple[str, Any], dict[int, list[int]]] = {}
    for rank, (their_names, theirs, _) in enumerate(gathered):
        if their_names != names:
            missing = sorted(set(names) ^ set(their_names))
            return [
                *theirs_found,
                RankDivergenceError(
                    f"{caller}: the {world} ranks hold different parameter names ({when}): "
                    f"rank {rank} differs in {shown(missing)}; every rank must build the same "
                    f"model"
                ),
            ]
        for name, (key, print_) in zip(names, theirs, strict=True):
            if key is not None:
                pieces.setdefault((name, key), {}).setdefault(print_, []).append(rank)
    differ: dict[str, list[list[int]]] = {}
    for (name, _), prints in pieces.items():
        if len(prints) > 1:
            differ.setdefault(name, []).extend(sorted(prints.values()))
    if not differ:
        return theirs_found
    lines = [
        f"  {name}: ranks {' vs '.join(str(g) for g in groups)} hold different values"
        for name, groups in list(differ.items())[:8]
    ]
    return [
        *theirs_found,
        RankDivergenceError(
            f"{caller}: parameters differ across the {world} ranks ({when}): "
            f"{shown(differ)}\n"
            + "\n".join(lines)
            + "\nDDP synchronises only the parameters that required grad when it was built: "
            "thaw with a Thaw step of the spec (the Lightning callback rebuilds the wrapper; "
            "in your own loop, wrap the model in DDP again after a thaw), not by setting "
            "requires_grad elsewhere"
        ),
    ]


def _found_elsewhere(
    gathered: Sequence[Any], mine: Sequence[tuple[str, str]], world: int, caller: str
) -> list[IsolationError]:
    """The violations other ranks reported and this one did not, each rebuilt as its own
    type (an :class:`IsolationError` if the name is unknown) and naming its rank."""
    seen = {message for _, message in mine}
    out: list[IsolationError] = []
    for rank, (_, _, reports) in enumerate(gathered):
        for kind, message in reports:
            if message in seen:
                continue
            seen.add(message)
            cls = getattr(errors, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, IsolationError)):
                cls = IsolationError
            body = message.removeprefix(f"{caller}: ")
            out.append(cls(f"{caller}: on rank {rank} of {world}: {body}"))
    return out
