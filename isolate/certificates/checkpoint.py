"""A checkpoint read one tensor at a time: what every format provides, and how a path is opened.

A reader lists every tensor's dtype and shape from the file's own index (no tensor is read),
then hands out one tensor at a time. The single-file formats hand out memory-mapped views;
every ``window`` bytes handed out, the reader lets go of its mapping and maps the file again,
so that the pages already read leave the process's resident memory (they stay in the page
cache) and memory stays bounded whatever the checkpoint's size.

Fingerprints and the files' own hashes come from one pass over each file: a
:class:`~isolate.certificates.streaming.FileCursor` per file hashes its bytes in file order,
and a tensor whose bytes the format locates in the file (its ``span``) is fingerprinted from
the same bytes as they pass. Any other tensor is fingerprinted from what ``read`` hands out,
and the format moves the cursor over the bytes it read (see each format for which).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Literal

import torch

from isolate.certificates.filehash import FileHash
from isolate.certificates.streaming import FileCursor, Span
from isolate.errors import CheckpointReadError
from isolate.fingerprints import fingerprint

__all__ = ["WINDOW", "Checkpoint", "Source", "TensorMeta", "choose_group"]

WINDOW = 64 << 20
"""Bytes handed out from one mapping of a file before it is mapped afresh."""

GROUPS = ("state_dict", "model", "module")
"""Where the weights sit in a checkpoint that holds more than weights, tried in this order
(``state_dict``: Lightning; ``model``: torch.distributed.checkpoint recipes)."""

Kind = Literal["tensor", "group", "other"]


@dataclass(frozen=True)
class TensorMeta:
    """A tensor's dtype and shape, as the checkpoint's index gives them."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclass(frozen=True)
class Source:
    """Where part of a tensor is stored: a file of the checkpoint and the box it holds."""

    file: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class Checkpoint(abc.ABC):
    """One checkpoint: its tensors' metadata up front, then one tensor at a time.

    Subclasses fill ``_metas`` (in the order reading is cheapest), ``_spans`` for the
    tensors whose bytes they locate in ``path``, and implement ``_read`` and ``_release``;
    ``read`` counts the bytes handed out and releases the mapping every ``window`` bytes.
    """

    format: ClassVar[str]

    def __init__(self, path: Path, *, window: int = WINDOW) -> None:
        self.path = path
        self.window = window
        self._metas: dict[str, TensorMeta] = {}
        self.skipped: list[str] = []  # entries that are not tensors (step counters, configs)
        self.group: str | None = None  # the group the weights were read from (None: top level)
        self._mapped = 0
        self.file_hash: FileHash = "none"  # set before the first print_of: cursors read it
        self._spans: dict[str, Span] = {}  # tensors fingerprinted from the bytes of ``path``
        self._cursors: dict[Path, FileCursor] = {}

    @property
    def metas(self) -> Mapping[str, TensorMeta]:
        """Every tensor's dtype and shape by key, in reading order."""
        return self._metas

    def where(self, key: str | None = None) -> str:
        """The file (and tensor) for a message: ``"base.pt, tensor 'head.weight'"``."""
        return f"{self.path.name}, tensor {key!r}" if key is not None else self.path.name

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` (a view of the mapped file where the format allows)."""
        meta = self._metas[key]
        if self._mapped and self._mapped + meta.nbytes > self.window:
            self._release()
            self._mapped = 0
        tensor = self._read(key)
        self._mapped += meta.nbytes
        if tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
            raise CheckpointReadError(
                f"{self.where(key)}: the index says {meta} but the data is "
                f"{TensorMeta(tensor.dtype, tuple(tensor.shape))}; the file is corrupt: re-save it"
            )
        return tensor

    def print_of(self, key: str) -> int:
        """:func:`~isolate.fingerprints.fingerprint` of the tensor ``key``: from the file's
        bytes as the cursor passes them where the format locates them, else from ``read``."""
        if key in self._spans:
            return self.cursor(self.path).print_of(key)
        return fingerprint(self.read(key))

    def cursor(self, path: Path) -> FileCursor:
        """The cursor that reads ``path`` (one of :meth:`files`) once, in file order."""
        if path not in self._cursors:
            spans = self._spans if path == self.path else {}
            self._cursors[path] = FileCursor(path, self.file_hash, spans)
        return self._cursors[path]

    def file_hashes(self) -> dict[str, str]:
        """Each file's own hash (by ``file_hash``), by file name; empty for ``"none"``. The
        cursors hash what the pass has not read yet."""
        if self.file_hash == "none":
            return {}
        return {p.name: self.cursor(p).finish() for p in self.files()}

    def sources(self, key: str) -> list[Source]:
        """Where the parts of ``key`` are stored (one part for single-file formats)."""
        shape = self._metas[key].shape
        return [Source(self.path.name, (0,) * len(shape), shape)]

    @abc.abstractmethod
    def files(self) -> list[Path]:
        """The files that make up the checkpoint, for their hashes."""

    def unreferenced(self) -> list[str]:
        """Files beside the checkpoint's own that its index does not refer to."""
        return []

    @abc.abstractmethod
    def _read(self, key: str) -> torch.Tensor: ...

    def _release(self) -> None:  # noqa: B027 - formats without a mapping have nothing to drop
        """Drop the mapping (the views handed out keep theirs alive until dropped)."""

    def close(self) -> None:
        self._release()
        for cursor in self._cursors.values():
            cursor.close()
        self._cursors.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def choose_group(entries: Mapping[str, Kind], key: str | None, where: str) -> str | None:
    """Which top-level group holds the weights: ``key`` if given (``""`` or ``None``: the top
    level, which must then hold tensors), else (``"auto"``) the top level when it holds
    tensors, else the first of :data:`GROUPS`."""
    groups = sorted(k for k, v in entries.items() if v == "group")
    if key is None or key == "":
        if any(kind == "tensor" for kind in entries.values()):
            return None
        raise CheckpointReadError(
            f"{where}: holds no tensors at its top level, which key={key!r} reads; "
            + _groups_hint(groups)
        )
    if key != "auto":
        if entries.get(key) != "group":
            raise CheckpointReadError(
                f"{where}: has no group {key!r} of tensors; its groups are {groups} "
                f"(give key=None for the top level)"
            )
        return key
    if any(kind == "tensor" for kind in entries.values()):
        return None
    for group in GROUPS:
        if entries.get(group) == "group":
            return group
    raise CheckpointReadError(
        f"{where}: holds no tensors at its top level and none of the groups {list(GROUPS)}; "
        + _groups_hint(groups)
    )


def _groups_hint(groups: list[str]) -> str:
    if not groups:
        return "it holds no group of tensors either"
    return f"its groups are {groups}: name the one with the weights, e.g. key={groups[0]!r}"
