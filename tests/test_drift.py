"""snapshot / Snapshot / optimizer_exposure: catching what moves when it should not."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

from isolate.drift import Exposure, Snapshot, optimizer_exposure, snapshot
from isolate.errors import DriftError, IsolationTypeError, SelectorError


def mnist_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


IMAGES = torch.randn(8, 1, 12, 12)

Factory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "SGD-weight-decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.1),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.1),
    "RMSprop-momentum": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.1),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.1),
}


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(IMAGES).pow(2).mean().backward()
    opt.step()


# --------------------------------------------------------------------------------------------
# The failure this module exists for


@pytest.mark.parametrize("name", ["SGD-momentum", "AdamW"])
def test_frozen_parameters_with_zero_grad_still_move(name: str) -> None:
    model = mnist_cnn()
    opt = OPTIMIZERS[name](model.parameters())
    train_step(model, opt)  # builds momentum / Adam state
    head = model[5]
    head.requires_grad_(False)
    snap = snapshot(model, parameters="frozen", buffers=False)
    assert snap.names == ("5.weight", "5.bias")
    for p in head.parameters():
        p.grad = torch.zeros_like(p)  # what zero_grad(set_to_none=False) leaves behind
    opt.step()
    changed = snap.changed()
    assert set(changed) == {"5.weight", "5.bias"}
    assert all(delta > 0 for delta in changed.values())
    with pytest.raises(DriftError, match=r"^assert_unchanged\(\): 2 of 2 tensors changed") as info:
        snap.assert_unchanged()
    message = str(info.value)
    assert "5.weight" in message and "requires_grad=False" in message
    assert f"max|Δ|={changed['5.weight']:.3e} in 640 of 640 elements" in message
    assert "zero_grad(set_to_none=True)" in message and "optimizer_exposure" in message
    assert isinstance(info.value, AssertionError)


@pytest.mark.parametrize("name", ["SGD-momentum", "AdamW"])
def test_frozen_parameters_with_grad_none_do_not_move(name: str) -> None:
    model = mnist_cnn()
    opt = OPTIMIZERS[name](model.parameters())
    train_step(model, opt)
    model[5].requires_grad_(False)
    snap = snapshot(model, parameters="frozen", buffers=False)
    opt.zero_grad(set_to_none=True)
    model(IMAGES).pow(2).mean().backward()
    opt.step()
    assert snap.changed() == {}
    snap.assert_unchanged()
    assert snapshot(model, parameters="trainable").names != ()  # the rest did train


def test_batchnorm_statistics_move_in_train_mode_whatever_requires_grad_says() -> None:
    model = mnist_cnn().requires_grad_(False)
    snap = snapshot(model)
    with torch.no_grad():
        model(IMAGES)
    changed = snap.changed()
    assert set(changed) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert changed["1.num_batches_tracked"] == 1.0
    with pytest.raises(DriftError, match=r"1\.running_mean +\(buffer\) max\|Δ\|=") as info:
        snap.assert_unchanged()
    assert "bn='eval'" in str(info.value) and "zero_grad" not in str(info.value)
    model.eval()
    snap = snapshot(model)
    with torch.no_grad():
        model(IMAGES)
    snap.assert_unchanged()


# --------------------------------------------------------------------------------------------
# Snapshot mechanics


def test_snapshot_is_a_copy_on_cpu_and_touches_nothing() -> None:
    model = mnist_cnn()
    snap = snapshot(model)
    assert isinstance(snap, Snapshot)
    assert len(snap) == 4 + 3 + 2 and list(snap)[:2] == ["0.weight", "0.bias"]
    assert repr(snap) == "Snapshot(Sequential: 6 parameters, 3 buffers)"
    saved = snap._entries[0].saved
    assert saved.device.type == "cpu" and not saved.requires_grad
    assert saved.data_ptr() != model[0].weight.data_ptr()
    assert all(p.grad is None for p in model.parameters())
    on_device = snapshot(model, device=None)
    assert on_device._entries[0].saved.data_ptr() != model[0].weight.data_ptr()


def test_changed_reports_max_abs_delta_by_name() -> None:
    model = nn.Linear(3, 2)
    snap = snapshot(model)
    with torch.no_grad():
        model.weight[0, 1] += 0.25
        model.bias[1] -= 1e-7
    changed = snap.changed()
    assert changed["weight"] == pytest.approx(0.25) and 0 < changed["bias"] < 1e-6
    assert list(snap.changed(atol=1e-3)) == ["weight"]
    snap.assert_unchanged(atol=0.3)
    with pytest.raises(DriftError, match=r"max\|Δ\|=2\.500e-01 in 1 of 6 elements"):
        snap.assert_unchanged(atol=1e-3)


def test_tied_parameters_share_one_copy_and_report_every_name() -> None:
    embed, decoder = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    decoder.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "decoder": decoder})
    snap = snapshot(model)
    assert snap.names == ("embed.weight", "decoder.weight")
    assert snap._entries[0].saved is snap._entries[1].saved
    with torch.no_grad():
        embed.weight.mul_(2)
    assert set(snap.changed()) == {"embed.weight", "decoder.weight"}


def test_replaced_parameters_are_noticed() -> None:
    model = nn.Linear(2, 2)
    snap = snapshot(model)
    model.bias = nn.Parameter(model.bias.detach().clone())  # same values, new object
    assert snap.changed() == {}
    assert snap.replaced() == ("bias",)
    model.weight = nn.Parameter(torch.zeros(3, 3))
    assert snap.changed()["weight"] == math.inf
    with pytest.raises(DriftError, match=r"replaced by a new object\) changed shape \(2, 2\)"):
        snap.assert_unchanged()


def test_missing_names_nan_and_integer_buffers() -> None:
    model = nn.Module()
    model.register_buffer("steps", torch.tensor(3))
    model.register_buffer("flags", torch.tensor([True, False]))
    model.register_buffer("values", torch.tensor([1.0, math.nan]))
    snap = snapshot(model)
    assert snap.changed() == {}  # NaN where there was NaN is no change
    model.steps += 2
    model.flags[1] = True
    model.values[1] = 0.0
    changed = snap.changed()
    assert changed["steps"] == 2.0 and changed["flags"] == 1.0 and math.isnan(changed["values"])
    del model.steps
    assert snap.changed()["steps"] == math.inf
    with pytest.raises(DriftError, match=r"steps +\(buffer\) is gone"):
        snap.assert_unchanged()


def test_mapping_snapshots() -> None:
    model = mnist_cnn()
    snap = snapshot(dict(model[1].named_buffers()))
    assert snap.names == ("running_mean", "running_var", "num_batches_tracked")
    model(IMAGES)
    assert set(snap.changed()) == set(snap.names)
    assert snap.replaced() == ()


def test_parameter_filters() -> None:
    model = mnist_cnn()
    model[0].requires_grad_(False)
    assert snapshot(model, parameters="frozen", buffers=False).names == ("0.weight", "0.bias")
    assert snapshot(model, parameters="trainable", buffers=False).names == (
        "1.weight",
        "1.bias",
        "5.weight",
        "5.bias",
    )
    assert snapshot(model, parameters="none").names == (
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    )


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: snapshot([nn.Linear(1, 1)]), IsolationTypeError, r"^snapshot\(\): target must"),
        (lambda: snapshot({"a": 1}), IsolationTypeError, r"^snapshot\(\): a mapping target"),
        (lambda: snapshot(nn.Linear(1, 1), parameters="some"), SelectorError, r"^snapshot\(\): "),
        (
            lambda: snapshot(nn.Linear(1, 1)).assert_unchanged(atol=-1.0),
            IsolationTypeError,
            r"^assert_unchanged\(\): atol must be a number >= 0",
        ),
    ],
)
def test_snapshot_errors(call: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


# --------------------------------------------------------------------------------------------
# optimizer_exposure


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
