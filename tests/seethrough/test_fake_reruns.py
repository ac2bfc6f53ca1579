"""A walk re-runs a reentrant segment on fake tensors, and for real wherever that cannot
stand in: each answer is compared with a real backward.

On fake tensors a segment's graph is built without its arithmetic, so the walks cost a
fraction of a forward. The fake run gives way to the real one when the segment branches on
a value, keeps something it computed, runs a forward hook that is not isolate's own, or when
torch.compile has compiled code in the process (its compiled regions must be walked as
compiled).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

import isolate._checkpointing as checkpointing
from isolate.cutoff import cut_off_parameters, trace_forward
from isolate.freezing import freeze
from isolate.reachability import reachable_parameters


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process in which torch.compile has compiled nothing (the suite may have)."""
    monkeypatch.setattr(checkpointing, "compiles", lambda: 0)


class Segmented(nn.Module):
    """embed -> checkpoint(body) -> head, recording the type of each input ``body`` saw."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.seen: list[type] = []

    def body(self, h: torch.Tensor) -> torch.Tensor:
        self.seen.append(type(h))
        return self.first(h).relu()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.body, self.embed(ids), use_reentrant=True)
        return self.head(h).sum()


def really_reached(loss: torch.Tensor, model: nn.Module) -> tuple[str, ...]:
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    names = tuple(n for n, p in model.named_parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return names


IDS = torch.tensor([[1, 2, 3]])


def test_a_walk_reruns_the_segment_on_fake_tensors(fresh: None) -> None:
    model = Segmented()
    loss = model(IDS)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.seen.clear()

    reached = reachable_parameters(loss, model)

    assert model.seen == [FakeTensor]
    assert reached == really_reached(loss, model)
    assert reached == ("embed.weight", "first.weight", "first.bias", "head.weight", "head.bias")
    assert set(cut_off_parameters(loss, model).parameters) == {"second.weight", "second.bias"}
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_after_a_compile_the_walk_reruns_for_real(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpointing, "compiles", lambda: 1)
    model = Segmented()
    loss = model(IDS)
    model.seen.clear()

    reached = reachable_parameters(loss, model)

    assert model.seen == [torch.Tensor]
    assert reached == really_reached(loss, model)


class Branching(Segmented):
    """The segment picks its layer by the sign of a value: fake tensors have none."""

    def body(self, h: torch.Tensor) -> torch.Tensor:
        self.seen.append(type(h))
        layer = self.first if h.sum() > 0 else self.second
        return layer(h)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_segment_that_branches_on_a_value_is_rerun_for_real(fresh: None, sign: float) -> None:
    model = Branching()
    with torch.no_grad():
        model.embed.weight.abs_().mul_(sign)
    loss = model(IDS)
    model.seen.clear()

    reached = reachable_parameters(loss, model)

    assert model.seen == [FakeTensor, torch.Tensor]  # the fake run gave way
    assert reached == really_reached(loss, model)
    taken, skipped = ("first", "second") if sign > 0 else ("second", "first")
    assert f"{taken}.weight" in reached
    assert f"{skipped}.weight" not in reached


class Keeping(Segmented):
    """The segment keeps what it computed on the module, as a cache would."""

    def body(self, h: torch.Tensor) -> torch.Tensor:
        self.seen.append(type(h))
        self.last = self.first(h)
        return self.last.relu()


def test_a_segment_that_keeps_what_it_computed_is_rerun_for_real(fresh: None) -> None:
    model = Keeping()
    loss = model(IDS)
    model.seen.clear()

    reached = reachable_parameters(loss, model)

    assert model.seen == [FakeTensor, torch.Tensor]
    assert not isinstance(model.last, FakeTensor)  # the module holds a real value again
    assert torch.equal(model.last, model.first(model.embed(IDS)))
    assert reached == really_reached(loss, model)


def test_a_compile_during_the_fake_run_discards_it(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = iter([0, 1, 1])  # nothing compiled before the fake run, one frame during it
    monkeypatch.setattr(checkpointing, "compiles", lambda: next(counts))
    model = Segmented()
    loss = model(IDS)
    model.seen.clear()

    reached = reachable_parameters(loss, model)

    assert model.seen == [FakeTensor, torch.Tensor]
    assert reached == really_reached(loss, model)


def test_a_users_forward_hook_in_the_segment_makes_the_rerun_real(fresh: None) -> None:
    model = Segmented()
    kept: list[torch.Tensor] = []
    model.first.register_forward_hook(lambda module, args, output: kept.append(output))
    loss = model(IDS)
    model.seen.clear()
    kept.clear()

    reached = reachable_parameters(loss, model)

    assert model.seen == [torch.Tensor]  # no fake run was tried
    assert kept and not any(isinstance(t, FakeTensor) for t in kept)
    assert reached == really_reached(loss, model)


def test_a_global_forward_hook_makes_the_rerun_real(fresh: None) -> None:
    model = Segmented()
    loss = model(IDS)
    model.seen.clear()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        reached = reachable_parameters(loss, model)
    finally:
        handle.remove()

    assert model.seen == [torch.Tensor]
    assert reached == really_reached(loss, model)


def test_isolates_own_hooks_keep_the_fake_rerun(fresh: None) -> None:
    model = Segmented()
    model.norm = nn.BatchNorm1d(4)
    frozen = freeze(model, "norm", bn="eval")  # a mode-holding forward pre-hook
    with trace_forward(model) as trace:  # the cut-off check's forward hooks on every module
        loss = model(IDS)
        model.seen.clear()
        found = cut_off_parameters(loss, model, trace=trace)

    assert model.seen == [FakeTensor]
    assert set(found.parameters) == {"second.weight", "second.bias"}
    frozen.restore()
