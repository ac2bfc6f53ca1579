"""snapshot / Snapshot / optimizer_exposure: catching what moves when it should not."""

from __future__ import annotations

import gc
import math
import re
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

from isolate import fingerprints as fingerprinting
from isolate.drift import Snapshot, max_abs_diff, snapshot
from isolate.errors import DriftError, IsolationTypeError, SelectorError
from isolate.exposure import Exposure, optimizer_exposure
from isolate.fingerprints import fingerprint


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


# --------------------------------------------------------------------------------------------
# fingerprint: every bit counts

ALL_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
]


def sample(dtype: torch.dtype, *shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(*shape, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(*shape, generator=generator).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=generator).to(
        dtype
    )


def every_single_bit_flip(t: torch.Tensor) -> Iterable[tuple[int, int, torch.Tensor]]:
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            yield byte, bit, flipped.view(t.dtype).reshape(t.shape)


SCHEMES: list[fingerprinting.Scheme] = ["host", "device"]


def by(scheme: fingerprinting.Scheme) -> Callable[[torch.Tensor], int]:
    """``fingerprint`` by one scheme, whatever device the tensor is on (this machine has
    only a CPU; the device scheme runs there the way it runs on an accelerator)."""
    return lambda t: fingerprinting._fingerprint(t, scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_single_bit_flip_changes_the_fingerprint(
    dtype: torch.dtype, scheme: fingerprinting.Scheme
) -> None:
    fp = by(scheme)
    t = sample(dtype, 7)  # an odd count: the last word is partial in both readings
    reference = fp(t)
    assert fp(t.clone()) == reference
    prints = {fp(f): (byte, bit) for byte, bit, f in every_single_bit_flip(t)}
    assert reference not in prints
    # every flip gives its own fingerprint, too: none collides with another
    assert len(prints) == t.numel() * t.element_size() * 8


@pytest.mark.parametrize("scheme", SCHEMES)
def test_single_bit_flips_anywhere_in_a_large_tensor(scheme: fingerprinting.Scheme) -> None:
    """XXH3 hashes 1 KiB blocks of 64-byte stripes and re-reads the last 64 bytes; the device
    scheme cuts lines of 2 KiB. Flip every bit at both ends and at random places between,
    and every bit of every byte around the block and line boundaries."""
    fp = by(scheme)
    raw = sample(torch.uint8, 1_000_003)  # an odd size: partial words, stripes and lines
    reference = fp(raw)
    places = [*range(96), *range(raw.numel() - 96, raw.numel())]
    places += [b + d for b in (1024, 2048, 4096, 65536) for d in (-1, 0, 1)]
    places += torch.randint(0, raw.numel(), (64,), generator=torch.Generator().manual_seed(3))
    seen = {reference}
    for byte in sorted(set(map(int, places))):
        for bit in range(8):
            raw[byte] ^= 1 << bit
            print_ = fp(raw)
            raw[byte] ^= 1 << bit
            assert print_ not in seen, (byte, bit)  # changed, and unlike any other flip
            seen.add(print_)
    assert fp(raw) == reference


def test_fingerprint_picks_its_scheme_by_where_the_tensor_lives() -> None:
    t = sample(torch.float32, 300)
    assert fingerprinting.scheme_of(t) == "host"
    assert fingerprint(t) == by("host")(t) != by("device")(t)  # two schemes: two numbers
    assert fingerprinting.fingerprints([t, t]) == {id(t): ("host", fingerprint(t))}
    forced = fingerprinting.fingerprints([t], {id(t): "device"})
    assert forced == {id(t): ("device", by("device")(t))}


def test_single_bit_flips_across_lines_chunks_and_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the geometry so a small tensor spans several lanes, lines, chunks and pieces."""
    monkeypatch.setattr(fingerprinting, "_LANES", 8)
    monkeypatch.setattr(fingerprinting, "_LINES", 4)  # a chunk is 32 words
    monkeypatch.setattr(fingerprinting, "_PIECE_BYTES", 52)  # not a multiple of a line: carries
    monkeypatch.setattr(fingerprinting, "_line_weights", {})
    monkeypatch.setattr(fingerprinting, "_lane_weights", {})
    t = sample(torch.float32, 9, 11)  # 99 words: 3 chunks and a partial one
    for scheme in SCHEMES:
        fp = by(scheme)
        reference = fp(t)
        assert fp(t.t().contiguous().t()) == reference  # non-contiguous: fed in pieces
        assert fp(t.t()) == fp(t.t().contiguous())
        prints = {fp(f) for _, _, f in every_single_bit_flip(t)}
        assert reference not in prints and len(prints) == 99 * 32, scheme


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sign_flips_do_not_cancel(scheme: fingerprinting.Scheme) -> None:
    """A plain weighted sum mod 2**64 of 8-byte words sees only the parity of top-bit flips:
    negating an even number of float64 values would go unnoticed. Here it does not."""
    fp = by(scheme)
    x = sample(torch.float64, 6)
    words = x.view(torch.int64)
    weights = torch.arange(1, 13, 2, dtype=torch.int64)  # odd weights, as a naive hash would
    assert int((words * weights).sum()) == int((x.neg().view(torch.int64) * weights).sum())
    assert fp(x.neg()) != fp(x)
    for dtype in ALL_DTYPES[:6]:
        t = sample(dtype, 2048)
        for i, j in [(0, 1), (0, 2), (3, 515), (1, 2047)]:
            negated = t.clone()
            negated[[i, j]] = -negated[[i, j]]
            assert fp(negated) != fp(t), (dtype, i, j)
        assert fp(t.neg()) != fp(t)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fingerprint_reads_values_not_strides(scheme: fingerprinting.Scheme) -> None:
    fp = by(scheme)
    x = sample(torch.float32, 64, 48)
    assert fp(x.t()) == fp(x.t().contiguous())
    assert fp(x[:, ::3]) == fp(x[:, ::3].contiguous())
    assert fp(x[1:]) == fp(x[1:].clone())  # a storage offset
    assert fp(x.reshape(48, 64)) != fp(x)  # same bytes, other shape
    assert fp(x.view(torch.int32)) != fp(x)  # same bytes, other dtype
    assert fp(torch.tensor(0.0)) != fp(torch.tensor(-0.0))  # bits, not values
    assert fp(torch.empty(0)) != fp(torch.empty(0, 3))
    assert fp(torch.empty(0)) == fp(torch.empty(0))
    assert 0 <= fp(x) < 2**128
    z = torch.randn(5, dtype=torch.complex64)
    assert fp(z.conj()) == fp(z.conj().resolve_conj())  # a lazy conjugate: its values
    assert fp(z.conj()) != fp(z)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fingerprint_is_the_same_at_any_thread_count(scheme: fingerprinting.Scheme) -> None:
    x = sample(torch.float32, 3_000_000)
    many = [sample(torch.float32, 1000 * (i % 7) + 1, seed=i) for i in range(40)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = by(scheme)(x)
        batch = fingerprinting.fingerprints(many, {id(t): scheme for t in many})
        torch.set_num_threads(2)
        assert by(scheme)(x) == one
        assert fingerprinting.fingerprints(many, {id(t): scheme for t in many}) == batch
    finally:
        torch.set_num_threads(threads)
    assert [batch[id(t)] for t in many] == [(scheme, by(scheme)(t)) for t in many]


def test_accelerator_formula_agrees_with_mv() -> None:
    """Off CPU, lanes are summed elementwise (torch has no integer mv there): same numbers."""
    words = torch.randint(-(2**31), 2**31 - 1, (64, 8), dtype=torch.int32)
    weights = fingerprinting._weights(0, torch.device("cpu"))[:64]
    by_mv = torch.mv(words.t(), weights)
    assert torch.equal((words * weights[:, None]).sum(0, dtype=torch.int32), by_mv)
    odd = fingerprinting._as_words(torch.arange(14, dtype=torch.uint8)[2:14])  # unaligned, no copy
    assert odd.tolist() == torch.arange(2, 14, dtype=torch.uint8).view(torch.int32).tolist()


def test_a_print_is_checked_by_its_own_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot taken on an accelerator and checked after the model moved to the host (or
    the other way round) compares like with like: no false alarm, and a change is caught."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with monkeypatch.context() as m:
        m.setattr(fingerprinting, "scheme_of", lambda t: "device")  # as if on a GPU
        snap = snapshot(model, copy=False)
        picked = snapshot(model, names=["0.weight", "1.running_mean"], copy=False)
    assert {e.print.scheme for e in snap._entries if e.print} == {"device"}
    assert snap.changed() == {} and picked.changed() == {}  # now read on the host
    with torch.no_grad():
        model[0].weight[1, 2] = -model[0].weight[1, 2]
    assert list(snap.changed()) == ["0.weight"] and list(picked.changed()) == ["0.weight"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.sparse_coo_tensor([[0, 2, 2], [1, 0, 3]], [1.0, 2.0, 3.0], (3, 4)).coalesce(),
        lambda: torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse_csr(),
        lambda: torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse_csc(),
    ],
    ids=["coo", "csr", "csc"],
)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fingerprint_of_sparse_tensors(
    make: Callable[[], torch.Tensor], scheme: fingerprinting.Scheme
) -> None:
    fingerprint = by(scheme)
    t = make()
    assert fingerprint(t) == fingerprint(make())
    values = t.values()
    with torch.no_grad():
        values[0] = -values[0]
    assert fingerprint(t) != fingerprint(make())
    moved = make()
    if moved.layout == torch.sparse_coo:
        moved = torch.sparse_coo_tensor([[0, 2, 2], [2, 0, 3]], [1.0, 2.0, 3.0], (3, 4))
        uncoalesced = torch.sparse_coo_tensor(
            [[2, 0, 2, 2], [0, 1, 3, 3]], [2.0, 1.0, 1.0, 2.0], (3, 4)
        )
        assert fingerprint(uncoalesced) == fingerprint(make())  # the same value
    else:
        moved = torch.tensor([[1.0, 0.0], [2.0, 0.0]]).to_sparse(layout=make().layout)
    assert fingerprint(moved) != fingerprint(make())


def test_fingerprint_of_a_dtensor_is_that_of_its_shard() -> None:
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already running")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = distribute_tensor(sample(torch.float32, 4, 3), mesh, [Shard(0)])
        assert type(shard).__name__ == "DTensor"
        assert fingerprint(shard) == fingerprint(shard.to_local())
        model = nn.Linear(3, 4)
        model.weight = nn.Parameter(shard)
        for copy in (True, False):
            snap = snapshot(model, copy=copy)
            assert snap.changed() == {}
            with torch.no_grad():
                model.weight.to_local()[1, 2] += 1.0
            assert list(snap.changed()) == ["weight"]
            with torch.no_grad():
                model.weight.to_local()[1, 2] -= 1.0
    finally:
        dist.destroy_process_group()


def test_fingerprint_errors() -> None:
    with pytest.raises(IsolationTypeError, match=r"^fingerprint\(\): expected a torch.Tensor"):
        fingerprint([1.0])  # type: ignore[arg-type]
    with pytest.raises(IsolationTypeError, match=r"^fingerprint\(\): a meta tensor"):
        fingerprint(torch.empty(3, device="meta"))
    with pytest.raises(IsolationTypeError, match=r"lazy parameter has no values yet"):
        fingerprint(nn.LazyLinear(2).weight)


class Marked(torch.Tensor):
    """A tensor subclass: its values are whatever its own dispatch says they are."""


def test_tensors_without_values_in_memory_are_refused_not_read() -> None:
    """The host scheme reads memory by address: a FakeTensor's data pointer is not its
    values (torch only warns about reading it), so anything but a plain tensor is refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.randn(4)
    for scheme in SCHEMES:
        with pytest.raises(IsolationTypeError, match=r"^fingerprint\(\): a fake or functional"):
            by(scheme)(fake)
    with pytest.raises(IsolationTypeError, match=r"a tensor of subclass Marked holds no values"):
        fingerprint(torch.randn(3).as_subclass(Marked))
    jagged = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged)
    with pytest.raises(IsolationTypeError, match=r"a tensor of subclass NestedTensor"):
        fingerprint(jagged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "prototype stage"
        strided = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    with pytest.raises(IsolationTypeError, match=r"nested tensors are not supported"):
        fingerprint(strided)
    model = nn.Linear(2, 2)
    model.register_buffer("fake", fake)
    with pytest.raises(IsolationTypeError, match=r"a fake or functional tensor"):
        snapshot(model, copy=False)


# --------------------------------------------------------------------------------------------
# snapshot(copy=False): fingerprints instead of copies


def test_fingerprint_snapshot_finds_what_moved_and_says_the_size_is_unknown() -> None:
    model = mnist_cnn()
    snap = snapshot(model, copy=False)
    assert not snap.copies and snapshot(model).copies
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
    assert "copy=True" in message and "bn='eval'" in message
    with pytest.raises(IsolationTypeError, match=r"^changed\(\): atol=0.1 needs the size"):
        snap.changed(atol=0.1)
    with pytest.raises(IsolationTypeError, match=r"^assert_unchanged\(\): atol=0.1 needs"):
        snap.assert_unchanged(atol=0.1)


def test_fingerprint_snapshot_shape_changes_and_missing_names() -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("steps", torch.tensor(3))
    snap = snapshot(model, copy=False)
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
    snap = snapshot(model, copy=False)
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
    snap = snapshot(model, copy=False)
    assert snap.names == ("embed.weight", "decoder.weight")
    with torch.no_grad():
        embed.weight[4, 2] = -embed.weight[4, 2]
    assert set(snap.changed()) == {"embed.weight", "decoder.weight"}


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "fingerprint"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_in_both_modes(dtype: torch.dtype, copy: bool) -> None:
    model = nn.Module()
    model.register_buffer("b", sample(dtype, 5, 3))
    model.p = nn.Parameter(sample(dtype, 4), requires_grad=False)  # type: ignore[assignment]
    snap = snapshot(model, copy=copy)
    assert snap.changed() == {}
    with torch.no_grad():
        if dtype == torch.bool:
            model.b[2, 1] = ~model.b[2, 1]
        else:
            model.b[2, 1] = model.b[2, 1] + 1
    changed = snap.changed()
    assert list(changed) == ["b"]
    assert changed["b"] == pytest.approx(1.0, rel=0.01) if copy else math.isnan(changed["b"])


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "fingerprint"])
def test_sparse_buffers_in_both_modes(copy: bool) -> None:
    """Issue 12 item 9: torch.equal is not implemented for sparse tensors."""
    model = nn.Module()
    model.register_buffer("coo", torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,)).coalesce())
    model.register_buffer("csr", torch.eye(3).to_sparse_csr())
    snap = snapshot(model, copy=copy)
    assert snap.changed() == {}
    snap.assert_unchanged()
    with torch.no_grad():
        model.coo.values()[1] += 0.5
        model.csr.values()[0] = 3.0
    changed = snap.changed()
    assert list(changed) == ["coo", "csr"]
    if copy:
        assert changed == {"coo": 0.5, "csr": 2.0}
        with pytest.raises(DriftError, match=r"coo +\(buffer\) max\|Δ\|=5\.000e-01 in 1 of"):
            snap.assert_unchanged()
    model.coo = torch.sparse_coo_tensor([[1, 2]], [1.0, 2.5], (4,))  # an entry moved
    moved = snap.changed()["coo"]
    assert moved == 1.0 if copy else math.isnan(moved)


def test_max_abs_diff_of_sparse_tensors() -> None:
    a = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    b = torch.sparse_coo_tensor([[0, 3]], [1.0, -1.0], (4,))
    assert max_abs_diff(a, a.clone()) == 0.0
    assert max_abs_diff(a, b) == 2.0  # 2.0 gone at index 2; -1.0 new at index 3 counts 1.0
    assert max_abs_diff(a, a.to_dense()) == 0.0
    assert max_abs_diff(torch.eye(2).to_sparse_csr(), (2 * torch.eye(2)).to_sparse_csr()) == 1.0


# --------------------------------------------------------------------------------------------
# Checks follow names, not captured objects (issue 12 item 1: SWA replaces buffers)


def swa_like_reset(bn: nn.BatchNorm1d) -> None:
    """What Lightning's StochasticWeightAveraging does to BatchNorm: new buffer objects."""
    assert bn.running_mean is not None and bn.running_var is not None
    bn.running_mean = torch.zeros_like(bn.running_mean)
    bn.running_var = torch.ones_like(bn.running_var)


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "fingerprint"])
def test_a_replaced_buffer_is_checked_by_its_new_value(copy: bool) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        model[1].running_mean.fill_(0.5)
        model[1].running_var.fill_(2.0)
    model[0].requires_grad_(False)
    held = ["0.weight", "0.bias", "1.running_mean", "1.running_var"]
    by_name = snapshot(model, names=held, copy=copy)
    captured = snapshot(
        {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if n in held},
        copy=copy,
    )
    assert by_name.names == tuple(held)
    swa_like_reset(model[1])
    changed = by_name.changed()
    assert list(changed) == ["1.running_mean", "1.running_var"]
    if copy:
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


# --------------------------------------------------------------------------------------------
# Many tensors at once (on several threads): the same numbers as one at a time


def _small_tensors() -> list[torch.Tensor]:
    sizes = (1, 2, 3, 5, 7, 511, 512, 513, 1024, 3000, 16384)
    tensors = [sample(dtype, n, seed=n) for dtype in ALL_DTYPES for n in sizes]
    base = sample(torch.float16, 51)
    tensors += [base[1:], sample(torch.float32, 50)[1:], sample(torch.float32, 8, 9).t()]
    return [*tensors, sample(torch.float32, 100_000)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_many_fingerprints_equal_one_at_a_time(scheme: fingerprinting.Scheme) -> None:
    tensors = _small_tensors()
    many = fingerprinting.fingerprints(tensors, {id(t): scheme for t in tensors})
    assert [many[id(t)] for t in tensors] == [(scheme, by(scheme)(t)) for t in tensors]
    if scheme == "host":
        assert [many[id(t)].value for t in tensors] == [fingerprint(t) for t in tensors]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_single_bit_flip_is_caught_by_a_batched_snapshot(dtype: torch.dtype) -> None:
    model = nn.Module()
    model.register_buffer("a", sample(dtype, 7))
    model.register_buffer("b", sample(dtype, 5, seed=1))
    snap = snapshot(model, copy=False)
    for buffer, name in ((model.a, "a"), (model.b, "b")):
        original = buffer.clone()
        for _, _, flipped in every_single_bit_flip(original):
            buffer.view(torch.uint8).copy_(flipped.view(torch.uint8))  # bytes, even of bools
            assert list(snap.changed()) == [name]
        buffer.copy_(original)
    assert snap.changed() == {}


def test_sign_flips_do_not_cancel_in_a_batched_snapshot() -> None:
    model = nn.Module()
    for i, dtype in enumerate(ALL_DTYPES[:6]):
        model.register_buffer(f"t{i}", sample(dtype, 2048))
    snap = snapshot(model, copy=False)
    for name, t in model.named_buffers():
        original = t.clone()
        for i, j in [(0, 1), (0, 2), (3, 515), (1, 2047)]:
            t[[i, j]] = -t[[i, j]]
            assert list(snap.changed()) == [name], (name, i, j)
            t.copy_(original)
        t.neg_()
        assert list(snap.changed()) == [name]
        t.copy_(original)
    assert snap.changed() == {}
