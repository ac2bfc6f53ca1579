"""The device scheme reads a tensor's bytes by whichever route they come (in place, in pieces
of any size, chunk by chunk) to the same number, and weighs every position differently."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from isolate import fingerprints as fingerprinting
from isolate.errors import IsolationTypeError
from tests.toolkit._shared import every_single_bit_flip, sample

MOD17 = 1 << 17


class Marked(torch.Tensor):
    """A tensor subclass: its values are whatever its own dispatch says they are."""


def device(t: torch.Tensor) -> int:
    """The accelerator scheme, run on this CPU."""
    return fingerprinting._fingerprint(t, "device")


def by(scheme: fingerprinting.Scheme) -> Callable[[torch.Tensor], int]:
    return lambda t: fingerprinting._fingerprint(t, scheme)


@pytest.fixture
def small_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines of 32 bytes, chunks of 4 lines, pieces of 52 bytes: a small tensor crosses all."""
    monkeypatch.setattr(fingerprinting, "_LANES", 8)
    monkeypatch.setattr(fingerprinting, "_LINES", 4)
    monkeypatch.setattr(fingerprinting, "_PIECE_BYTES", 52)
    monkeypatch.setattr(fingerprinting, "_line_weights", {})
    monkeypatch.setattr(fingerprinting, "_lane_weights", {})


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [7, 9, 13])
def test_a_strided_tensor_of_any_byte_count_reads_as_its_contiguous_copy(
    dtype: torch.dtype, rows: int
) -> None:
    """Read in pieces, the last word of each reading may hold 1, 2 or 3 bytes."""
    x = sample(dtype, rows, 5).t()  # non-contiguous: fed to the readings piece by piece
    assert not x.is_contiguous()
    assert device(x) == device(x.contiguous())
    flipped = x.contiguous()
    flipped.view(torch.uint8).reshape(-1)[-1] ^= 1  # the last byte, read last
    assert device(flipped.t().contiguous().t()) != device(x)


def test_pieces_shorter_than_a_line_are_all_read(small_geometry: None) -> None:
    """Rows too big for one piece are read one element at a time: every such piece is
    shorter than a line, and each byte of it still counts."""
    x = sample(torch.float32, 20, 24).t()  # a row: 80 bytes over 20 strided floats
    reference = device(x)
    assert reference == device(x.contiguous())
    ends = [torch.cat([f, x[2:]]) for byte, _, f in every_single_bit_flip(x[:2]) if byte < 8]
    prints = {device(f.t().contiguous().t()) for f in ends}
    assert reference not in prints and len(prints) == 8 * 8


def test_the_same_place_in_another_chunk_weighs_differently(small_geometry: None) -> None:
    """A value moved from the first word of one chunk to the first word of the next changes
    the print, also when the next chunk holds that one word only."""
    for words in (33, 49, 65, 97):  # 1 or 2 chunks and one word, 1 and a half, 2, 3
        first = torch.zeros(words, dtype=torch.int32)
        last = first.clone()
        first[words - 33] = 1 << 16
        last[words - 1] = 1 << 16
        assert device(first) != device(last), words


@pytest.mark.parametrize("start", [1, 2, 3])
def test_a_tensor_starting_at_any_byte_of_its_storage_reads_as_its_copy(start: int) -> None:
    raw = sample(torch.uint8, 3 * 4096 + 5)
    x = raw[start:]  # contiguous, but its words are not aligned to the storage
    assert device(x) == device(x.clone())


@pytest.mark.parametrize("stream", [0, 1])
def test_line_weights_are_odd_distinct_and_never_cancel(stream: int) -> None:
    """The docstring's guarantee: any change of one word changes its lane's sum (odd weight),
    and two flips of the same low bit in one lane never cancel (no two weights agree or
    sum to 0 mod 2**17)."""
    low = (fingerprinting._weights(stream, torch.device("cpu")).to(torch.int64) % MOD17).tolist()
    assert len(low) == fingerprinting._LINES
    assert all(w % 2 == 1 for w in low)
    assert len(set(low)) == len(low)
    assert not set(low) & {(MOD17 - w) % MOD17 for w in low}
    for chunk in (0, 1, 17):
        mixers = fingerprinting._mixers(chunk, stream, torch.device("cpu"))
        assert bool((mixers % 2 != 0).all()), chunk


def test_prints_do_not_depend_on_the_random_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks and restarts compare prints: the weights come from their own seed, not from the
    global generator the training run consumes."""
    x = sample(torch.float32, 3000)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        before = device(x)
        monkeypatch.setattr(fingerprinting, "_line_weights", {})  # as in a fresh process
        monkeypatch.setattr(fingerprinting, "_lane_weights", {})
        torch.manual_seed(2)
        assert device(x) == before


STRIDED = {
    "rows per piece": lambda: sample(torch.float32, 3, 40).t(),  # rows of 12 bytes
    "a row per piece": lambda: sample(torch.float32, 10, 20).t(),  # rows of 40 bytes
    "one long row": lambda: sample(torch.float32, 20, 20).t()[:1],  # 80 bytes, strided
    "rows split": lambda: sample(torch.float32, 20, 1, 30).transpose(0, -1),
}


@pytest.mark.parametrize("scheme", ["host", "device"])
@pytest.mark.parametrize("case", STRIDED)
def test_strided_tensors_read_in_pieces_as_their_copies(
    small_geometry: None, scheme: fingerprinting.Scheme, case: str
) -> None:
    """Several rows to a piece, one row to a piece, or a row split in pieces: every byte
    once, in row-major order."""
    x = STRIDED[case]()
    assert not x.is_contiguous() and x.numel() * 4 > fingerprinting._PIECE_BYTES
    fp = by(scheme)
    assert fp(x) == fp(x.contiguous())
    assert fp(x) != fp(x.neg())


def test_pieces_of_several_lines_start_anywhere_in_a_chunk(
    small_geometry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fingerprinting, "_PIECE_BYTES", 200)  # 6 lines and a quarter
    x = sample(torch.float32, 50, 20).t()  # rows of 200 bytes: one piece each
    assert device(x) == device(x.contiguous())


def test_host_scheme_is_xxh3_of_the_header_and_the_bytes() -> None:
    """A tensor hashed whole in memory and one streamed row by row from a file agree."""
    t = sample(torch.float32, 6, 5)
    stream = fingerprinting.HostFingerprint(t.dtype, t.shape)
    for row in t:
        stream.update(row.numpy().tobytes())
    assert fingerprinting.fingerprint(t) == by("host")(t) == stream.intdigest()
    assert by("device")(t) != stream.intdigest()


def test_prints_of_every_layout_fit_in_128_bits() -> None:
    dense = sample(torch.float32, 6, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sparse compressed layouts are beta
        layouts = (dense, dense.to_sparse(), dense.to_sparse_csr(), dense.to_sparse_csc())
    for t in layouts:
        for scheme in ("host", "device"):
            assert 0 <= by(scheme)(t) < 2**128, (t.layout, scheme)


def test_local_tensor_unwraps_only_a_dtensor() -> None:
    class Shardlike(torch.Tensor):
        def to_local(self) -> torch.Tensor:
            return torch.zeros(1)

    t = torch.ones(3).as_subclass(Shardlike)
    assert torch.equal(fingerprinting.local_tensor(t), torch.ones(3))


def test_refusals_say_what_to_fingerprint_instead() -> None:
    """Each refusal names the way out, word for word."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantised dtypes are deprecated
        quantised = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    cases = {
        "run one forward pass to materialise it before fingerprinting$": nn.LazyLinear(2).weight,
        r"fingerprint t\.int_repr\(\) and its scale/zero point instead$": quantised,
        r"tensors of layout torch\._mkldnn are not supported$": torch.randn(4).to_mkldnn(),
        "the real tensor outside tracing, or the plain tensors the subclass wraps$": torch.randn(
            3
        ).as_subclass(Marked),
    }
    for message, t in cases.items():
        with pytest.raises(IsolationTypeError, match=r"^fingerprint\(\): .*" + message):
            fingerprinting.fingerprint(t)
    with FakeTensorMode():
        fake = torch.randn(4)
    with pytest.raises(IsolationTypeError, match=r"\(torch\.compile tracing, FakeTensorMode\)"):
        fingerprinting.fingerprint(fake)


def test_a_stream_allocates_nothing_up_front() -> None:
    """A tensor read from a file a block at a time is never held whole, not even empty."""
    stream = fingerprinting.HostFingerprint(torch.float32, (1 << 40,))  # 4 TiB
    stream.update(b"\0" * 16)
    assert isinstance(stream.intdigest(), int)


def test_a_non_tensor_is_refused_by_its_type() -> None:
    with pytest.raises(
        IsolationTypeError, match=r"^fingerprint\(\): expected a torch.Tensor, got list$"
    ):
        fingerprinting.fingerprint([1.0])  # type: ignore[arg-type]
