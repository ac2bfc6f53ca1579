"""safetensors files: fingerprinted from their bytes by the file's cursor, read with the
``safetensors`` package's memory-mapped ``safe_open`` where values are needed.

The header is parsed here first, so that a truncated file is named with the first tensor
whose bytes are missing, and the tensors are read in the order of their bytes in the file.
Every tensor's bytes are located in the file (safetensors stores them row-major,
little-endian: what :func:`~isolate.fingerprints.fingerprint` reads on a little-endian
machine), so the :class:`~isolate.certificates.streaming.FileCursor` reads the file once,
header and gaps included, for the file's own hash and every fingerprint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from isolate.certificates.checkpoint import WINDOW, Checkpoint, TensorMeta
from isolate.certificates.streaming import Span
from isolate.errors import CheckpointReadError

__all__ = ["SafetensorsCheckpoint", "read_header"]

_MAX_HEADER = 100 << 20  # the safetensors format's own limit


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """The data's start in the file and the header's entries; a truncated file is an error
    naming the first tensor whose bytes are missing."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            raise CheckpointReadError(
                f"{path.name}: not a safetensors file or truncated in its header (header of "
                f"{length} bytes, file of {size}); re-copy or re-save the file"
            )
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointReadError(
                f"{path.name}: the safetensors header is not valid JSON ({error}); the file is "
                f"corrupt: re-save it"
            ) from None
    if not isinstance(header, dict):
        raise CheckpointReadError(f"{path.name}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + length
    for name, entry in sorted(header.items(), key=lambda kv: _end(kv[1])):
        if start + _end(entry) > size:
            raise CheckpointReadError(
                f"{path.name}, tensor {name!r}: truncated: its bytes end at {start + _end(entry)} "
                f"but the file ends at {size}; re-copy the file"
            )
    return start, header


def _end(entry: object) -> int:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    ):
        raise CheckpointReadError(f"a safetensors header entry has no data_offsets: {entry!r}")
    return int(offsets[1])


class SafetensorsCheckpoint(Checkpoint):
    """A safetensors file; ``key`` (if not ``"auto"`` or ``None``) keeps the keys under that
    dotted prefix and strips it."""

    format = "safetensors"

    def __init__(self, path: Path, *, key: str | None = "auto", window: int = WINDOW) -> None:
        super().__init__(path, window=window)
        try:
            from safetensors import safe_open
        except ImportError:
            raise CheckpointReadError(
                f"{path.name}: reading safetensors needs the safetensors package: "
                f"pip install 'isolate[certify]'"
            ) from None
        self._safe_open = safe_open
        self.data_start, header = read_header(path)
        order = sorted(header, key=lambda name: header[name]["data_offsets"][0])
        prefix = "" if key in (None, "", "auto") else f"{key}."
        self.group = prefix[:-1] or None
        self._names: dict[str, str] = {}
        for name in order:
            if name.startswith(prefix):
                self._names[name.removeprefix(prefix)] = name
            else:
                self.skipped.append(name)
        if prefix and not self._names:
            raise CheckpointReadError(
                f"{path.name}: no key starts with {prefix!r}; give key=None for the top level"
            )
        self.offsets = {k: tuple(header[n]["data_offsets"]) for k, n in self._names.items()}
        self._handle: Any = None
        handle = self._open()
        for key_, name in self._names.items():
            tensor = self._get(handle, key_, name)
            self._metas[key_] = meta = TensorMeta(tensor.dtype, tuple(tensor.shape))
            if sys.byteorder == "little":  # else the bytes differ from the tensor's in memory
                start, end = (self.data_start + o for o in self.offsets[key_])
                self._spans[key_] = Span(start, end, meta.dtype, meta.shape)
        self._release()

    def _open(self) -> Any:
        if self._handle is None:
            try:
                self._handle = self._safe_open(str(self.path), framework="pt")
            except Exception as error:  # the package raises its own SafetensorError
                raise CheckpointReadError(
                    f"{self.path.name}: safetensors cannot open it ({error}); re-save the file"
                ) from None
        return self._handle

    def _get(self, handle: Any, key: str, name: str) -> torch.Tensor:
        try:
            tensor: torch.Tensor = handle.get_tensor(name)
        except Exception as error:
            raise CheckpointReadError(
                f"{self.where(key)}: safetensors cannot read it ({error}); re-save the file"
            ) from None
        return tensor

    def _read(self, key: str) -> torch.Tensor:
        return self._get(self._open(), key, self._names[key])

    def _release(self) -> None:
        self._handle = None

    def files(self) -> list[Path]:
        return [self.path]
