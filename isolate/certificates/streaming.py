"""One file read once, front to back: every byte feeds the file's own hash, and the bytes of
each tensor stored there also feed that tensor's fingerprint.

A :class:`FileCursor` walks a memory map of the file a block at a time and lets each block's
pages go once read (``MADV_DONTNEED``: they stay in the page cache, not in this process), so
resident memory stays at a block whatever the file's size. Each block is fed in pieces small
enough to stay in a core's cache, to the file's hasher and to the fingerprint of the tensor
the piece belongs to, so the second hash of a piece reads it from the cache, not from memory.

Asked for a tensor further on, the cursor walks up to it, fingerprinting the tensors it
passes on the way (their fingerprints wait until asked for): the file is read once whatever
the order the tensors are asked for. A tensor whose bytes lie behind the cursor (a view of
bytes already passed) is fingerprinted from its own bytes again; its bytes are hashed once.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from isolate.certificates.filehash import FileHash, label, new_hasher
from isolate.errors import CheckpointReadError
from isolate.fingerprints import HostFingerprint

__all__ = ["BLOCK", "PIECE", "FileCursor", "Span"]

BLOCK = 8 << 20
"""Bytes walked before their pages are let go."""
PIECE = 256 << 10
"""Bytes fed to every hash at once: fits in a core's L2 cache, so the second hash of a piece
reads it there."""

Sink = Callable[[memoryview], None]


@dataclass(frozen=True)
class Span:
    """Where a tensor's bytes lie in a file, row-major in this machine's byte order."""

    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class FileCursor:
    """A file read once in file order, hashed whole (``kind``), and the tensors at ``spans``
    (by key) fingerprinted on the way.

    >>> import tempfile, torch, xxhash
    >>> from isolate.fingerprints import fingerprint
    >>> t = torch.arange(4, dtype=torch.int32)
    >>> data = b"head" + t.numpy().tobytes() + b"tail"
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     _ = f.write(data); f.flush()
    ...     cursor = FileCursor(Path(f.name), "xxh3", {"t": Span(4, 20, t.dtype, (4,))})
    ...     same = cursor.print_of("t") == fingerprint(t)
    ...     whole = cursor.finish() == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()
    ...     cursor.close()
    >>> same, whole
    (True, True)
    """

    def __init__(
        self,
        path: Path,
        kind: FileHash,
        spans: Mapping[str, Span],
    ) -> None:
        self.path = path
        self.size = path.stat().st_size
        for key, span in spans.items():
            if span.end > self.size:
                raise CheckpointReadError(
                    f"{path.name}, tensor {key!r}: truncated: its bytes end at {span.end} but the "
                    f"file ends at {self.size}; re-copy the file"
                )
        self._kind = kind
        self._hasher: Any = None if kind == "none" else new_hasher(kind)
        self._spans = spans
        self._order = sorted(spans, key=lambda k: (spans[k].start, spans[k].end))
        self._next = 0  # index in _order of the first tensor the cursor has not passed
        self._at = 0  # bytes hashed so far
        self._prints: dict[str, int] = {}  # tensors passed on the way, not yet asked for
        self._map: mmap.mmap | None = None
        self.walked = 0  # bytes read from the file, hashed or not

    def print_of(self, key: str) -> int:
        """The fingerprint of the tensor ``key`` (as :func:`~isolate.fingerprints.fingerprint`
        of it), from the file's bytes."""
        span = self._spans[key]
        if self._hasher is not None and span.start >= self._at:
            self.advance(span.end)
        if key in self._prints:
            return self._prints.pop(key)
        # Nothing to hash, or bytes hashed already (a view of bytes the cursor passed).
        stream = HostFingerprint(span.dtype, span.shape)
        self._walk(span.start, span.end, [stream.update])
        return int(stream.intdigest())

    def advance(self, end: int) -> None:
        """Hash the file up to ``end``, fingerprinting the tensors that start before it."""
        if self._hasher is None:  # no file hash: each tensor is read when asked for
            return
        while self._next < len(self._order):
            key = self._order[self._next]
            span = self._spans[key]
            if span.start > end or (span.start == end and span.end > span.start):
                break
            self._next += 1
            if span.start < self._at:  # overlaps bytes passed already: on its own, when asked
                continue
            self._hash_to(span.start)
            stream = HostFingerprint(span.dtype, span.shape)
            self._walk(span.start, span.end, [self._hasher.update, stream.update])
            self._at = span.end
            self._prints[key] = int(stream.intdigest())
        self._hash_to(end)

    def finish(self) -> str:
        """Hash the rest of the file; the file's hash, ``"<kind>:<hex>"``."""
        if self._hasher is None:
            raise ValueError(f"{self.path.name}: a cursor without a file hash has none to give")
        self.advance(self.size)
        return label(self._kind, self._hasher)

    def _hash_to(self, end: int) -> None:
        if self._hasher is not None and end > self._at:
            self._walk(self._at, end, [self._hasher.update])
            self._at = end

    def _walk(self, start: int, end: int, sinks: Sequence[Sink]) -> None:
        """Feed the bytes ``[start, end)`` to ``sinks`` a piece at a time, letting each block's
        pages go once read."""
        if end <= start:
            return
        now = self.path.stat().st_size  # reading a mapped page past the end would crash
        if end > now:
            raise CheckpointReadError(
                f"{self.path.name}: truncated while being read (bytes up to {end} needed, the "
                f"file now ends at {now}); re-copy the file"
            )
        if self._map is None:
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        whole = memoryview(self._map)
        try:
            for first in range(start, end, BLOCK):
                last = min(first + BLOCK, end)
                for at in range(first, last, PIECE):  # each piece is fed to every sink
                    with whole[at : min(at + PIECE, last)] as piece:  # while it is in cache
                        for sink in sinks:
                            sink(piece)
                if hasattr(mmap, "MADV_DONTNEED"):  # Linux; elsewhere pages stay mapped
                    aligned = first - first % mmap.PAGESIZE
                    self._map.madvise(mmap.MADV_DONTNEED, aligned, last - aligned)
        finally:
            whole.release()
        self.walked += end - start

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
