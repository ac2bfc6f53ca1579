"""``torch.save`` files, loaded with ``weights_only=True`` (no code from the file runs) and
``mmap=True`` (tensors are views of the mapped file, read when touched)."""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from isolate.certificates.checkpoint import WINDOW, Checkpoint, Kind, TensorMeta, choose_group
from isolate.errors import CheckpointReadError

__all__ = ["TorchCheckpoint", "load_weights_only"]


def load_weights_only(path: Path) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)``, its failures as one-line errors."""
    try:
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


class TorchCheckpoint(Checkpoint):
    """A ``torch.save`` file of a state dict, or of a dict holding one under ``key``
    (``"auto"`` finds a Lightning checkpoint's ``"state_dict"``)."""

    format = "torch"

    def __init__(self, path: Path, *, key: str | None = "auto", window: int = WINDOW) -> None:
        super().__init__(path, window=window)
        self._key = key
        self._group: str | None = None
        self._tensors: Mapping[str, Any] | None = None
        tensors = self._load()
        for name, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                self.skipped.append(str(name))
                continue
            if value.layout != torch.strided:
                raise CheckpointReadError(
                    f"{self.where(str(name))}: a {value.layout} tensor; certify reads dense "
                    f"tensors only: save it with .to_dense()"
                )
            self._metas[str(name)] = TensorMeta(value.dtype, tuple(value.shape))
        self.group = self._group or None
        self._release()

    def _load(self) -> Mapping[str, Any]:
        if self._tensors is None:
            loaded = load_weights_only(self.path)
            if not isinstance(loaded, Mapping):
                raise CheckpointReadError(
                    f"{self.path.name}: holds a {type(loaded).__name__}, not a state dict; save "
                    f"model.state_dict()"
                )
            if self._group is None:
                entries = {str(k): _kind(v) for k, v in loaded.items()}
                group = choose_group(entries, self._key, self.path.name)
                self._group = "" if group is None else group
            self._tensors = loaded[self._group] if self._group else loaded
        return self._tensors

    def _read(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self._load()[key]
        return tensor

    def _release(self) -> None:
        self._tensors = None

    def files(self) -> list[Path]:
        return [self.path]
