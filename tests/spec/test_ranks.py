"""Comparing parameters across ranks, in one process: the exchange is replaced by what two
ranks would send, so the verdict (who differs, in which tensor) is checked without a
process group. The real two-process runs are in tests/distributed/test_fsdp.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from isolate.errors import DriftError, GradientLeakError, IsolationError, RankDivergenceError
from isolate.spec import cadence, ranks
from isolate.spec.cadence import CHECKS, many_ranks
from isolate.spec.ranks import check_ranks, replica_key


def _two_ranks(
    monkeypatch: pytest.MonkeyPatch, other: Any, reports: tuple[tuple[str, str], ...] = ()
) -> None:
    """Make check_ranks see a second rank that sends ``other(mine)`` and found ``reports``
    (the name of an error type, its message)."""

    def gather(out: list[Any], obj: Any) -> None:
        names, mine, _ = obj
        out[:] = [obj, (names, other(mine), list(reports))]

    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    monkeypatch.setattr(ranks.dist, "all_gather_object", gather)


def test_a_tensor_that_differs_on_the_other_rank_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _two_ranks(monkeypatch, lambda mine: [mine[0], (mine[1][0], mine[1][1] + 1)])
    params = {"a": torch.ones(3), "b": torch.zeros(2)}
    errors = check_ranks(params, "at step 3", "verify()")
    assert len(errors) == 1 and isinstance(errors[0], RankDivergenceError)
    assert str(errors[0]).startswith(
        "verify(): parameters differ across the 2 ranks (at step 3): ['b']\n"
        "  b: ranks [0] vs [1] hold different values\n"
    )


def test_the_error_shows_the_first_eight_tensors_that_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _two_ranks(monkeypatch, lambda mine: [(key, print_ + 1) for key, print_ in mine])
    params = {f"p{i}": torch.full((2,), float(i)) for i in range(10)}
    (error,) = check_ranks(params, "now", "verify()")
    shown = [line for line in str(error).splitlines() if line.startswith("  ")]
    assert shown == [f"  p{i}: ranks [0] vs [1] hold different values" for i in range(8)]


def test_what_another_rank_found_comes_back_once_as_its_own_type_naming_the_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen_here = GradientLeakError("verify(): 'b' got a gradient")
    reports = (
        ("DriftError", "verify(): 'a' moved"),
        ("GradientLeakError", str(seen_here)),  # this rank reports it already
        ("NotAnError", "verify(): a type this side does not know"),
    )
    _two_ranks(monkeypatch, lambda mine: list(mine), reports)
    errors = check_ranks({"a": torch.ones(3)}, "now", "verify()", found=[seen_here])
    assert [type(e) for e in errors] == [DriftError, IsolationError]
    assert [str(e) for e in errors] == [
        "verify(): on rank 1 of 2: 'a' moved",
        "verify(): on rank 1 of 2: a type this side does not know",
    ]


def test_equal_tensors_and_pieces_held_nowhere_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    _two_ranks(monkeypatch, lambda mine: list(mine))
    assert check_ranks({"a": torch.ones(3)}, "now", "verify()") == []
    # A rank that holds no piece of a tensor (key None) has nothing to compare.
    _two_ranks(monkeypatch, lambda mine: [(None, 7)])
    assert check_ranks({"a": torch.ones(3)}, "now", "verify()") == []


def test_replica_key_of_plain_and_sharded_tensors() -> None:
    assert replica_key(torch.zeros(2)) == ()
    shard = SimpleNamespace(is_replicate=lambda: False)
    copy = SimpleNamespace(is_replicate=lambda: True)
    mesh = SimpleNamespace(get_coordinate=lambda: [1, 0])
    dtensor = SimpleNamespace(placements=(shard, copy), device_mesh=mesh)
    assert replica_key(dtensor) == (1, -1)  # type: ignore[arg-type]
    outside = SimpleNamespace(
        placements=(shard,), device_mesh=SimpleNamespace(get_coordinate=lambda: None)
    )
    assert replica_key(outside) is None  # type: ignore[arg-type]


def test_several_ranks_make_the_checks_a_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    assert many_ranks() == ()
    monkeypatch.setattr(cadence, "world_size", lambda: 2)
    assert many_ranks() == ("ranks",)
    assert set(many_ranks()) <= set(CHECKS)
