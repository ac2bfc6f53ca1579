"""Fingerprints: 128 bits that change whenever any bit of a tensor changes.

:func:`fingerprint` reads a tensor once, holds no copy of it, and needs a few MB of scratch
memory; :func:`isolate.snapshot` keeps one per tensor with ``copy=False``, and the
distributed checks exchange them instead of parameters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from isolate.errors import IsolationTypeError

__all__ = ["fingerprint"]

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


def _local(t: torch.Tensor) -> torch.Tensor:
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


def _header(t: torch.Tensor) -> int:
    text = f"{t.layout}|{t.dtype}|{tuple(t.shape)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


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


def _dense_fingerprint(t: torch.Tensor) -> int:
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


_BATCH_BYTES = 1 << 16  # tensors up to this size are fingerprinted together, ...
_BATCH_BUFFER = 1 << 23  # ... a buffer of at most this many bytes at a time (8 MiB)


def _batchable(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and not t.is_quantized
        and t.is_contiguous()
        and _SHIFT < t.numel() * t.element_size() <= _BATCH_BYTES
    )


def _batch_fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """``_dense_fingerprint`` of many small contiguous CPU tensors in a handful of operations.

    Each reading of each tensor is zero-padded to whole lines (zero words add nothing, and a
    partial last line is weighted as the next line, as in ``_chunk_lanes``) and laid out in one
    buffer; every line is weighted by the weight of its index within its tensor, and the lines
    of a tensor summed into its lanes with one ``index_add_``. Same numbers, but a tensor costs
    a few views instead of a dozen operations (192 of the 288 tensors of a transformer are
    biases and norms of a few KiB, which cost more than the 1 GB of weights read by mv).
    """
    line_bytes = 4 * _LANES
    device = tensors[0].device
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    zeros = torch.zeros(line_bytes, dtype=torch.uint8, device=device)
    digests = []
    for stream in (0, 1):
        pieces: list[torch.Tensor] = []
        counts: list[int] = []
        for data in flat:
            if stream:
                data = data[_SHIFT:]
            size = data.numel()
            pad = -size % line_bytes
            pieces.append(data)
            if pad:
                pieces.append(zeros[:pad])
            counts.append((size + pad) // line_bytes)
        words = torch.cat(pieces).view(torch.int32).view(-1, _LANES)
        sizes = torch.tensor(counts)
        owner = torch.repeat_interleave(torch.arange(len(tensors)), sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        line = torch.arange(words.shape[0]) - starts[owner]
        weighted = words * _weights(stream, device)[line][:, None]
        lanes = torch.zeros(len(tensors), _LANES, dtype=torch.int32, device=device)
        lanes.index_add_(0, owner, weighted)
        mixed = lanes.to(torch.int64).mul_(_mixers(0, stream, device)).sum(1)
        digests.append([int(v) & _MASK64 for v in mixed.tolist()])
    return [
        ((high ^ _header(t)) << 64) | low
        for t, high, low in zip(tensors, digests[0], digests[1], strict=True)
    ]


def _fingerprints(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """id -> fingerprint of each distinct tensor. Small contiguous CPU tensors are done
    together (``_batch_fingerprints``); the others on as many threads as torch may use: the
    integer mv is single-threaded, and torch lets go of the GIL while it runs."""
    unique = list({id(t): t for t in tensors}.values())
    prints: dict[int, int] = {}
    small: list[tuple[int, torch.Tensor]] = []
    rest: list[torch.Tensor] = []
    for t in unique:
        local = _local(t) if isinstance(t, torch.Tensor) else t
        if isinstance(local, torch.Tensor) and _batchable(local):
            small.append((id(t), local))
        else:
            rest.append(t)
    with torch.no_grad():
        while small:
            group = [small.pop()]
            size = group[0][1].numel() * group[0][1].element_size() + 4 * _LANES
            while small and size + _BATCH_BYTES + 4 * _LANES <= _BATCH_BUFFER:
                group.append(small.pop())
                size += group[-1][1].numel() * group[-1][1].element_size() + 4 * _LANES
            done = _batch_fingerprints([t for _, t in group])
            prints.update((key, fp) for (key, _), fp in zip(group, done, strict=True))
    workers = min(torch.get_num_threads(), len(rest))
    if workers <= 1:
        prints.update((id(t), fingerprint(t)) for t in rest)
        return prints
    largest_first = sorted(rest, key=lambda t: -t.numel() * t.element_size())
    with ThreadPoolExecutor(workers) as pool:
        prints.update(
            zip(map(id, largest_first), pool.map(fingerprint, largest_first), strict=True)
        )
    return prints


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    if t.layout == torch.sparse_coo:
        t = t if t.is_coalesced() else t.coalesce()  # the value, not one of its spellings
        return [t.indices(), t.values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


def fingerprint(tensor: torch.Tensor) -> int:
    """A 128-bit fingerprint of a tensor's layout, dtype, shape and the bits of its values.

    Equal tensors (same dtype, shape and bits, whatever their strides) have equal
    fingerprints, on every rank and at any thread count; a change of any single bit of any
    element always changes it. It holds no copy of the tensor: a contiguous tensor is read in
    place (twice, see below), a non-contiguous one copied 8 MiB at a time. On a 302M-parameter
    model it costs three to four reads of the weights (a ``sum``) on one CPU thread (``python
    -m experiments.bench --only scale``): the two readings are two integer ``torch.mv``, and
    torch's int32 mv runs at about memory speed even on data in cache, so they alone cost
    about 2.5 reads. Small tensors are read together (``_fingerprints``).

    How: the tensor's bytes in row-major order are read as int32 words, twice (from byte 0
    and from byte 2), so that every bit of every element is among the low 16 bits of a word
    in one of the two readings. In each reading, words are summed mod 2**32 with odd weights
    into 512 lanes, and the lanes mod 2**64 with odd weights. A change of one word moves its
    lane by an odd multiple of a nonzero number below 2**32 and the total by an odd multiple
    of that, never 0 mod 2**64: any single-bit flip (indeed any change within one 4-byte
    word) is detected, always. A plain sum mod 2**64 would miss any even number of sign
    flips of 8-byte values (``x.neg_()`` on float64); here a sign bit is bit 15 of a word in
    one reading, and two flips of the same bit in one lane cannot cancel, because no two
    weights agree or cancel mod 2**17. Other changes go unnoticed only if a 64-bit weighted
    sum of their lane changes happens to vanish.

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
    caller = "fingerprint()"
    if not isinstance(tensor, torch.Tensor):
        raise IsolationTypeError(f"{caller}: expected a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(tensor, nn.parameter.UninitializedParameter | nn.parameter.UninitializedBuffer):
        raise IsolationTypeError(
            f"{caller}: an uninitialised lazy parameter has no values yet; run one forward "
            "pass to materialise it before fingerprinting"
        )
    t = _local(tensor)
    if t.device.type == "meta":
        raise IsolationTypeError(f"{caller}: a meta tensor has no values to fingerprint")
    if t.is_quantized:
        raise IsolationTypeError(
            f"{caller}: quantised dtype {t.dtype} is not supported; fingerprint "
            "t.int_repr() and its scale/zero point instead"
        )
    with torch.no_grad():
        if t.layout == torch.strided:
            return _dense_fingerprint(t)
        if t.layout not in _SPARSE:
            raise IsolationTypeError(f"{caller}: tensors of layout {t.layout} are not supported")
        parts = [_dense_fingerprint(_local(p)) for p in _sparse_parts(t)]
    text = f"{_header(t)}|" + "|".join(map(str, parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=16).digest(), "little")


# --------------------------------------------------------------------------------------------
# snapshot
