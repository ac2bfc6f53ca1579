"""snapshot / Snapshot: catching what moves when it should not, by copies or by fingerprints,
by name, to the value and the word."""

from __future__ import annotations

import gc
import math
import re
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from isolate.drift import Drift, Snapshot, max_abs_diff, snapshot
from isolate.errors import DriftError, IsolationTypeError, SelectorError
from tests.toolkit._shared import ALL_DTYPES, OPTIMIZERS, Tied, sample


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


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
def test_a_dtype_change_that_keeps_every_value_is_a_change_in_both_modes(drift: Drift) -> None:
    model = nn.Linear(2, 2)
    model.requires_grad_(False)
    model.register_buffer("steps", torch.tensor(7))
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -1.0], [2.0, 0.25]]))  # exact in bfloat16
    snap = snapshot(model, drift=drift)
    model.weight.data = model.weight.data.to(torch.bfloat16)
    model.steps = model.steps.to(torch.int32)
    assert snap.changed() == {"weight": math.inf, "steps": math.inf}
    with pytest.raises(DriftError) as info:
        snap.assert_unchanged()
    lines = str(info.value).splitlines()
    assert lines[1] == (
        "  weight  (parameter, requires_grad=False) changed dtype torch.float32 -> torch.bfloat16"
    )
    assert lines[2] == (
        "  steps   (buffer, replaced by a new object) changed dtype torch.int64 -> torch.int32"
    )


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
def test_a_tensor_with_no_values_is_refused_by_name_at_the_snapshot_and_at_the_check(
    drift: Drift,
) -> None:
    with pytest.raises(IsolationTypeError) as info:
        snapshot(nn.Linear(2, 2).to("meta"), drift=drift)
    assert str(info.value) == (
        "snapshot(): 'weight' is a meta tensor, with no values to record; load the weights "
        "(to_empty() then load_state_dict()) before the snapshot"
    )
    with pytest.raises(IsolationTypeError) as info:
        snapshot(nn.Sequential(nn.LazyLinear(2)), drift=drift)
    assert str(info.value) == (
        "snapshot(): '0.weight' is an uninitialised lazy parameter, with no values yet; run "
        "one forward pass to materialise it before the snapshot"
    )
    model = nn.Linear(2, 2)
    snap = snapshot(model, drift=drift)
    model.to("meta")
    for check, caller in (
        (snap.changed, "changed()"),
        (snap.assert_unchanged, "assert_unchanged()"),
        (snap.replaced, "replaced()"),
    ):
        with pytest.raises(IsolationTypeError) as info:
            check()
        assert str(info.value) == (
            f"{caller}: 'weight' is now a meta tensor, with no values to compare with the "
            f"snapshot; check it before the model leaves its weights"
        )


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
def test_a_quantised_tensor_is_refused_by_name_since_its_scale_is_not_in_its_values(
    drift: Drift,
) -> None:
    model = nn.Module()
    model.register_buffer("q", torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8))
    with pytest.raises(IsolationTypeError) as info:
        snapshot(model, drift=drift)
    assert str(info.value) == (
        "snapshot(): 'q' is a quantised torch.qint8 tensor, which cannot be compared; record "
        "its int_repr(), q_scale() and q_zero_point() (or its dequantize()) instead"
    )


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
        (
            lambda: snapshot(nn.Linear(1, 1), drift="fingerprint").assert_unchanged(atol=0.1),
            IsolationTypeError,
            r"^assert_unchanged\(\): atol=0\.1 needs the size of a change, which a fingerprint "
            r"snapshot does not know; take snapshot\(\.\.\., drift='copy'\) to allow a tolerance$",
        ),
    ],
)
def test_snapshot_errors(call: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


def test_an_infinite_tolerance_is_refused_since_nothing_could_fail_it() -> None:
    model = nn.Linear(2, 2)
    snap = snapshot(model)
    model.weight = nn.Parameter(torch.zeros(3, 3))  # changed shape: reported as inf
    for check, caller in (
        (snap.changed, "changed()"),
        (snap.assert_unchanged, "assert_unchanged()"),
    ):
        with pytest.raises(IsolationTypeError) as info:
            check(atol=math.inf)
        assert str(info.value) == f"{caller}: atol must be a number >= 0, got inf"
    assert snap.changed(atol=1e300) == {"weight": math.inf}


# --------------------------------------------------------------------------------------------
# snapshot(drift="fingerprint"): fingerprints instead of copies


def test_fingerprint_snapshot_finds_what_moved_and_says_the_size_is_unknown() -> None:
    model = mnist_cnn()
    snap = snapshot(model, drift="fingerprint")
    assert snap.drift == "fingerprint" and snapshot(model).drift == "copy"
    assert repr(snap) == "Snapshot(Sequential: 6 parameters, 3 buffers, fingerprints)"
    assert snap.changed() == {}
    snap.assert_unchanged()
    with torch.no_grad():
        model(IMAGES)  # train mode: BatchNorm statistics move
        model[5].weight.view(-1)[17] = torch.nextafter(
            model[5].weight.view(-1)[17], torch.tensor(9.0)
        )
    changed = snap.changed()
    assert set(changed) == {"5.weight", "1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert all(math.isnan(d) for d in changed.values())
    with pytest.raises(DriftError, match=r"^assert_unchanged\(\): 4 of 9 tensors changed") as info:
        snap.assert_unchanged()
    message = str(info.value)
    assert re.search(
        r"5\.weight +\(parameter, requires_grad=True\) changed \(fingerprint differs", message
    )
    assert "drift='copy'" in message and "bn='eval'" in message
    with pytest.raises(IsolationTypeError, match=r"^changed\(\): atol=0.1 needs the size"):
        snap.changed(atol=0.1)
    with pytest.raises(IsolationTypeError, match=r"^assert_unchanged\(\): atol=0.1 needs"):
        snap.assert_unchanged(atol=0.1)


def test_fingerprint_snapshot_shape_changes_and_missing_names() -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("steps", torch.tensor(3))
    snap = snapshot(model, drift="fingerprint")
    model.weight = nn.Parameter(torch.zeros(3, 3))
    del model.steps
    assert snap.changed() == {"weight": math.inf, "steps": math.inf}
    with pytest.raises(DriftError, match=r"changed shape \(2, 2\) -> \(3, 3\)") as info:
        snap.assert_unchanged()
    assert re.search(r"steps +\(buffer\) is gone", str(info.value))


def test_fingerprint_snapshot_holds_no_copy() -> None:
    """O(number of tensors) memory: no tensor of any size, and no reference that keeps a
    replaced parameter alive."""
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    snap = snapshot(model, drift="fingerprint")
    held = [
        value
        for entry in snap._entries
        for value in vars(entry).values()
        if isinstance(value, torch.Tensor)
    ]
    assert held == [] and all(e.saved is None for e in snap._entries)
    old = model[0].weight
    alive = weakref.ref(old)
    model[0].weight = nn.Parameter(old.detach().clone())
    del old
    gc.collect()
    assert alive() is None  # the snapshot did not keep the replaced parameter
    assert snap.replaced() == ("0.weight",) and snap.changed() == {}
    with torch.no_grad():
        model[0].weight[0, 0] += 1
    assert list(snap.changed()) == ["0.weight"]


def test_tied_parameters_share_one_fingerprint() -> None:
    embed, decoder = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    decoder.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "decoder": decoder})
    snap = snapshot(model, drift="fingerprint")
    assert snap.names == ("embed.weight", "decoder.weight")
    with torch.no_grad():
        embed.weight[4, 2] = -embed.weight[4, 2]
    assert set(snap.changed()) == {"embed.weight", "decoder.weight"}


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_in_both_modes(dtype: torch.dtype, drift: Drift) -> None:
    model = nn.Module()
    model.register_buffer("b", sample(dtype, 5, 3))
    model.p = nn.Parameter(sample(dtype, 4), requires_grad=False)  # type: ignore[assignment]
    snap = snapshot(model, drift=drift)
    assert snap.changed() == {}
    with torch.no_grad():
        if dtype == torch.bool:
            model.b[2, 1] = ~model.b[2, 1]
        else:
            model.b[2, 1] = model.b[2, 1] + 1
    changed = snap.changed()
    assert list(changed) == ["b"]
    if drift == "copy":
        assert changed["b"] == pytest.approx(1.0, rel=0.01)
    else:
        assert math.isnan(changed["b"])


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
def test_sparse_buffers_in_both_modes(drift: Drift) -> None:
    """Sparse buffers are compared by their values (torch.equal is not implemented for sparse
    tensors), an entry that moved included."""
    model = nn.Module()
    model.register_buffer("coo", torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,)).coalesce())
    model.register_buffer("csr", torch.eye(3).to_sparse_csr())
    snap = snapshot(model, drift=drift)
    assert snap.changed() == {}
    snap.assert_unchanged()
    with torch.no_grad():
        model.coo.values()[1] += 0.5
        model.csr.values()[0] = 3.0
    changed = snap.changed()
    assert list(changed) == ["coo", "csr"]
    if drift == "copy":
        assert changed == {"coo": 0.5, "csr": 2.0}
        with pytest.raises(DriftError, match=r"coo +\(buffer\) max\|Δ\|=5\.000e-01 in 1 of"):
            snap.assert_unchanged()
    model.coo = torch.sparse_coo_tensor([[1, 2]], [1.0, 2.5], (4,))  # an entry moved
    moved = snap.changed()["coo"]
    assert moved == 1.0 if drift == "copy" else math.isnan(moved)


def test_max_abs_diff_of_sparse_tensors() -> None:
    a = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    b = torch.sparse_coo_tensor([[0, 3]], [1.0, -1.0], (4,))
    assert max_abs_diff(a, a.clone()) == 0.0
    assert max_abs_diff(a, b) == 2.0  # 2.0 gone at index 2; -1.0 new at index 3 counts 1.0
    assert max_abs_diff(a, a.to_dense()) == 0.0
    assert max_abs_diff(torch.eye(2).to_sparse_csr(), (2 * torch.eye(2)).to_sparse_csr()) == 1.0


# --------------------------------------------------------------------------------------------
# Checks follow names, not captured objects: Lightning's StochasticWeightAveraging replaces
# BatchNorm's buffers with new tensors, and the new values are what must be checked


def swa_like_reset(bn: nn.BatchNorm1d) -> None:
    """What Lightning's StochasticWeightAveraging does to BatchNorm: new buffer objects."""
    assert bn.running_mean is not None and bn.running_var is not None
    bn.running_mean = torch.zeros_like(bn.running_mean)
    bn.running_var = torch.ones_like(bn.running_var)


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
def test_a_replaced_buffer_is_checked_by_its_new_value(drift: Drift) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        model[1].running_mean.fill_(0.5)
        model[1].running_var.fill_(2.0)
    model[0].requires_grad_(False)
    held = ["0.weight", "0.bias", "1.running_mean", "1.running_var"]
    by_name = snapshot(model, names=held, drift=drift)
    captured = snapshot(
        {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if n in held},
        drift=drift,
    )
    assert by_name.names == tuple(held)
    swa_like_reset(model[1])
    changed = by_name.changed()
    assert list(changed) == ["1.running_mean", "1.running_var"]
    if drift == "copy":
        assert changed == {"1.running_mean": 0.5, "1.running_var": 1.0}
    assert by_name.replaced() == ("1.running_mean", "1.running_var")
    with pytest.raises(DriftError, match=r"1\.running_var +\(buffer, replaced by a new object\)"):
        by_name.assert_unchanged()
    # The trap the Note of snapshot() documents: a mapping checks the old objects.
    assert captured.changed() == {} and captured.replaced() == ()


def test_names_errors() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(SelectorError, match=r"^snapshot\(\): \['0\.wieght'\] name no parameter"):
        snapshot(model, names=["0.wieght"])
    with pytest.raises(SelectorError, match=r"^snapshot\(\): names= picks tensors itself"):
        snapshot(model, names=["0.weight"], parameters="frozen")
    with pytest.raises(IsolationTypeError, match=r"^snapshot\(\): names= selects from a module"):
        snapshot({"a": torch.zeros(1)}, names=["a"])
    assert snapshot(model, names="1.running_mean").names == ("1.running_mean",)
    with pytest.raises(SelectorError, match=r"^snapshot\(\): drift=.none. is not a way to record"):
        snapshot(model, drift="none")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# To the value and the word: tied and shared tensors under every name, mapping snapshots,
# complex and empty tensors, NaN, the per-element count at the atol boundary, the report


def test_max_abs_diff_of_empty_complex_and_mixed_tensors() -> None:
    assert max_abs_diff(torch.empty(0), torch.empty(0)) == 0.0
    assert max_abs_diff(torch.tensor([1 + 1j]), torch.tensor([1 + 2j])) == 1.0
    assert max_abs_diff(torch.tensor([1 + 1j]), torch.tensor([1.0])) == 1.0  # imaginary part
    assert max_abs_diff(torch.zeros(2), torch.zeros(3)) == math.inf


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


class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.tensor([1 + 1j, 2 + 0j]))


def test_complex_buffers_are_compared_element_by_element() -> None:
    model = _Complex()
    snap = snapshot(model)
    model.c = torch.tensor([1 + 2j, 2 + 0j])
    with pytest.raises(DriftError) as info:
        snap.assert_unchanged()
    assert str(info.value).splitlines()[1] == (
        "  c  (buffer, replaced by a new object) max|Δ|=1.000e+00 in 1 of 2 elements"
    )


def test_a_complex_buffer_replaced_by_a_real_one_changed_dtype() -> None:
    model = _Complex()
    snap = snapshot(model)
    model.c = torch.tensor([1.0, 2.0])  # drops the imaginary 1j
    assert snap.changed() == {"c": math.inf}
    assert max_abs_diff(torch.tensor([1 + 1j, 2 + 0j]), model.c) == 1.0
    with pytest.raises(DriftError) as info:
        snap.assert_unchanged()
    assert str(info.value).splitlines()[1] == (
        "  c  (buffer, replaced by a new object) changed dtype torch.complex64 -> torch.float32"
    )


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
def test_a_renewed_snapshot_keeps_its_names_and_its_way_and_forgets_what_moved(
    drift: Drift,
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    by_name = snapshot(model, names=["0.bias", "1.running_mean"], drift=drift)
    held = snapshot({"w": model[0].weight, "mean": model[1].running_mean}, drift=drift)
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[0].bias.add_(1.0)
        model[1].running_mean.add_(1.0)
    for snap, names in ((by_name, ("0.bias", "1.running_mean")), (held, ("w", "mean"))):
        assert tuple(snap.changed()) == names
        renewed = snap.renewed()
        assert renewed.names == names and renewed.drift == drift
        assert renewed.changed() == {}
        with torch.no_grad():
            model[0].bias.add_(1.0)
            model[1].running_mean.add_(1.0)
        assert tuple(renewed.changed()) == (names[1:] if snap is held else names)


def test_a_tensor_replaced_by_the_same_values_is_no_drift() -> None:
    model = nn.Linear(2, 2)
    nn.init.zeros_(model.weight)
    snap = snapshot(model)
    model.bias = nn.Parameter(model.bias.detach().clone())  # same values, new object
    snap.assert_unchanged()
    model.weight = nn.Parameter(model.weight.detach() + 0.25)
    snap.assert_unchanged(atol=0.25)  # replaced, and moved by exactly atol: no drift
    assert snap.replaced() == ("weight", "bias")


def test_an_empty_sparse_tensor_against_zeros_stored_another_way_has_not_moved() -> None:
    """Both store nothing, but their index tensors differ in shape (one sparse dimension, a
    hybrid tensor, against two): the comparison over their entries finds none to compare."""
    hybrid = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 3), (2, 3))
    assert max_abs_diff(hybrid, torch.zeros(2, 3)) == 0.0
    assert max_abs_diff(hybrid, torch.zeros(2, 3).to_sparse()) == 0.0


def test_an_unknown_name_is_refused_with_the_modules_first_five_names_of_each_kind() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.BatchNorm1d(1), nn.Linear(1, 1), nn.BatchNorm1d(1))
    message = (
        "snapshot(): ['2.wieght'] name no parameter or buffer of Sequential; its names start "
        "['0.weight', '0.bias', '1.weight', '1.bias', '2.weight'] (buffers: ['1.running_mean', "
        "'1.running_var', '1.num_batches_tracked', '3.running_mean', '3.running_var'])"
    )
    with pytest.raises(SelectorError, match=f"^{re.escape(message)}$"):
        snapshot(model, names=["2.wieght"])


def test_names_are_recorded_as_parameters_or_buffers_and_never_held() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    snap = snapshot(model, names=["1.running_mean", "0.weight"])
    assert snap.kinds == {"1.running_mean": "buffer", "0.weight": "parameter"}
    assert repr(snap) == "Snapshot(Sequential: 1 parameters, 1 buffers)"
    weight, mean = weakref.ref(model[0].weight), weakref.ref(model[1].running_mean)
    model[0].weight = nn.Parameter(torch.zeros(2, 2))
    model[1].running_mean = torch.ones(2)
    gc.collect()
    assert weight() is None and mean() is None  # only the copies are kept, not the tensors
    assert snap.replaced() == ("1.running_mean", "0.weight")
