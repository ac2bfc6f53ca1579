"""fingerprint: 128 bits that change whenever any bit of a tensor changes, in both schemes
(host and device), every dtype, layout, thread count and batch; tensors without values in
memory are refused."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from isolate import fingerprints as fingerprinting
from isolate.drift import snapshot
from isolate.errors import IsolationTypeError
from isolate.fingerprints import fingerprint
from tests.toolkit._shared import ALL_DTYPES, every_single_bit_flip, sample

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
        snap = snapshot(model, drift="fingerprint")
        picked = snapshot(model, names=["0.weight", "1.running_mean"], drift="fingerprint")
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
        for drift in ("copy", "fingerprint"):
            snap = snapshot(model, drift=drift)
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
        snapshot(model, drift="fingerprint")


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
    snap = snapshot(model, drift="fingerprint")
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
    snap = snapshot(model, drift="fingerprint")
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
