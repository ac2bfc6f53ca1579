"""The audits under what users do: exact integers, torch's own swaps and conversions, partial
pieces of large tensors, and flat buffers that do not start where their first view starts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.func import functional_call

from isolate import fingerprints as fingerprinting
from isolate.drift import Drift, fingerprint, max_abs_diff, snapshot
from isolate.errors import DriftError, ShardedGraphError
from isolate.reachability import assert_isolated, reachable_parameters
from isolate.spec import IsolationSpec


def counter(value: int) -> nn.Module:
    module = nn.Module()
    module.register_buffer("count", torch.tensor([value, 7], dtype=torch.int64))
    return module


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
@pytest.mark.parametrize("value", [2**61 - 1, 2**53 + 1, -(2**63), 2**63 - 1])
def test_snapshots_compare_integers_exactly(drift: Drift, value: int) -> None:
    module = counter(value)
    snap = snapshot(module, drift=drift)
    step = 1 if value < 2**63 - 1 else -1
    module.count[0] += step  # float64 cannot tell 2**61 - 1 from 2**61 - 2
    changed = snap.changed()
    assert list(changed) == ["count"]
    if drift == "copy":
        assert changed["count"] == 1.0
    size = r"in 1 of 2 elements" if drift == "copy" else ""
    with pytest.raises(DriftError, match=r"count .*" + size):
        snap.assert_unchanged()
    module.count[0] -= step
    assert snap.changed() == {}


def test_integer_differences_that_overflow_int64_are_still_changes() -> None:
    low, high = torch.tensor([-(2**63)]), torch.tensor([2**63 - 1])
    assert max_abs_diff(low, high) == max_abs_diff(high, low) == 2.0**64
    assert max_abs_diff(torch.tensor([2**62]), torch.tensor([-(2**62)])) == 2.0**63
    assert max_abs_diff(torch.tensor([True, False]), torch.tensor([True, True])) == 1.0
    assert max_abs_diff(low, low.clone()) == 0.0
    sparse = torch.tensor([[0, 2**61 - 1], [0, 0]]).to_sparse()
    moved = torch.tensor([[0, 2**61 - 2], [0, 0]]).to_sparse()
    assert max_abs_diff(sparse, moved) == 1.0
    elsewhere = torch.tensor([[2**61 - 1, 0], [0, 0]]).to_sparse()
    assert max_abs_diff(sparse, elsewhere) == 2.0**61


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
def test_a_held_batchnorm_counter_that_moves_is_drift(drift: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[1].num_batches_tracked.fill_(2**61 - 1)
    handle = IsolationSpec(freeze=["1"], bn="eval").apply(model, drift=drift)  # type: ignore[arg-type]
    try:
        handle.verify(checks=["drift"])
        model[1].num_batches_tracked.sub_(1)  # what a forward in train mode would count
        size = r"max\|Δ\|=1\.000e\+00" if drift == "copy" else r"changed"
        with pytest.raises(DriftError, match=r"1\.num_batches_tracked +\(buffer\) " + size):
            handle.verify(checks=["drift"])
    finally:
        handle.restore()


@pytest.fixture
def swapping() -> Iterator[None]:
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("drift", ["copy", "fingerprint"])
def test_a_live_snapshot_never_breaks_the_users_load_or_conversion(
    swapping: None, drift: Drift
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    weight = model[0].weight
    snap = snapshot(model, drift=drift)
    state = {
        k: v + 1 if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()
    }
    model.load_state_dict(state)  # torch swaps each tensor in place: refused on a weakref
    assert model[0].weight is weight and torch.equal(weight, state["0.weight"])
    assert set(snap.changed()) == {k for k, v in state.items() if v.is_floating_point()}
    assert snap.replaced() == ()  # swapped in place: the optimizer still holds them
    model.to(torch.float64)
    assert model[0].weight is weight and weight.dtype == torch.float64
    handle = IsolationSpec(freeze=["0"]).apply(model)  # the engine watches frozen tensors
    try:
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
        handle.verify(checks=["drift"])
        with torch.no_grad():
            weight.add_(1.0)
        with pytest.raises(DriftError, match=r"0\.weight"):
            handle.verify(checks=["drift"])
    finally:
        handle.restore()


def channels_last_conv(out: int, inp: int) -> torch.Tensor:
    torch.manual_seed(0)
    conv = nn.Conv2d(inp, out, 3).to(memory_format=torch.channels_last)
    weight = conv.weight.detach()
    assert not weight.is_contiguous()  # read in pieces of whole output channels
    return weight


@pytest.mark.parametrize("scheme", ["host", "device"])
def test_fingerprint_reads_the_last_partial_piece(
    monkeypatch: pytest.MonkeyPatch, scheme: fingerprinting.Scheme
) -> None:
    weight = channels_last_conv(7, 3)  # 7 output channels of 108 bytes
    monkeypatch.setattr(fingerprinting, "_PIECE_BYTES", 250)  # pieces of 2: 0-1 ... 6
    assert weight.numel() * weight.element_size() > fingerprinting._PIECE_BYTES
    read = [p.numel() for p in fingerprinting._pieces(weight)]
    assert read == [216, 216, 216, 108]  # ends on a partial piece
    before = fingerprinting._fingerprint(weight, scheme)
    nudged = weight.clone(memory_format=torch.channels_last)
    nudged[-1, -1, -1, -1] = torch.nextafter(nudged[-1, -1, -1, -1], torch.tensor(1.0))
    assert fingerprinting._fingerprint(nudged, scheme) != before
    assert fingerprinting._fingerprint(nudged.contiguous(), scheme) == (
        fingerprinting._fingerprint(nudged, scheme)
    )


def test_a_frozen_channels_last_conv_nudged_in_its_last_channel_is_caught() -> None:
    weight = channels_last_conv(512, 512)  # 9 MiB: over the 8 MiB piece, 455 channels each
    before = fingerprint(weight)
    weight[-1, -1, -1, -1] = torch.nextafter(weight[-1, -1, -1, -1], torch.tensor(1.0))
    assert fingerprint(weight) != before


class PaddedFlat(nn.Module):
    """A wrapper that runs its module on views of one hidden flat buffer that starts with
    padding (an alignment header, as flat-buffer optimizers and FSDP1 keep): no registered
    parameter starts where the buffer's memory starts."""

    def __init__(self, module: nn.Module, pad: int = 5) -> None:
        super().__init__()
        self.module = module
        numel = sum(p.numel() for p in module.parameters())
        flat = torch.zeros(pad + numel)
        object.__setattr__(self, "_hidden", nn.Parameter(flat))  # a leaf, not registered
        offset = pad
        self._slices: dict[str, tuple[int, torch.Size]] = {}
        for name, p in module.named_parameters():
            flat.data[offset : offset + p.numel()] = p.detach().reshape(-1)
            p.data = flat.data[offset : offset + p.numel()].view_as(p)
            self._slices[name] = (offset, p.shape)
            offset += p.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat: torch.Tensor = object.__getattribute__(self, "_hidden")
        views = {n: flat[o : o + s.numel()].view(s) for n, (o, s) in self._slices.items()}
        return functional_call(self.module, views, (x,))  # type: ignore[no-any-return]


def test_a_flat_buffer_with_leading_padding_is_refused() -> None:
    torch.manual_seed(0)
    model = PaddedFlat(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)))
    first = model.module[0].weight
    hidden = object.__getattribute__(model, "_hidden")
    assert first.data_ptr() != hidden.data_ptr()  # the padding: data pointers differ
    assert first.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr()
    loss = model(torch.randn(2, 3)).sum()
    with pytest.raises(ShardedGraphError, match=r"^assert_isolated\(\): the graph's leaves"):
        assert_isolated(loss, model.module[0], model=model)
    with pytest.raises(ShardedGraphError, match=r"^reachable_parameters\(\): the graph's leaves"):
        reachable_parameters(loss, model)
