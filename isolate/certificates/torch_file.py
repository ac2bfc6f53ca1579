"""``torch.save`` files, loaded with ``weights_only=True`` (no code from the file runs).

The index is loaded onto the ``meta`` device: no tensor data is read, and each storage says
where its bytes start in the file. Those offsets are checked against the zip file's own
directory (read with :mod:`zipfile`): each must start a stored (uncompressed) record of
tensor data large enough for its tensors. A contiguous tensor's bytes are then one run of the
file, and the file's cursor fingerprints it as it hashes the file, in one pass. Values, where
a verdict needs them, come from a second load with ``mmap=True`` (views of the mapped file,
read when touched). A tensor that is not contiguous (a transposed view was saved), or a file
written in the other byte order, is fingerprinted from its loaded values instead.
"""

from __future__ import annotations

import pickle
import re
import struct
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from isolate.certificates.checkpoint import WINDOW, Checkpoint, Kind, TensorMeta, choose_group
from isolate.certificates.streaming import Span
from isolate.errors import CheckpointReadError

__all__ = ["TorchCheckpoint", "load_weights_only"]


def load_weights_only(path: Path, *, meta: bool = False) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)`` (``meta``: onto the meta device,
    reading no tensor data), its failures as one-line errors."""
    try:
        if meta:
            try:
                return torch.load(path, map_location="meta", weights_only=True)
            except (NotImplementedError, RuntimeError):
                # A sparse tensor (COO, CSR, CSC, BSR, BSC): its invariants need its data.
                # Mapped instead (the dense tensors' data is read only where touched); a
                # corrupt file fails that load too, and is named there.
                pass
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        needs = f" (it needs {found[1]})" if found else ""
        raise CheckpointReadError(
            f"{path.name}: not a weights-only pickle{needs}, and certify runs no code from a "
            f"file; save the weights alone: torch.save(model.state_dict(), ...) or safetensors"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointReadError(
            f"{path.name}: cannot be read as a torch.save zip file ({first[:160]}); it is "
            f"truncated or corrupt: re-copy or re-save it"
        ) from None


def _kind(value: object) -> Kind:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, Mapping) and any(isinstance(v, torch.Tensor) for v in value.values()):
        return "group"
    return "other"


def _records(path: Path) -> dict[int, int]:
    """Where each stored record of tensor data starts in the zip file, and its size; empty
    for a file written in the other byte order (its bytes differ from the loaded tensors')."""
    with zipfile.ZipFile(path) as archive, path.open("rb") as f:
        infos = archive.infolist()
        order = [archive.read(i) for i in infos if i.filename.endswith("/byteorder")]
        if (order[0].decode() if order else "little") != sys.byteorder:
            return {}
        records = {}
        for info in infos:
            if "/data/" not in info.filename or info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset)
            local = f.read(30)  # the local header: its name and extra field precede the data
            names, extra = struct.unpack("<HH", local[26:30])
            records[info.header_offset + 30 + names + extra] = info.file_size
    return records


class TorchCheckpoint(Checkpoint):
    """A ``torch.save`` file of a state dict, or of a dict holding one under ``key``
    (``"auto"`` finds a Lightning checkpoint's ``"state_dict"``)."""

    format = "torch"

    def __init__(self, path: Path, *, key: str | None = "auto", window: int = WINDOW) -> None:
        super().__init__(path, window=window)
        self._key = key
        self._group: str | None = None
        self._tensors: Mapping[str, Any] | None = None
        index: dict[str, torch.Tensor] = {}
        for name, value in self._weights(load_weights_only(path, meta=True)).items():
            if not isinstance(value, torch.Tensor):
                self.skipped.append(str(name))
                continue
            if value.layout != torch.strided:
                raise CheckpointReadError(
                    f"{self.where(str(name))}: a {value.layout} tensor; certify reads dense "
                    f"tensors only: save it with .to_dense()"
                )
            if value.is_quantized:
                raise CheckpointReadError(
                    f"{self.where(str(name))}: a quantised {value.dtype} tensor, whose bytes do "
                    f"not hold its scale and zero point; certify reads plain tensors only: save "
                    f"its int_repr(), q_scale() and q_zero_point(), or its dequantize()"
                )
            index[str(name)] = value
            self._metas[str(name)] = TensorMeta(value.dtype, tuple(value.shape))
        self.group = self._group or None
        self._locate(index)
        located = sorted(self._spans, key=lambda k: self._spans[k].start)
        order = located + [k for k in self._metas if k not in self._spans]
        self._metas = {k: self._metas[k] for k in order}  # file order: one pass of the cursor

    def _weights(self, loaded: Any) -> Mapping[str, Any]:
        """The group of ``loaded`` that holds the weights (chosen at the first load)."""
        if not isinstance(loaded, Mapping):
            raise CheckpointReadError(
                f"{self.path.name}: holds a {type(loaded).__name__}, not a state dict; save "
                f"model.state_dict()"
            )
        if self._group is None:
            entries = {str(k): _kind(v) for k, v in loaded.items()}
            group = choose_group(entries, self._key, self.path.name)
            self._group = "" if group is None else group
        return loaded[self._group] if self._group else loaded

    def _locate(self, index: Mapping[str, torch.Tensor]) -> None:
        """Each contiguous tensor's bytes in the file, from its storage's offset checked
        against the zip's directory."""
        try:
            records = _records(self.path)
        except (zipfile.BadZipFile, OSError, struct.error, UnicodeDecodeError):
            return  # fingerprinted from the loaded values; the file is hashed all the same
        for key, value in index.items():
            offset = getattr(value.untyped_storage(), "_checkpoint_offset", None)
            if offset not in records or not value.is_contiguous():
                continue
            start = offset + value.storage_offset() * value.element_size()
            end = start + value.numel() * value.element_size()
            if end > offset + records[offset]:
                raise CheckpointReadError(
                    f"{self.where(key)}: its bytes end at {end}, past the end of its record in "
                    f"the file ({offset + records[offset]}); the file is corrupt: re-save it"
                )
            self._spans[key] = Span(start, end, value.dtype, tuple(value.shape))

    def _load(self) -> Mapping[str, Any]:
        if self._tensors is None:
            self._tensors = self._weights(load_weights_only(self.path))
        return self._tensors

    def _read(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self._load()[key]
        return tensor

    def _release(self) -> None:
        self._tensors = None

    def files(self) -> list[Path]:
        return [self.path]
