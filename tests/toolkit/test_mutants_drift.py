"""Snapshots and optimizer exposure, to the value and the word: tied and shared tensors under
every name, mapping snapshots, complex and empty tensors, NaN, the per-element count at the
atol boundary, and the exact report. Written to kill the mutants of isolate/drift.py that the
rest of the suite let through (see the README's development section)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from isolate import snapshot
from isolate.drift import max_abs_diff
from isolate.errors import DriftError, IsolationTypeError
from isolate.exposure import optimizer_exposure


def test_max_abs_diff_of_empty_complex_and_mixed_tensors() -> None:
    assert max_abs_diff(torch.empty(0), torch.empty(0)) == 0.0
    assert max_abs_diff(torch.tensor([1 + 1j]), torch.tensor([1 + 2j])) == 1.0
    assert max_abs_diff(torch.tensor([1 + 1j]), torch.tensor([1.0])) == 1.0  # imaginary part
    assert max_abs_diff(torch.zeros(2), torch.zeros(3)) == math.inf


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("stat", torch.zeros(2))
        self.inner = nn.Module()
        self.inner.register_buffer("stat", self.stat)  # the same buffer under a second name


def test_tied_and_shared_tensors_are_watched_under_every_name() -> None:
    model = Tied()
    nn.init.zeros_(model.a.weight)  # exact deltas below
    snap = snapshot(model)
    assert snap.names == ("a.weight", "b.weight", "stat", "inner.stat")
    assert snap.changed() == {}
    snap.assert_unchanged()
    with torch.no_grad():
        model.a.weight.add_(0.25)
        model.stat.add_(0.5)
    assert snap.changed() == {"a.weight": 0.25, "b.weight": 0.25, "stat": 0.5, "inner.stat": 0.5}


def test_a_mapping_snapshot_compares_the_tensors_it_was_given() -> None:
    w, b = nn.Parameter(torch.zeros(3)), torch.zeros(2)
    snap = snapshot({"w": w, "b": b})
    assert repr(snap) == "Snapshot(2 named tensors: 1 parameters, 1 buffers)"
    assert snap.changed() == {} and snap.replaced() == ()
    with torch.no_grad():
        w.copy_(torch.tensor([1.0, 0.5, 0.0]))
    b[0] = math.nan
    assert snap.changed(atol=0.5) == {"w": 1.0, "b": pytest.approx(math.nan, nan_ok=True)}
    with pytest.raises(DriftError) as info:
        snap.assert_unchanged(atol=0.5)
    assert str(info.value) == (
        "assert_unchanged(): 2 of 2 tensors changed since the snapshot of 2 named tensors "
        "(atol=0.5):\n"
        "  w  (parameter, requires_grad=True) max|Δ|=1.000e+00 in 1 of 3 elements\n"
        "  b  (buffer) max|Δ|=nan in 1 of 2 elements\n"
        "Fix: a parameter with requires_grad=False still moves when its .grad is a zero "
        "tensor and the optimizer has weight decay or momentum: call "
        "optimizer.zero_grad(set_to_none=True) or drop it from the optimizer "
        "(isolate.exposure.optimizer_exposure lists such parameters); BatchNorm running statistics "
        "update in train mode whatever requires_grad says: put those layers in eval mode "
        "(isolate.freeze(..., bn='eval'))"
    )


def test_snapshot_refuses_what_it_cannot_compare_naming_the_types() -> None:
    with pytest.raises(
        IsolationTypeError,
        match=r"^snapshot\(\): a mapping target must map names to tensors; got int -> Tensor$",
    ):
        snapshot({1: torch.zeros(1)})  # type: ignore[dict-item]
    with pytest.raises(
        IsolationTypeError, match=r"^snapshot\(\): a mapping target .* got str -> float$"
    ):
        snapshot({"x": 1.0})  # type: ignore[dict-item]


def _frozen_param(**group: float) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    p = nn.Parameter(torch.ones(2))
    return p, torch.optim.SGD([p], lr=0.1, **group)


def test_exposure_reasons_and_their_text() -> None:
    p, opt = _frozen_param()
    p.requires_grad_(False)
    (harmless,) = optimizer_exposure(opt)
    assert not harmless.at_risk and not harmless.moves_on_step
    assert str(harmless) == (
        "param_groups[0][0] (param group 0, .grad none): harmless while .grad is None or zero"
    )

    q, opt = _frozen_param(momentum=0.9, weight_decay=0.1)
    q.grad = torch.ones(2)
    opt.step()
    q.requires_grad_(False)
    (both,) = optimizer_exposure(opt)
    assert both.grad == "nonzero" and both.moves_on_step
    assert str(both) == (
        "param_groups[0][0] (param group 0, .grad nonzero): weight_decay=0.1 shrinks it on "
        "every step; optimizer state 'momentum_buffer' is non-zero and keeps moving it"
    )

    r = nn.Parameter(torch.ones(2))
    asgd = torch.optim.ASGD([r], lr=0.1)
    r.requires_grad_(False)
    (decays,) = optimizer_exposure(asgd)
    assert decays.reasons == ("lambd=0.0001 (ASGD) shrinks it on every step",)


def test_a_momentum_buffer_of_zeros_moves_nothing() -> None:
    p, opt = _frozen_param(momentum=0.9)
    p.grad = torch.zeros(2)
    opt.step()  # the momentum buffer exists and holds zeros
    p.requires_grad_(False)
    (exposure,) = optimizer_exposure(opt)
    assert exposure.grad == "zero" and exposure.reasons == () and not exposure.moves_on_step


def test_optimizer_exposure_names_the_wrong_types() -> None:
    with pytest.raises(
        IsolationTypeError,
        match=r"^optimizer_exposure\(\): optimizer must be a torch\.optim\.Optimizer, got int;",
    ):
        optimizer_exposure(3)  # type: ignore[arg-type]
    _, opt = _frozen_param()
    with pytest.raises(
        IsolationTypeError,
        match=r"^optimizer_exposure\(\): model must be a torch\.nn\.Module, got str$",
    ):
        optimizer_exposure(opt, "model")  # type: ignore[arg-type]


def test_exposures_are_named_in_the_model_under_their_first_name() -> None:
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    model.requires_grad_(False)
    assert [e.name for e in optimizer_exposure(opt, model)] == ["a.weight"]


class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.tensor([1 + 1j, 2 + 0j]))


@pytest.mark.parametrize(
    "new", [torch.tensor([1 + 2j, 2 + 0j]), torch.tensor([1.0, 2.0])], ids=["complex", "real"]
)
def test_complex_buffers_are_compared_element_by_element(new: torch.Tensor) -> None:
    model = _Complex()
    snap = snapshot(model)
    model.c = new  # replaced: by a complex tensor, or by a real one that drops the imaginary 1j
    with pytest.raises(DriftError) as info:
        snap.assert_unchanged()
    assert str(info.value).splitlines()[1] == (
        "  c  (buffer, replaced by a new object) max|Δ|=1.000e+00 in 1 of 2 elements"
    )
