"""Catching parameters and buffers that move when they should not.

:func:`snapshot` records a model's parameters and buffers (a copy, or only a
:func:`fingerprint` of each); the returned :class:`Snapshot` tells by name what changed since.
:func:`optimizer_exposure` finds the frozen parameters an optimizer still holds, and why a step
could move them anyway.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from isolate.errors import DriftError, IsolationTypeError, SelectorError
from isolate.sharding import canonical_parameters

__all__ = [
    "Exposure",
    "Snapshot",
    "fingerprint",
    "max_abs_diff",
    "optimizer_exposure",
    "snapshot",
]

ParameterFilter = Literal["all", "frozen", "trainable", "none"]
_FILTERS = ("all", "frozen", "trainable", "none")

# --------------------------------------------------------------------------------------------
# fingerprint

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


def _fingerprints(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """id -> fingerprint of each distinct tensor, on as many threads as torch may use: the
    integer mv is single-threaded, and torch lets go of the GIL while it runs."""
    unique = list({id(t): t for t in tensors}.values())
    workers = min(torch.get_num_threads(), len(unique))
    if workers <= 1:
        return {id(t): fingerprint(t) for t in unique}
    largest_first = sorted(unique, key=lambda t: -t.numel() * t.element_size())
    with ThreadPoolExecutor(workers) as pool:
        prints = pool.map(fingerprint, largest_first)
        return {id(t): fp for t, fp in zip(largest_first, prints, strict=True)}


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
    model it costs about three reads of the weights on one CPU thread (``python -m
    experiments.bench --only scale``).

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


def _to_coo(t: torch.Tensor) -> torch.Tensor:
    t = _local(t)
    if t.layout != torch.sparse_coo:
        t = t.to_sparse()  # CSR/CSC/BSR/BSC and dense alike
    return t.coalesce()


def _widen(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def max_abs_diff(old: torch.Tensor, new: torch.Tensor) -> float:
    """Max |new - old| over elements; NaN in both places counts as equal, ``inf`` on shape change.

    Integer and bool tensors are compared in float64, so ``num_batches_tracked`` steps by 1.0.
    Sparse tensors (any layout) compare their stored entries; an entry present on one side
    only counts against zero.
    """
    old, new = _local(old), _local(new)
    if old.shape != new.shape:
        return math.inf
    if old.layout != torch.strided or new.layout != torch.strided:
        a, b = _to_coo(old), _to_coo(new.to(old.device))
        if a.indices().shape == b.indices().shape and torch.equal(a.indices(), b.indices()):
            return max_abs_diff(a.values(), b.values())
        delta = (_widen(b) - _widen(a)).coalesce().values()
        return float(delta.abs().max()) if delta.numel() else 0.0
    if old.numel() == 0:
        return 0.0
    new = new.to(old.device)
    if torch.equal(old, new):
        return 0.0
    a, b = _widen(old), _widen(new)
    if a.dtype != b.dtype:
        a, b = a.to(torch.complex128), b.to(torch.complex128)
    diff = (b - a).abs()
    both_nan = a.isnan() & b.isnan()
    if bool(both_nan.any()):
        diff = diff.masked_fill(both_nan, 0.0)
    return float(diff.max())


@dataclass(frozen=True)
class _Entry:
    name: str
    kind: Literal["parameter", "buffer"]
    saved: torch.Tensor | None  # the copy, or None for a fingerprint
    print: int  # fingerprint(); 0 with a copy
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: torch.layout
    # The object snapshotted, to notice when a name points elsewhere later: a weak reference
    # for modules (the snapshot must not keep a replaced tensor alive), the tensor itself for
    # mappings (it is what gets checked).
    live: Callable[[], torch.Tensor | None]


class Snapshot:
    """A record of named parameters and buffers, and the means to compare against it.

    Made by :func:`snapshot`. For a module, tensors are looked up again by name at every
    check, so a tensor replaced after the snapshot (a new ``Parameter``, a buffer that SWA or
    a checkpoint load assigns anew) is checked by its new value, and reported as replaced.

    Attributes:
        names: every name recorded, parameters first, in model order.
        copies: whether the snapshot holds copies (``changed()`` gives the size of a change)
            or only fingerprints (``changed()`` gives ``nan``: changed, size unknown).
    """

    def __init__(
        self,
        entries: list[_Entry],
        module: nn.Module | None,
        description: str,
        copies: bool,
    ) -> None:
        self._entries = entries
        self._module = module
        self._description = description
        self.copies = copies
        self.names: tuple[str, ...] = tuple(e.name for e in entries)

    def __repr__(self) -> str:
        kinds = [e.kind for e in self._entries]
        mode = "" if self.copies else ", fingerprints"
        return (
            f"Snapshot({self._description}: {kinds.count('parameter')} parameters, "
            f"{kinds.count('buffer')} buffers{mode})"
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def _current(self) -> dict[str, torch.Tensor]:
        if self._module is None:
            return {e.name: t for e in self._entries if (t := e.live()) is not None}
        current: dict[str, torch.Tensor] = {}
        named = dict(self._module.named_parameters(remove_duplicate=False))
        current.update(canonical_parameters(self._module, named, "snapshot()"))  # FSDP2 shards
        current.update(self._module.named_buffers(remove_duplicate=False))
        return current

    def _compare(self, atol: float) -> list[tuple[_Entry, torch.Tensor | None, float]]:
        current = self._current()
        read = [
            now
            for e in self._entries
            if e.saved is None
            and (now := current.get(e.name)) is not None
            and tuple(_local(now).shape) == e.shape
        ]
        prints = _fingerprints(read)  # tied tensors are read once
        out = []
        for entry in self._entries:
            now = current.get(entry.name)
            if now is None:
                delta = math.inf
            elif entry.saved is not None:
                delta = max_abs_diff(entry.saved, now)
            elif tuple(_local(now).shape) != entry.shape:
                delta = math.inf
            else:
                delta = 0.0 if prints[id(now)] == entry.print else math.nan
            if not delta <= atol or now is not entry.live():
                out.append((entry, now, delta))
        return out

    def changed(self, *, atol: float = 0.0) -> dict[str, float]:
        """Name -> max |Δ| of every tensor whose values moved by more than ``atol``.

        A tensor that is gone, or whose shape changed, reports ``inf``; NaN where there was a
        number (or the other way round) reports ``nan``. A fingerprint snapshot
        (``copy=False``) knows that a tensor changed, not by how much: every changed tensor
        reports ``nan`` (test with ``math.isnan``; ``nan > 0`` is False), except ``inf`` for
        one that is gone or changed shape.

        Args:
            atol: the largest |Δ| per element that still counts as unchanged; only ``0``
                with a fingerprint snapshot.

        Raises:
            IsolationTypeError: ``atol`` is negative, or nonzero with a fingerprint snapshot.

        >>> model = nn.Linear(2, 1)
        >>> _ = nn.init.zeros_(model.bias)
        >>> snap, prints = snapshot(model), snapshot(model, copy=False)
        >>> with torch.no_grad():
        ...     _ = model.bias.add_(0.5)
        >>> snap.changed(), prints.changed()
        ({'bias': 0.5}, {'bias': nan})
        """
        self._check_atol("changed()", atol)
        return {e.name: d for e, _, d in self._compare(atol) if not d <= atol}

    def replaced(self) -> tuple[str, ...]:
        """Names that point to a different tensor object than at the snapshot.

        An optimizer or a checkpoint still holds the old object, so a replaced parameter
        quietly stops training (or stops being saved). Empty for mapping snapshots.
        """
        return tuple(e.name for e, now, _ in self._compare(math.inf) if now is not e.live())

    def _check_atol(self, caller: str, atol: float) -> None:
        if not isinstance(atol, (int, float)) or not atol >= 0:
            raise IsolationTypeError(f"{caller}: atol must be a number >= 0, got {atol!r}")
        if atol and not self.copies:
            raise IsolationTypeError(
                f"{caller}: atol={atol} needs the size of a change, which a fingerprint "
                "snapshot does not know; take snapshot(..., copy=True) to allow a tolerance"
            )

    def assert_unchanged(self, *, atol: float = 0.0) -> None:
        """Raise :class:`~isolate.DriftError` if any tensor moved by more than ``atol``.

        Args:
            atol: the largest |Δ| per element that still counts as unchanged; only ``0``
                with a fingerprint snapshot.

        Raises:
            DriftError: naming every tensor that moved, whether it is a parameter or a
                buffer, its ``requires_grad``, its max |Δ| and how many elements moved (with
                a copy), and the likely cause.
            IsolationTypeError: ``atol`` is negative, or nonzero with a fingerprint snapshot.

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> snap = snapshot(model, copy=False)
        >>> _ = model(torch.randn(4, 2))  # train mode: BatchNorm updates its statistics
        >>> snap.assert_unchanged()
        Traceback (most recent call last):
        ...
        isolate.errors.DriftError: assert_unchanged(): 3 of 7 tensors changed since the ...
        """
        caller = "assert_unchanged()"
        self._check_atol(caller, atol)
        moved = [(e, now, d) for e, now, d in self._compare(atol) if not d <= atol]
        if not moved:
            return
        width = max(len(e.name) for e, _, _ in moved)
        lines = []
        for entry, now, delta in moved:
            if now is None:
                detail = "is gone (no tensor of that name any more)"
            elif tuple(_local(now).shape) != entry.shape:
                detail = f"changed shape {entry.shape} -> {tuple(_local(now).shape)}"
            elif entry.saved is None:
                detail = "changed (fingerprint differs; snapshot(..., copy=True) tells by how much)"
            else:
                diff = _elementwise_moved(entry.saved, now, atol)
                detail = f"max|Δ|={delta:.3e} in {diff} of {entry.saved.numel()} elements"
            flag = ""
            if entry.kind == "parameter" and now is not None:
                flag = f", requires_grad={now.requires_grad}"
            replaced = (
                ", replaced by a new object" if now is not None and now is not entry.live() else ""
            )
            lines.append(f"  {entry.name:<{width}}  ({entry.kind}{flag}{replaced}) {detail}")
        hints = []
        if any(e.kind == "parameter" for e, _, _ in moved):
            hints.append(
                "a parameter with requires_grad=False still moves when its .grad is a zero "
                "tensor and the optimizer has weight decay or momentum: call "
                "optimizer.zero_grad(set_to_none=True) or drop it from the optimizer "
                "(isolate.optimizer_exposure lists such parameters)"
            )
        if any(e.kind == "buffer" for e, _, _ in moved):
            hints.append(
                "BatchNorm running statistics update in train mode whatever requires_grad "
                "says: put those layers in eval mode (isolate.freeze(..., bn='eval'))"
            )
        raise DriftError(
            f"{caller}: {len(moved)} of {len(self._entries)} tensors changed since the "
            f"snapshot of {self._description} (atol={atol}):\n"
            + "\n".join(lines)
            + "\nFix: "
            + "; ".join(hints)
        )


def _elementwise_moved(old: torch.Tensor, new: torch.Tensor, atol: float) -> int:
    old, new = _local(old), _local(new).to(old.device)
    if old.layout != torch.strided or new.layout != torch.strided:
        a, b = _to_coo(old), _to_coo(new)
        moved = (_widen(b) - _widen(a)).coalesce().values().abs() > atol
        return int(moved.sum())
    a, b = _widen(old), _widen(new)
    if a.dtype != b.dtype:
        a, b = a.to(torch.complex128), b.to(torch.complex128)
    same_nan = a.isnan() & b.isnan()
    return int(((~((b - a).abs() <= atol)) & ~same_nan).sum())


def snapshot(
    target: nn.Module | Mapping[str, torch.Tensor],
    *,
    parameters: ParameterFilter = "all",
    buffers: bool = True,
    names: Iterable[str] | None = None,
    copy: bool = True,
    device: torch.device | str | None = "cpu",
) -> Snapshot:
    """Record parameters and buffers now, to tell later by name what changed.

    Args:
        target: a module (its parameters and buffers, every alias of a tied tensor, with
            BatchNorm ``running_mean`` / ``running_var`` / ``num_batches_tracked``), or a
            mapping of names to tensors.
        parameters: which parameters of a module to record: ``"all"``, ``"frozen"``
            (``requires_grad=False`` now), ``"trainable"`` or ``"none"``.
        buffers: whether to record the module's buffers.
        names: instead of the two filters above, exactly these parameter and buffer names
            of the module. Each is looked up by name at every check.
        copy: ``True`` keeps a copy of every tensor, so ``changed()`` tells by how much it
            moved (memory: the size of what is recorded). ``False`` keeps a 128-bit
            :func:`fingerprint` of each instead: any change of any bit is still caught, for
            O(number of tensors) memory and about two reads of the weights per check, but
            ``changed()`` reports ``nan`` for the size.
        device: where copies live; ``None`` keeps each on its tensor's device (faster, but
            costs accelerator memory). Unused with ``copy=False``.

    Returns:
        A :class:`Snapshot`; call ``.changed()`` or ``.assert_unchanged()`` on it later.

    Raises:
        IsolationTypeError: ``target`` is neither a module nor a mapping of tensors, or
            ``names`` is given with a mapping.
        SelectorError: ``parameters`` is not one of the filters above, ``names`` names no
            parameter or buffer of the module, or comes with a filter.

    Note:
        ``requires_grad=False`` is not enough to keep a parameter still: an optimizer moves a
        parameter whose ``.grad`` is a zero tensor (left by ``zero_grad(set_to_none=False)``
        or an earlier step) through weight decay and momentum, and BatchNorm updates its
        running statistics in train mode regardless. A snapshot catches both.

    Note:
        A mapping snapshot checks the very tensor objects it was given. If their owner later
        replaces them (SWA and ``load_state_dict(assign=True)`` assign new buffers), the new
        values are never checked: snapshot the module with ``names=`` instead, which looks
        every name up again at each check.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> model[0].requires_grad_(False)  # doctest: +ELLIPSIS
    Linear(...)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    >>> snap = snapshot(model, parameters="frozen")
    >>> for p in model[0].parameters():
    ...     p.grad = torch.zeros_like(p)  # a zero grad is not None: AdamW decays p
    >>> opt.step()
    >>> sorted(snap.changed())
    ['0.bias', '0.weight']
    """
    caller = "snapshot()"
    if parameters not in _FILTERS:
        raise SelectorError(
            f"{caller}: parameters={parameters!r} is not a filter; expected one of {list(_FILTERS)}"
        )
    saved: dict[int, tuple[torch.Tensor | None, int]] = {}
    chosen: list[tuple[str, Literal["parameter", "buffer"], torch.Tensor, bool]] = []

    def entry(
        name: str, kind: Literal["parameter", "buffer"], t: torch.Tensor, strong: bool
    ) -> None:
        chosen.append((name, kind, t, strong))

    def record(description: str, module: nn.Module | None) -> Snapshot:
        if not copy:
            prints = _fingerprints(t for _, _, t, _ in chosen)
            saved.update((i, (None, fp)) for i, fp in prints.items())
        return Snapshot([make(*c) for c in chosen], module, description, copy)

    def make(
        name: str, kind: Literal["parameter", "buffer"], t: torch.Tensor, strong: bool
    ) -> _Entry:
        # Aliases (tied weights, shared buffers) share one copy or fingerprint.
        if id(t) not in saved:
            data = _local(t)
            saved[id(t)] = (data.clone() if device is None else data.to(device, copy=True), 0)
        kept, print_ = saved[id(t)]
        local = _local(t)
        live: Callable[[], torch.Tensor | None]
        if strong:

            def live() -> torch.Tensor:
                return t

        else:
            live = weakref.ref(t)
        return _Entry(name, kind, kept, print_, tuple(local.shape), local.dtype, local.layout, live)

    if isinstance(target, nn.Module):
        params = dict(target.named_parameters(remove_duplicate=False))
        params = canonical_parameters(target, params, caller)  # FSDP2: this rank's shards
        bufs = dict(target.named_buffers(remove_duplicate=False))
        if names is not None:
            if parameters != "all" or not buffers:
                raise SelectorError(
                    f"{caller}: names= picks tensors itself; drop parameters={parameters!r} / "
                    f"buffers={buffers!r}"
                )
            wanted = [names] if isinstance(names, str) else list(names)
            unknown = [n for n in wanted if n not in params and n not in bufs]
            if unknown:
                raise SelectorError(
                    f"{caller}: {unknown} name no parameter or buffer of "
                    f"{type(target).__name__}; its names start {list(params)[:5]} "
                    f"(buffers: {list(bufs)[:5]})"
                )
            for name in dict.fromkeys(wanted):
                if name in params:
                    entry(name, "parameter", params[name], False)
                else:
                    entry(name, "buffer", bufs[name], False)
            return record(type(target).__name__, target)
        for name, p in params.items():
            keep = parameters == "all" or (
                parameters != "none" and p.requires_grad == (parameters == "trainable")
            )
            if keep:
                entry(name, "parameter", p, False)
        if buffers:
            for name, b in bufs.items():
                entry(name, "buffer", b, False)
        return record(type(target).__name__, target)
    if isinstance(target, Mapping):
        if names is not None:
            raise IsolationTypeError(
                f"{caller}: names= selects from a module; a mapping already names its tensors"
            )
        for name, t in target.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise IsolationTypeError(
                    f"{caller}: a mapping target must map names to tensors; got "
                    f"{type(name).__name__} -> {type(t).__name__}"
                )
            kind: Literal["parameter", "buffer"] = (
                "parameter" if isinstance(t, nn.Parameter) else "buffer"
            )
            entry(name, kind, t, True)
        return record(f"{len(chosen)} named tensors", None)
    raise IsolationTypeError(
        f"{caller}: target must be a torch.nn.Module or a mapping of names to tensors, got "
        f"{type(target).__name__}; e.g. snapshot(model) or snapshot(dict(model.named_buffers()))"
    )


# --------------------------------------------------------------------------------------------
# optimizer_exposure

# State that keeps moving a parameter when its gradient is zero: a momentum buffer, or Adam's
# first moment. Second moments (exp_avg_sq, square_avg, Adagrad's sum) only scale a gradient.
_MOMENTUM_STATE = ("momentum_buffer", "exp_avg")


@dataclass(frozen=True)
class Exposure:
    """A frozen parameter that an optimizer still holds.

    Attributes:
        name: its qualified name in the model, or ``"param_groups[g][i]"`` without a model.
        group: the index of the optimizer's param group that holds it.
        index: its position in that group's ``"params"``.
        grad: ``"none"``, ``"zero"`` or ``"nonzero"``: what its ``.grad`` holds now.
        reasons: why a zero ``.grad`` would still move it (weight decay, momentum or Adam
            state); empty when a zero grad would leave it alone.
    """

    name: str
    group: int
    index: int
    grad: Literal["none", "zero", "nonzero"]
    reasons: tuple[str, ...]

    @property
    def at_risk(self) -> bool:
        """Whether a zero ``.grad`` would move it on ``step()``."""
        return bool(self.reasons)

    @property
    def moves_on_step(self) -> bool:
        """Whether the next ``step()`` moves it, given its ``.grad`` now."""
        return self.grad == "nonzero" or (self.grad == "zero" and self.at_risk)

    def __str__(self) -> str:
        why = "; ".join(self.reasons) if self.reasons else "harmless while .grad is None or zero"
        return f"{self.name} (param group {self.group}, .grad {self.grad}): {why}"


def optimizer_exposure(
    optimizer: torch.optim.Optimizer, model: nn.Module | None = None
) -> tuple[Exposure, ...]:
    """The parameters with ``requires_grad=False`` that ``optimizer`` still holds, and why.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or a wrapper with an ``.optimizer``
            attribute (Lightning's ``LightningOptimizer``).
        model: the model, to name parameters by their qualified names.

    Returns:
        One :class:`Exposure` per frozen parameter held, in param-group order. Filter on
        ``.at_risk`` (a zero grad would move it) or ``.moves_on_step`` (the next step will).

    Raises:
        IsolationTypeError: ``optimizer`` is not an optimizer, or ``model`` not a module.

    Note:
        Every built-in optimizer skips a parameter whose ``.grad`` is ``None``; the danger is a
        zero-filled ``.grad`` (``zero_grad(set_to_none=False)``, or a grad left from before
        the freeze), which weight decay, a momentum buffer or Adam's first moment turn into a
        real step.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    >>> _ = model[0].requires_grad_(False)
    >>> for exposure in optimizer_exposure(opt, model):
    ...     print(exposure)
    0.weight (param group 0, .grad none): weight_decay=0.0001 shrinks it on every step
    0.bias (param group 0, .grad none): weight_decay=0.0001 shrinks it on every step
    """
    caller = "optimizer_exposure()"
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer) and isinstance(
        inner, torch.optim.Optimizer
    ):
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise IsolationTypeError(
            f"{caller}: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; pass the optimizer itself (trainer.optimizers[0])"
        )
    names: dict[int, str] = {}
    if model is not None:
        if not isinstance(model, nn.Module):
            raise IsolationTypeError(
                f"{caller}: model must be a torch.nn.Module, got {type(model).__name__}"
            )
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
    found: list[Exposure] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.requires_grad:
                continue
            reasons = []
            decay = group.get("weight_decay", 0.0)
            if decay:
                reasons.append(f"weight_decay={decay} shrinks it on every step")
            if group.get("lambd"):  # ASGD decays every parameter it steps, weight decay or not
                reasons.append(f"lambd={group['lambd']} (ASGD) shrinks it on every step")
            state = optimizer.state.get(p, {})
            for key in _MOMENTUM_STATE:
                value = state.get(key)
                if isinstance(value, torch.Tensor) and bool(value.ne(0).any()):
                    reasons.append(f"optimizer state {key!r} is non-zero and keeps moving it")
            if p.grad is None:
                grad: Literal["none", "zero", "nonzero"] = "none"
            else:
                grad = "nonzero" if bool(p.grad.ne(0).any()) else "zero"
            name = names.get(id(p), f"param_groups[{g}][{i}]")
            found.append(Exposure(name, g, i, grad, tuple(reasons)))
    return tuple(found)
