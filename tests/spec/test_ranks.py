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


def _sent(monkeypatch: pytest.MonkeyPatch, params: dict[str, torch.Tensor], found: Any = ()) -> Any:
    """What check_ranks sends the other ranks from a rank that holds ``params`` and found
    ``found``: the other rank of a test, simulated in this process."""
    sent: list[Any] = []

    def gather(out: list[Any], obj: Any) -> None:
        sent.append(obj)
        out[:] = [obj, obj]

    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    monkeypatch.setattr(ranks.dist, "all_gather_object", gather)
    check_ranks(params, "now", "verify()", found)
    return sent[0]


def _ranks(monkeypatch: pytest.MonkeyPatch, *others: Any) -> None:
    """Make check_ranks see one more rank for each of ``others``, sending it (see _sent)."""

    def gather(out: list[Any], obj: Any) -> None:
        out[:] = [obj, *others]

    monkeypatch.setattr(ranks, "world_size", lambda: 1 + len(others))
    monkeypatch.setattr(ranks.dist, "all_gather_object", gather)


def _sharded(values: list[float], coordinate: int) -> torch.Tensor:
    """A tensor that reads as this rank's shard (``coordinate`` on a 1-D mesh) of a DTensor."""
    t = torch.tensor(values)
    t.placements = (SimpleNamespace(is_replicate=lambda: False),)  # type: ignore[attr-defined]
    t.device_mesh = SimpleNamespace(get_coordinate=lambda: [coordinate])  # type: ignore[attr-defined]
    return t


def test_a_single_bit_that_differs_on_the_other_rank_is_refused_in_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = _sent(monkeypatch, {"a": torch.ones(3), "b": torch.tensor([0.0, -0.0])})
    _ranks(monkeypatch, other)
    (error,) = check_ranks({"a": torch.ones(3), "b": torch.zeros(2)}, "at step 3", "verify()")
    assert isinstance(error, RankDivergenceError)
    assert str(error) == (
        "verify(): parameters differ across the 2 ranks (at step 3): ['b']\n"
        "  b: ranks [0] vs [1] hold different values\n"
        "DDP synchronises only the parameters that required grad when it was built: thaw with "
        "a Thaw step of the spec (the Lightning callback rebuilds the wrapper; in your own "
        "loop, wrap the model in DDP again after a thaw), not by setting requires_grad "
        "elsewhere"
    )
    same = _sent(monkeypatch, {"a": torch.ones(3), "b": torch.zeros(2)})
    _ranks(monkeypatch, same)
    assert check_ranks({"a": torch.ones(3), "b": torch.zeros(2)}, "now", "verify()") == []


def test_ranks_that_hold_other_parameter_names_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = _sent(
        monkeypatch,
        {"a": torch.ones(3), "c": torch.zeros(2)},
        found=[DriftError("verify(): 'a' moved")],
    )
    _ranks(monkeypatch, other)
    errors = check_ranks({"a": torch.ones(3), "b": torch.zeros(2)}, "at step 3", "verify()")
    assert [type(e) for e in errors] == [DriftError, RankDivergenceError]
    assert [str(e) for e in errors] == [
        "verify(): on rank 1 of 2: 'a' moved",
        "verify(): the 2 ranks hold different parameter names (at step 3): rank 1 differs in "
        "['b', 'c']; every rank must build the same model",
    ]


def test_shards_of_different_owners_are_not_compared_and_shards_of_one_owner_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # FSDP: rank 1 owns the other half of 'w', so its values differ and that is right.
    other = _sent(monkeypatch, {"w": _sharded([2.0, 3.0], 1)})
    _ranks(monkeypatch, other)
    assert check_ranks({"w": _sharded([0.0, 1.0], 0)}, "now", "verify()") == []
    # Two copies of the same shard (HSDP's replica groups) must agree.
    other = _sent(monkeypatch, {"w": _sharded([0.0, 1.5], 0)})
    _ranks(monkeypatch, other)
    (error,) = check_ranks({"w": _sharded([0.0, 1.0], 0)}, "now", "verify()")
    assert str(error).startswith("verify(): parameters differ across the 2 ranks (now): ['w']")


def test_a_violation_two_ranks_report_comes_back_once_naming_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moved = [DriftError("verify(): 'a' moved")]
    other = _sent(monkeypatch, {"a": torch.ones(3)}, found=moved)
    _ranks(monkeypatch, other, other)
    errors = check_ranks({"a": torch.ones(3)}, "now", "verify()")
    assert [(type(e), str(e)) for e in errors] == [
        (DriftError, "verify(): on rank 1 of 3: 'a' moved")
    ]


def test_a_placement_without_a_mesh_or_a_mesh_without_placements_is_a_plain_tensor() -> None:
    shard = SimpleNamespace(is_replicate=lambda: False)
    assert replica_key(SimpleNamespace(placements=(shard,))) == ()  # type: ignore[arg-type]
    mesh = SimpleNamespace(get_coordinate=lambda: [1])
    assert replica_key(SimpleNamespace(device_mesh=mesh)) == ()  # type: ignore[arg-type]
