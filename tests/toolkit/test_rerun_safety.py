"""What decides whether a walk may re-run a segment on fake tensors: the modules the
segment's function holds, and the frames torch.compile has compiled so far."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from torch import nn
from torch.nn.modules import module as hooks

from isolate._rerun_safety import (
    compiles,
    hooks_allow_fake,
    modules_in,
    recompute_safe,
    restore,
    state_of,
)


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


def test_compiles_is_zero_before_dynamo_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    assert compiles() == 0


def _nested(depth: int, layer: nn.Module) -> object:
    held: object = layer
    for _ in range(depth):
        held = functools.partial(print, held)
    return held


def test_modules_are_looked_for_four_holders_deep() -> None:
    layer = nn.Linear(2, 2)
    assert list(modules_in(_nested(4, layer))) == [layer]
    assert list(modules_in(_nested(5, layer))) == []


def test_only_hooks_marked_recompute_safe_allow_a_fake_rerun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = nn.Sequential(nn.Linear(2, 2))
    segment = functools.partial(nn.Module.__call__, layer)
    assert hooks_allow_fake(segment)

    def hook(module: nn.Module, args: object) -> None:
        return None

    assert recompute_safe(hook) is hook
    layer[0].register_forward_pre_hook(hook)
    assert hooks_allow_fake(segment)
    layer[0].register_forward_hook(lambda module, args, output: None)
    assert not hooks_allow_fake(segment)  # an unmarked hook, one level down
    marked = nn.Linear(2, 2)
    marked.register_forward_hook(recompute_safe(lambda module, args, output: None))
    assert hooks_allow_fake(marked)
    monkeypatch.setattr(hooks, "_global_forward_hooks", {0: hook})
    assert not hooks_allow_fake(marked)  # a global hook, even a marked one
    monkeypatch.setattr(hooks, "_global_forward_hooks", {})
    monkeypatch.setattr(hooks, "_global_forward_pre_hooks", {0: hook})
    assert not hooks_allow_fake(marked)


def test_restore_puts_back_what_a_run_changed_and_says_whether_it_did() -> None:
    layer = nn.BatchNorm1d(2)
    kept = state_of(layer.forward)
    assert restore(kept) is False
    weight, mean = layer.weight, layer.running_mean
    layer.weight = nn.Parameter(torch.zeros(2))
    layer.running_mean = torch.ones(2)
    layer.momentum = 0.5
    layer.kept = torch.ones(1)
    assert restore(kept) is True
    assert layer.weight is weight and layer.running_mean is mean
    assert layer.momentum == 0.1 and not hasattr(layer, "kept")
    assert restore(kept) is False
