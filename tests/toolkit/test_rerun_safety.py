"""What decides whether a walk may re-run a segment on fake tensors: the modules the
segment's function holds, and the frames torch.compile has compiled so far."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from isolate._rerun_safety import compiles, modules_in


def _with_an_empty_cell(layer: nn.Module) -> object:
    late: int  # never bound: the closure's cell for it stays empty

    def segment(x: torch.Tensor) -> torch.Tensor:
        return layer(x) + late  # noqa: F821 (declared above, never bound)

    return segment


def test_the_modules_a_segment_holds_are_found_through_closures_partials_and_methods() -> None:
    layer, other = nn.Linear(2, 2), nn.Linear(2, 2)
    assert list(modules_in(_with_an_empty_cell(layer))) == [layer]
    assert list(modules_in(functools.partial(nn.Module.__call__, other))) == [other]
    assert list(modules_in(layer.forward)) == [layer]


def test_compiles_reads_the_frames_dynamo_has_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters["frames"], "total", 7)
    assert compiles() == 7
