"""Fingerprints: 128 bits that change whenever any bit of a tensor changes.

:func:`fingerprint` reads a tensor once and holds no copy of it; :func:`isolate.snapshot`
keeps one per tensor with ``drift="fingerprint"``, the engine's drift check keeps one per
frozen tensor, and the distributed checks exchange them instead of parameters.

Two schemes, chosen by where the tensor lives:

* ``"host"`` (CPU tensors): XXH3-128 (the ``xxhash`` package) of the tensor's header and
  raw bytes, read in place at memory speed, on as many threads as torch may use.
* ``"device"`` (accelerators): two weighted int32 readings of the bytes summed on the device
  itself, so that checking a frozen backbone never copies it to the host.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, NamedTuple

import torch
import xxhash
from torch import nn

from isolate.errors import IsolationTypeError

__all__ = [
    "HostFingerprint",
    "Print",
    "Scheme",
    "fingerprint",
    "fingerprints",
    "fingerprints_as",
    "local_tensor",
    "scheme_of",
]

Scheme = Literal["host", "device"]
"""How a print was made: XXH3 of the bytes (host) or weighted integer sums (device)."""


class Print(NamedTuple):
    """A fingerprint and the scheme that made it: only prints of one scheme compare."""

    scheme: Scheme
    value: int


# --------------------------------------------------------------------------------------------
# the device scheme: weighted int32 sums, computed where the tensor lives

_MASK64 = (1 << 64) - 1
# A reading is cut into chunks of _LINES lines of _LANES int32 words. Word p of chunk k is
# weighted by the weight of its line, p // _LANES, and summed mod 2**32 into lane p % _LANES
# (one mv over a column-major view: one sequential read, the lanes stay in L1); at the end of
# a chunk the lanes are mixed into 64 bits with odd weights.
_LANES = 512
_LINES = 1 << 15  # the pair guarantee of _weights needs at most 2**15 lines
_PIECE_BYTES = 1 << 23  # the most copied at once: non-contiguous tensors, accelerators (8 MiB)
_SHIFT = 2  # the second reading starts two bytes later: every bit is low in one of the two
_SEEDS = (0x5EED_0001, 0x5EED_0002)
_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_line_weights: dict[tuple[int, torch.device], torch.Tensor] = {}
_lane_weights: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _weights(stream: int, device: torch.device) -> torch.Tensor:
    """int32 line weights: w_i = 4i + 1 (mod 2**17) under random high bits.

    Every weight is odd, so a change of one word changes its lane's sum; and no two weights
    agree or cancel mod 2**17, so two flips of the same low bit in one lane never cancel.
    """
    key = (stream, device)
    if key not in _line_weights:
        generator = torch.Generator().manual_seed(_SEEDS[stream])
        high = torch.randint(-(1 << 14), 1 << 14, (_LINES,), generator=generator)
        low = 4 * torch.arange(_LINES) + 1
        _line_weights[key] = (high * (1 << 17) + low).to(torch.int32).to(device)
    return _line_weights[key]


def _mixers(chunk: int, stream: int, device: torch.device) -> torch.Tensor:
    """Odd pseudo-random int64 weights for the lanes of one chunk (splitmix64 steps)."""
    key = (chunk, stream, device)
    cached = _lane_weights.get(key)
    if cached is not None:
        return cached
    z = torch.arange(chunk * _LANES, (chunk + 1) * _LANES, dtype=torch.int64, device=device)
    z = z * _signed(0x9E3779B97F4A7C15) + _SEEDS[stream]
    z = (z ^ (z >> 31)) * _signed(0xBF58476D1CE4E5B9)
    z = ((z ^ (z >> 29)) * _signed(0x94D049BB133111EB)) | 1
    if chunk < 16:  # 16 chunks cover 1 GiB per tensor; memory stays 128 KiB per device
        _lane_weights[key] = z
    return z


def _as_words(data: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 tensor of 4k bytes as k int32 words, without copying on CPU."""
    if data.storage_offset() % 4 == 0:
        return data.view(torch.int32)
    if data.device.type == "cpu":
        # view() refuses a storage offset that is not a multiple of 4; x86 and ARM load
        # unaligned words happily, so give the same bytes a storage that starts where they do.
        start = data.storage_offset()
        storage = data.untyped_storage()[start : start + data.numel()]
        return torch.empty(0, dtype=torch.uint8).set_(storage).view(torch.int32)
    return data.clone().view(torch.int32)  # accelerators fault on unaligned words


def _lane_sums(words: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i weights[i] * words[i, lane] mod 2**32, per lane (int32 wraps, in any order)."""
    if words.device.type == "cpu":
        return torch.mv(words.t(), weights)  # one sequential pass, no temporary
    return (words * weights[:, None]).sum(0, dtype=torch.int32)  # int mv is CPU-only


class _Stream:
    """One reading of a byte stream as int32 words, hashed to 64 bits (see ``fingerprint``)."""

    def __init__(self, stream: int, device: torch.device, skip: int = 0) -> None:
        self.stream = stream
        self.device = device
        self.skip = skip
        self.words = 0  # words consumed so far: always a multiple of _LANES until digest()
        self.lanes = torch.zeros(_LANES, dtype=torch.int32, device=device)
        self.total = 0
        self.carry: torch.Tensor | None = None  # bytes short of a full line

    def feed(self, data: torch.Tensor) -> None:
        if self.skip:
            dropped = min(self.skip, data.numel())
            data, self.skip = data[dropped:], self.skip - dropped
        line_bytes = 4 * _LANES
        if self.carry is not None:
            need = line_bytes - self.carry.numel()
            head = torch.cat([self.carry, data[:need]])  # fresh, so aligned
            data, self.carry = data[need:], None
            if head.numel() < line_bytes:
                self.carry = head
                return
            self._lines(head)
        full = data.numel() // line_bytes * line_bytes
        if full:
            self._lines(data[:full])
        if full < data.numel():
            self.carry = data[full:].clone()

    def _lines(self, data: torch.Tensor) -> None:
        weights = _weights(self.stream, self.device)
        count = data.numel() // (4 * _LANES)
        step = count if self.device.type == "cpu" else max(1, _PIECE_BYTES // (4 * _LANES))
        done = 0
        while done < count:
            line = (self.words // _LANES) % _LINES
            take = min(count - done, _LINES - line, step)
            block = data[4 * _LANES * done : 4 * _LANES * (done + take)]
            words = _as_words(block).view(take, _LANES)
            self.lanes.add_(_lane_sums(words, weights[line : line + take]))
            done += take
            self.words += take * _LANES
            if self.words % (_LANES * _LINES) == 0:
                self._flush()

    def _flush(self) -> None:
        chunk = (self.words - 1) // (_LANES * _LINES)
        mixed = self.lanes.to(torch.int64).mul_(_mixers(chunk, self.stream, self.device))
        self.total = (self.total + int(mixed.sum())) & _MASK64
        self.lanes.zero_()

    def digest(self) -> int:
        if self.carry is not None:
            tail, self.carry = self.carry, None
            pad = -tail.numel() % 4
            if pad:
                tail = torch.cat([tail, tail.new_zeros(pad)])
            words = _as_words(tail)
            weight = _weights(self.stream, self.device)[(self.words // _LANES) % _LINES]
            self.lanes[: words.numel()].add_(words * weight)
            self.words += words.numel()
        if self.words % (_LANES * _LINES):
            self._flush()
        return self.total


def _header_digest(t: torch.Tensor, size: int) -> bytes:
    """``size`` bytes naming the layout, dtype and shape: equal bytes of another shape differ."""
    text = f"{t.layout}|{t.dtype}|{tuple(t.shape)}".encode()
    return hashlib.blake2b(text, digest_size=size).digest()


def _header(t: torch.Tensor) -> int:
    return int.from_bytes(_header_digest(t, 8), "little")


def _chunk_lanes(data: torch.Tensor, stream: int) -> torch.Tensor:
    """The lanes of one reading of at most one chunk of bytes: what ``_Stream`` computes
    for a stream that fits in its first chunk, in a handful of operations."""
    weights = _weights(stream, data.device)
    lines = data.numel() // (4 * _LANES)
    if lines:
        words = _as_words(data[: 4 * _LANES * lines]).view(lines, _LANES)
        lanes = _lane_sums(words, weights[:lines])
    else:
        lanes = torch.zeros(_LANES, dtype=torch.int32, device=data.device)
    tail = data[4 * _LANES * lines :]
    if tail.numel():
        pad = -tail.numel() % 4
        words = _as_words(nn.functional.pad(tail, (0, pad)) if pad else tail)
        lanes[: words.numel()] += words * weights[lines]
    return lanes


def _device_fingerprint(t: torch.Tensor) -> int:
    """The on-device scheme: two weighted int32 readings of the bytes (see ``fingerprint``)."""
    nbytes = t.numel() * t.element_size()
    if t.is_contiguous() and 0 < nbytes <= 4 * _LANES * _LINES:
        # The common case (a parameter below 64 MiB): both readings of the first chunk.
        data = t.reshape(-1).view(torch.uint8)
        lanes = [_chunk_lanes(data, 0)]
        if nbytes > _SHIFT:
            lanes.append(_chunk_lanes(data[_SHIFT:], 1))
        mixed = torch.stack(lanes).to(torch.int64)
        mixed.mul_(torch.stack([_mixers(0, s, t.device) for s in range(len(lanes))]))
        high, low, *_ = [int(v) & _MASK64 for v in mixed.sum(1).tolist()] + [0]
    else:
        streams = (_Stream(0, t.device), _Stream(1, t.device, skip=_SHIFT))
        if nbytes:
            for piece in _pieces(t):
                for stream in streams:
                    stream.feed(piece)
        high, low = (s.digest() for s in streams)
    return ((high ^ _header(t)) << 64) | low


# --------------------------------------------------------------------------------------------
# the host scheme: XXH3-128 of the raw bytes


class HostFingerprint:
    """The host scheme of :func:`fingerprint`, fed a tensor's bytes in pieces: for a tensor
    read from a file a block at a time (so that no more than a block is resident).

    Feeding the bytes of a dense tensor in row-major order gives ``fingerprint(tensor)``
    for that tensor in CPU memory.

    >>> t = torch.arange(6.0).reshape(2, 3)
    >>> stream = HostFingerprint(t.dtype, t.shape)
    >>> for row in t:
    ...     stream.update(row.numpy().tobytes())
    >>> stream.intdigest() == fingerprint(t)
    True
    """

    def __init__(self, dtype: torch.dtype, shape: Iterable[int]) -> None:
        self._hasher = xxhash.xxh3_128()
        self._hasher.update(
            _header_digest(torch.empty(tuple(shape), dtype=dtype, device="meta"), 16)
        )

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed the next bytes (xxhash lets go of the GIL while it reads them)."""
        self._hasher.update(data)

    def update_tensor(self, piece: torch.Tensor) -> None:
        """Feed the bytes of a contiguous uint8 tensor, read in place in host memory."""
        if piece.device.type != "cpu":
            piece = piece.cpu()
        size = piece.numel()
        if size:  # the C buffer lives as long as ``piece``
            self._hasher.update((ctypes.c_char * size).from_address(piece.data_ptr()))

    def intdigest(self) -> int:
        return int(self._hasher.intdigest())


def _host_fingerprint(t: torch.Tensor) -> int:
    """XXH3-128 of the header and the bytes in row-major order, read in place when the tensor
    is contiguous and in host memory (else copied to the host 8 MiB at a time)."""
    stream = HostFingerprint(t.dtype, t.shape)
    for piece in _pieces(t):
        stream.update_tensor(piece)
    return stream.intdigest()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, any other tensor itself (detached)."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        t = to_local()
    return t.detach()


def _pieces(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensor's bytes in row-major order, as contiguous uint8 pieces of bounded size."""
    if t.is_contiguous():
        yield t.reshape(-1).view(torch.uint8)
        return
    if t.numel() * t.element_size() <= _PIECE_BYTES:
        yield t.contiguous().reshape(-1).view(torch.uint8)
        return
    per_index = t[0].numel() * t.element_size()
    if per_index > _PIECE_BYTES:  # one index of dim 0 is too big: go one level down
        for i in range(t.shape[0]):
            yield from _pieces(t[i])
        return
    step = max(1, _PIECE_BYTES // per_index)
    for start in range(0, t.shape[0], step):
        yield t[start : start + step].contiguous().reshape(-1).view(torch.uint8)


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    if t.layout == torch.sparse_coo:
        t = t if t.is_coalesced() else t.coalesce()  # the value, not one of its spellings
        return [t.indices(), t.values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


def scheme_of(t: torch.Tensor) -> Scheme:
    """The scheme :func:`fingerprint` uses for ``t``: ``"host"`` in CPU memory, else
    ``"device"``."""
    return "host" if t.device.type == "cpu" else "device"  # a DTensor: its shard's device


def _fingerprint(
    tensor: torch.Tensor, scheme: Scheme | None = None, caller: str = "fingerprint()"
) -> int:
    """:func:`fingerprint` by ``scheme`` (default: the one for where the tensor lives)."""
    if not isinstance(tensor, torch.Tensor):
        raise IsolationTypeError(f"{caller}: expected a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(tensor, nn.parameter.UninitializedParameter | nn.parameter.UninitializedBuffer):
        raise IsolationTypeError(
            f"{caller}: an uninitialised lazy parameter has no values yet; run one forward "
            "pass to materialise it before fingerprinting"
        )
    t = local_tensor(tensor)
    if t.device.type == "meta":
        raise IsolationTypeError(f"{caller}: a meta tensor has no values to fingerprint")
    if type(t) is not torch.Tensor or torch._is_functional_tensor(t):
        # The host scheme reads memory by address: only a plain tensor has its values there
        # (a FakeTensor's data pointer is not its values, and reading it is undefined).
        what = "a fake or functional tensor (torch.compile tracing, FakeTensorMode)"
        if "Fake" not in type(t).__name__ and not torch._is_functional_tensor(t):
            what = f"a tensor of subclass {type(t).__name__}"
        raise IsolationTypeError(
            f"{caller}: {what} holds no values of its own to fingerprint; fingerprint the "
            "real tensor outside tracing, or the plain tensors the subclass wraps"
        )
    if t.is_nested:
        raise IsolationTypeError(
            f"{caller}: nested tensors are not supported; fingerprint t.unbind() one by one"
        )
    if t.is_quantized:
        raise IsolationTypeError(
            f"{caller}: quantised dtype {t.dtype} is not supported; fingerprint "
            "t.int_repr() and its scale/zero point instead"
        )
    dense = _host_fingerprint if (scheme or scheme_of(t)) == "host" else _device_fingerprint
    with torch.no_grad():
        if t.layout == torch.strided:
            return dense(t.resolve_conj().resolve_neg())
        if t.layout not in _SPARSE:
            raise IsolationTypeError(f"{caller}: tensors of layout {t.layout} are not supported")
        parts = [dense(local_tensor(p)) for p in _sparse_parts(t)]
    text = f"{_header(t)}|" + "|".join(map(str, parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=16).digest(), "little")


def fingerprints_as(pairs: Iterable[tuple[torch.Tensor, Print]]) -> dict[int, Print]:
    """id -> :class:`Print` of each tensor by the scheme of the print it is compared with,
    so that a tensor that moved between host and device since is read as it was."""
    pairs = list(pairs)
    return fingerprints((t for t, _ in pairs), {id(t): p.scheme for t, p in pairs})


def fingerprints(
    tensors: Iterable[torch.Tensor], schemes: Mapping[int, Scheme] | None = None
) -> dict[int, Print]:
    """id -> :class:`Print` of each distinct tensor, by its own scheme or the one ``schemes``
    gives for its id (to compare with a print made while the tensor lived elsewhere).

    Host-scheme tensors are split into as many groups of about equal bytes as torch may use
    threads, one thread per group (xxhash lets go of the GIL); the device scheme queues its
    work on the device from this thread.
    """
    unique = list({id(t): t for t in tensors}.values())
    chosen = {id(t): (schemes or {}).get(id(t)) or scheme_of(t) for t in unique}
    prints = {
        id(t): Print("device", _fingerprint(t, "device"))
        for t in unique
        if chosen[id(t)] == "device"
    }
    host = sorted(
        (t for t in unique if chosen[id(t)] == "host"),
        key=lambda t: -local_tensor(t).numel() * local_tensor(t).element_size(),
    )
    workers = min(torch.get_num_threads(), len(host))
    groups: list[list[torch.Tensor]] = [[] for _ in range(max(workers, 1))]
    loads = [0] * len(groups)
    for t in host:  # largest first, each to the least loaded group
        least = loads.index(min(loads))
        groups[least].append(t)
        loads[least] += local_tensor(t).numel() * local_tensor(t).element_size()

    def run(group: list[torch.Tensor]) -> list[int]:
        return [_fingerprint(t, "host") for t in group]

    if workers <= 1:
        done = [run(g) for g in groups]
    else:
        with ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(run, groups))
    for group, values in zip(groups, done, strict=True):
        prints.update((id(t), Print("host", v)) for t, v in zip(group, values, strict=True))
    return prints


def fingerprint(tensor: torch.Tensor) -> int:
    """A 128-bit fingerprint of a tensor's layout, dtype, shape and the bits of its values.

    Equal tensors (same dtype, shape and bits, whatever their strides) have equal
    fingerprints, on every rank and at any thread count, and a change of any bit of any
    element changes it. It holds no copy of the tensor: a contiguous tensor is read in
    place, a non-contiguous one copied 8 MiB at a time.

    Compare fingerprints of tensors on the same kind of device: the scheme depends on where
    the tensor lives (:func:`isolate.snapshot` records it, and re-reads a tensor that moved
    by the scheme of its print).

    * In CPU memory: XXH3-128 (``xxhash``) of a 16-byte header (layout, dtype, shape) and the
      raw bytes in row-major order. It costs about one read of the weights (a ``sum``): 1.0x
      to 1.1x on one thread on a 302M-parameter model, and several tensors are read at once
      on several threads (``python -m experiments.bench --only scale``). A change goes
      unnoticed only if two XXH3-128 digests collide: about 2**-128 for changes that are not
      crafted against the hash. The tests flip every bit of every byte of 12 dtypes.
    * On an accelerator: computed on the device, without a copy to the host. The bytes are
      read as int32 words, twice (from byte 0 and from byte 2), so that every bit of every
      element is among the low 16 bits of a word in one of the two readings; in each
      reading, words are summed mod 2**32 with odd weights into 512 lanes, and the lanes mod
      2**64 with odd weights. A change of one word moves its lane by an odd multiple of a
      nonzero number below 2**32 and the total by an odd multiple of that, never 0 mod
      2**64: any single-bit flip (indeed any change within one 4-byte word) is detected,
      always; a sign bit is bit 15 of a word in one reading, and two flips of the same bit
      in one lane cannot cancel, because no two weights agree or cancel mod 2**17, so
      ``x.neg_()`` is always caught. On a CPU this scheme costs three to four reads.

    Args:
        tensor: a dense or sparse (COO, CSR, CSC, BSR, BSC) tensor of any dtype, on any
            device; of a DTensor, the shard this rank holds.

    Returns:
        A non-negative int below ``2**128``. To exchange fingerprints across ranks, split it
        into two int64 words: ``hi, lo = divmod(fp, 2**64)``, each minus ``2**64`` if it is
        ``>= 2**63``.

    Raises:
        IsolationTypeError: ``tensor`` is not a tensor, or has no data to read (a meta
            tensor, an uninitialised lazy parameter, a quantised dtype).

    Note:
        The fingerprint follows the bits, not the numbers: ``-0.0`` and ``0.0`` differ, and
        so do two NaNs with different payloads. A sparse COO tensor is fingerprinted as its
        coalesced form, which costs a copy when it is not coalesced yet.

    >>> a = torch.tensor([1.0, 2.0, 3.0])
    >>> fingerprint(a) == fingerprint(a.clone())
    True
    >>> b = a.clone()
    >>> b.view(torch.int32)[1] ^= 1  # flip the lowest bit of one element
    >>> fingerprint(a) == fingerprint(b)
    False
    """
    return _fingerprint(tensor)
