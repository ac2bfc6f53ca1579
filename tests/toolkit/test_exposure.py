"""optimizer_exposure: which optimizer groups and states would move a frozen parameter on the
next ``step()``, checked against a real step, and what each exposure says, to the word."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isolate.drift import snapshot
from isolate.errors import IsolationTypeError
from isolate.exposure import Exposure, _nonzero, optimizer_exposure
from tests.toolkit._shared import OPTIMIZERS, Tied


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("warm", [True, False], ids=["after-a-step", "fresh"])
def test_exposure_predicts_what_the_next_step_does(name: str, warm: bool) -> None:
    """For each optimizer, a zero grad moves a frozen parameter exactly when it says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = OPTIMIZERS[name](model.parameters())
    if warm:
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    model[0].requires_grad_(False)
    for p in model[0].parameters():
        p.grad = torch.zeros_like(p)
    exposures = optimizer_exposure(opt, model)
    assert [e.name for e in exposures] == ["0.weight", "0.bias"]
    assert all(e.grad == "zero" for e in exposures)
    snap = snapshot(model[0])
    opt.step()
    moved = set(snap.changed())
    assert {e.name.removeprefix("0.") for e in exposures if e.moves_on_step} == moved
    for p in model[0].parameters():
        p.grad = None
    assert not any(e.moves_on_step for e in optimizer_exposure(opt, model))
    snap = snapshot(model[0])
    opt.step()
    assert snap.changed() == {}  # every built-in optimizer skips a None grad


def test_exposure_fields_and_text() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1), nn.Linear(1, 1))
    opt = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "weight_decay": 0.0},
            {"params": [*model[1].parameters(), *model[2].parameters()], "weight_decay": 1e-2},
        ],
        lr=0.1,
        momentum=0.9,
    )
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    model[0].weight.grad = None
    exposures = optimizer_exposure(opt, model)
    by_name = {e.name: e for e in exposures}
    assert list(by_name) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    w0 = by_name["0.weight"]
    assert (w0.group, w0.index, w0.grad) == (0, 0, "none")
    assert w0.at_risk and not w0.moves_on_step
    assert w0.reasons == ("optimizer state 'momentum_buffer' is non-zero and keeps moving it",)
    b2 = by_name["2.bias"]
    assert (b2.group, b2.index, b2.grad) == (1, 3, "nonzero")  # a stale grad from before
    assert b2.moves_on_step
    assert b2.reasons[0] == "weight_decay=0.01 shrinks it on every step"
    assert str(b2).startswith("2.bias (param group 1, .grad nonzero): weight_decay=0.01")
    assert isinstance(b2, Exposure)
    unnamed = optimizer_exposure(opt)
    assert [e.name for e in unnamed] == [
        "param_groups[0][0]",
        "param_groups[0][1]",
        "param_groups[1][2]",
        "param_groups[1][3]",
    ]


def test_exposure_of_a_clean_optimizer_is_empty() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters())
    assert optimizer_exposure(opt, model) == ()
    model.weight.requires_grad_(False)
    (only,) = optimizer_exposure(opt, model)
    assert only.name == "weight" and only.grad == "none"
    assert (
        str(only)
        == "weight (param group 0, .grad none): weight_decay=0.01 shrinks it on every step"
    )


def test_exposure_unwraps_a_lightning_style_wrapper() -> None:
    model = nn.Linear(2, 1).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Wrapped:
        optimizer = opt

    assert [e.name for e in optimizer_exposure(Wrapped(), model)] == ["weight", "bias"]  # type: ignore[arg-type]


def test_exposure_errors() -> None:
    with pytest.raises(IsolationTypeError, match=r"^optimizer_exposure\(\): optimizer must be"):
        optimizer_exposure(nn.Linear(1, 1))  # type: ignore[arg-type]
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(IsolationTypeError, match=r"^optimizer_exposure\(\): model must be"):
        optimizer_exposure(opt, "model")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The reasons, to the word


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


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["csr", "coo", "strided"])
def test_a_momentum_buffer_is_nonzero_by_its_stored_values_in_any_layout(layout: str) -> None:
    dense = torch.zeros(3, 4)
    dense[1, 2] = 0.5
    make = {
        "csr": torch.Tensor.to_sparse_csr,
        "coo": torch.Tensor.to_sparse,
        "strided": torch.Tensor.clone,
    }[layout]
    assert _nonzero(make(dense)) is True
    assert _nonzero(make(torch.zeros(3, 4))) is False
    explicit_zero = torch.sparse_coo_tensor(
        [[0, 0]], torch.zeros(2, 4), (3, 4), check_invariants=True
    )
    assert _nonzero(explicit_zero) is False  # stored, uncoalesced, all zero
