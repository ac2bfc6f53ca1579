"""cut_off_parameters says why, case by case: a checkpoint whose inputs required grad but
whose output was dropped, a module that returns its own parameter, and the report's text."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from isolate.cutoff import CutOff, assert_reached, cut_off_parameters, trace_forward
from isolate.errors import BlindSpotError, IsolationTypeError, ShardedGraphError
from tests.toolkit._shared import freed_checkpoint
from tests.toolkit.test_sharding import FlatViews


class DroppedCheckpoint(nn.Module):
    """A reentrant checkpoint whose input requires grad and whose output is detached."""

    def __init__(self) -> None:
        super().__init__()
        self.segment = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.segment, x.requires_grad_(), use_reentrant=True)
        return self.head(h.detach())


def test_a_checkpoint_whose_inputs_required_grad_is_told_apart() -> None:
    model = DroppedCheckpoint()
    with trace_forward(model) as trace:
        loss = model(torch.randn(3, 4)).sum()
    cut = cut_off_parameters(loss, model, trace=trace)
    assert list(cut.parameters) == ["segment.weight", "segment.bias"]
    assert cut.parameters["segment.weight"] == (
        "'segment' (Linear) ran inside a reentrant checkpoint whose output does not reach the loss"
    )


class CheckpointedAdapter(nn.Module):
    """Frozen embedding and head around a trainable adapter in a reentrant checkpoint: the
    checkpoint's input does not require grad, so the loss has no graph at all."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4).requires_grad_(False)
        self.adapter = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1).requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.adapter, self.embed(tokens), use_reentrant=True)
        return self.head(h).sum()


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_a_loss_without_graph_is_explained_by_the_trace() -> None:
    model = CheckpointedAdapter()
    with trace_forward(model) as trace:
        loss = model(torch.tensor([1, 2, 3]))
    assert not loss.requires_grad  # loss.backward() would raise
    cut = cut_off_parameters(loss, model, trace=trace)
    assert list(cut.parameters) == ["adapter.weight", "adapter.bias"]
    assert cut.parameters["adapter.weight"] == (
        "'adapter' (Linear) ran inside a reentrant checkpoint whose inputs do not require "
        "grad, so the segment's output carries no graph. Fix: make the segment's input "
        "require grad (x.requires_grad_(); in transformers, model.enable_input_require_grads()) "
        "or use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
    )
    with trace_forward(model) as trace, torch.no_grad():
        loss = model.head(model.adapter(model.embed(torch.tensor([1]))))
    reason = cut_off_parameters(loss, model, trace=trace).parameters["adapter.bias"]
    assert reason.startswith("'adapter' (Linear) ran with gradient tracking off")
    assert (
        cut_off_parameters(loss, model).parameters["adapter.bias"].startswith("no loss has a graph")
    )


class UnusedBesideFrozen(nn.Module):
    """A frozen layer does the work; a trainable parameter beside it is never read."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).requires_grad_(False)
        self.extra = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("head_trains", [True, False])
def test_a_module_whose_output_carries_no_graph_is_not_called_detached(head_trains: bool) -> None:
    model = nn.ModuleDict({"a": UnusedBesideFrozen(), "b": nn.Linear(3, 1)})
    model["b"].requires_grad_(head_trains)
    with trace_forward(model) as trace:
        loss = model["b"](model["a"](torch.randn(2, 3))).sum()
    assert loss.requires_grad is head_trains
    cut = cut_off_parameters(loss, model, trace=trace)
    assert list(cut.parameters) == ["a.extra"]
    assert cut.parameters["a.extra"] == (
        "'a' (UnusedBesideFrozen) ran with grad enabled, but its output carries no graph: "
        "its forward does not use this parameter, reads it through .detach() or .data, or "
        "detaches what it returns"
    )


class ReturnsItsWeight(nn.Module):
    """Returns one of its parameters as is (a leaf), and never reads the other."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self) -> torch.Tensor:
        return self.scale


def test_a_module_whose_output_is_its_own_parameter_reaches_the_loss() -> None:
    model = ReturnsItsWeight()
    with trace_forward(model) as trace:
        loss = model().sum()
    cut = cut_off_parameters(loss, model, trace=trace)
    assert list(cut.parameters) == ["unused"]
    assert cut.parameters["unused"].startswith(
        "'<root>' (ReturnsItsWeight) ran and its output reaches the loss, but not through "
        "this parameter"
    )


def test_the_report_reads_the_same_for_every_part() -> None:
    assert (
        str(CutOff({}, trainable=3)) == "0 of 3 trainable parameters get no gradient from any loss"
    )
    report = CutOff(
        {"a.weight": "why", "a.bias": "why"}, expected_unused=("c.weight", "c.bias"), trainable=6
    )
    assert str(report).splitlines() == [
        "2 of 6 trainable parameters get no gradient from any loss:",
        "  a.weight, a.bias: why",
        "expected unused: c.weight, c.bias",
    ]


@dataclasses.dataclass
class Batch:
    h: torch.Tensor
    again: Batch | None = None


class Mixer(nn.Module):
    """Reads its input from a dict, a dataclass or a keyword argument, inside any lists."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, batch: Any = None, *, h: torch.Tensor | None = None) -> torch.Tensor:
        while isinstance(batch, list):
            batch = batch[0]
        if isinstance(batch, dict):
            h = batch["h"]
        elif isinstance(batch, Batch):
            h = batch.h
        assert h is not None
        return self.linear(h)


class Branches(nn.Module):
    """``first``'s output is dropped; ``mixer`` takes the input, which requires grad, in a
    container; ``restart`` starts the loss's graph again from the dropped output."""

    def __init__(self, wrap: Callable[[torch.Tensor], tuple[tuple[Any, ...], dict[str, Any]]]):
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.mixer = Mixer()
        self.restart = nn.Linear(3, 1)
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped = self.first(x).detach()
        args, kwargs = self.wrap(x)
        return self.mixer(*args, **kwargs).sum() + self.restart(dropped).sum()


WRAPS = {
    "dict": lambda x: (({"h": x},), {}),
    "dataclass": lambda x: ((Batch(x),), {}),
    "keyword": lambda x: ((), {"h": x}),
    "deep": lambda x: ((functools.reduce(lambda inner, _: [inner], range(16), {"h": x}),), {}),
}


@pytest.mark.parametrize("wrap", WRAPS)
def test_the_graph_restarts_where_an_input_without_graph_enters(wrap: str) -> None:
    """An input that requires grad, passed in a dict, a dataclass, by keyword or nested in 16
    lists, carries a graph: that module is not where the loss's graph starts again."""
    model = Branches(WRAPS[wrap])
    with trace_forward(model) as trace:
        loss = model(torch.randn(2, 3).requires_grad_())
    assert trace.model is model
    cut = cut_off_parameters(loss, model, trace=trace)
    assert list(cut.parameters) == ["first.weight", "first.bias"]
    assert cut.parameters["first.weight"].endswith(
        "; the loss's graph starts again at 'restart' (Linear), whose input carries no graph"
    )


def test_the_trace_never_breaks_a_forward_on_a_container_that_holds_itself() -> None:
    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, state: object) -> torch.Tensor:
            return self.body(x)

    model = Loop()
    listed: list[object] = []
    listed.append(listed)
    mapped: dict[str, object] = {}
    mapped["self"] = mapped
    batch = Batch(torch.randn(2, 3))
    batch.again = batch
    for state in (listed, mapped, batch):
        with trace_forward(model) as trace:
            loss = model(torch.randn(2, 3), state).sum()
        assert cut_off_parameters(loss, model, trace=trace).clean


def test_a_trace_of_the_wrong_type_is_named() -> None:
    model = nn.Linear(3, 1)
    loss = model(torch.randn(2, 3)).sum()
    with pytest.raises(
        IsolationTypeError, match=r"isolate\.cutoff\.trace_forward\(model\), got dict$"
    ):
        cut_off_parameters(loss, model, trace={})  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# What the cut-off audits cannot see, they refuse in their own name


def test_a_mapping_of_losses_that_holds_no_tensor_names_its_key() -> None:
    """A forward that returns its metrics beside the loss: the key, not an index, is named."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(2, 3)
    with pytest.raises(
        IsolationTypeError,
        match=r"^assert_reached\(\): every loss must be a torch\.Tensor; got float under "
        r"'accuracy'; pass only the loss tensors \(not metrics, not loss\.item\(\)\)$",
    ):
        assert_reached({"loss": model(x).sum(), "accuracy": 0.5}, model)
    with pytest.raises(IsolationTypeError, match=r"^cut_off_parameters\(\): .* tuple under 'h'"):
        cut_off_parameters({"loss": model(x).sum(), "h": (model[0](x),)}, model)


def test_a_segment_that_cannot_be_re_run_is_refused_in_the_callers_name() -> None:
    lin = nn.Linear(3, 3)
    out = freed_checkpoint(lin)
    for audit, caller in (
        (lambda: cut_off_parameters(out, lin), r"cut_off_parameters\(\)"),
        (lambda: assert_reached(out, lin), r"assert_reached\(\)"),
    ):
        with pytest.raises(BlindSpotError, match=rf"^{caller}: cannot re-run .* saved arguments"):
            audit()


def test_hidden_leaves_are_refused_in_the_callers_name() -> None:
    model = FlatViews(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)))
    loss = model(torch.randn(2, 3)).sum()
    # Brute force: the backward writes to the hidden leaf, never to the registered parameters.
    assert torch.autograd.grad(loss, list(model.parameters()), allow_unused=True) == (None,) * 4
    for audit, caller in (
        (lambda: cut_off_parameters(loss, model), r"cut_off_parameters\(\)"),
        (lambda: assert_reached(loss, model), r"assert_reached\(\)"),
    ):
        with pytest.raises(ShardedGraphError, match=rf"^{caller}: the graph's leaves"):
            audit()
