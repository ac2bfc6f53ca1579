"""torch.distributed.checkpoint folders, read one tensor at a time through ``FileSystemReader``.

A sharded tensor is assembled from its chunks (each chunk is ``torch.load``-ed with
``weights_only=True`` by the reader), tensors are read in the order of their first chunk in
the shard files, so that the folder is read shard by shard, and every chunk's file is known,
so that a verdict can name the shard that holds a part.

The folder's ``.metadata`` is a plain pickle, which ``FileSystemReader`` loads with
``pickle.load``: here it is loaded by an unpickler that admits only the checkpoint's own
metadata classes, so that no code from the folder runs.

Each shard file is hashed by its own cursor, in file order, as the pass goes: once a tensor's
chunks are read (by ``FileSystemReader``, into the tensor), each chunk's file is hashed up to
the chunk's end, so the bytes are hashed just after they were read, from the page cache; the
small ``.metadata`` is hashed whole at the end. A chunk's bytes are a ``torch.save`` zip of
its own, so tensors are fingerprinted from the values read, not from the file's bytes.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from isolate.certificates.checkpoint import (
    WINDOW,
    Checkpoint,
    Kind,
    Source,
    TensorMeta,
    choose_group,
)
from isolate.errors import CheckpointReadError

__all__ = ["DcpCheckpoint", "load_metadata"]

_METADATA = ".metadata"
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _Foreign(pickle.UnpicklingError):
    """A class the metadata names that is not the checkpoint's own (not a truncated pickle)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise _Foreign(f"{module}.{name}")


def load_metadata(folder: Path) -> Any:
    """The folder's ``.metadata``, admitting only torch.distributed.checkpoint's classes."""
    path = folder / _METADATA
    if not path.is_file():
        raise CheckpointReadError(
            f"{folder.name}: a folder without {_METADATA}, so not a torch.distributed.checkpoint "
            f"(its files: {sorted(p.name for p in folder.iterdir())[:6]}); give the checkpoint "
            f"folder itself"
        )
    try:
        with path.open("rb") as f:
            return _MetadataUnpickler(f).load()
    except _Foreign as error:
        raise CheckpointReadError(
            f"{folder.name}/{_METADATA}: holds more than checkpoint metadata (it needs "
            f"{error}), and certify runs no code from a file; re-save the checkpoint"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointReadError(
            f"{folder.name}/{_METADATA}: truncated or corrupt ({type(error).__name__}); re-copy it"
        ) from None


class DcpCheckpoint(Checkpoint):
    """A torch.distributed.checkpoint folder; ``key`` picks the group of the saved state dict
    that holds the weights (``"auto"``: the top level if it holds tensors, else ``"model"``
    or ``"state_dict"``)."""

    format = "dcp"

    def __init__(self, path: Path, *, key: str | None = "auto", window: int = WINDOW) -> None:
        super().__init__(path, window=window)
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.metadata = load_metadata(path)
        tensors = {
            fqn: item
            for fqn, item in self.metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }
        paths = self._paths(list(self.metadata.state_dict_metadata))
        entries: dict[str, Kind] = {}
        for fqn, parts in paths.items():
            kind: Kind = "tensor" if fqn in tensors else "other"
            if len(parts) > 1 and kind == "tensor":  # a group, whatever it held before
                entries[parts[0]] = "group"
            else:
                entries.setdefault(parts[0], kind)
        group = choose_group(entries, key, path.name)
        self.group = group
        self._fqns: dict[str, str] = {}
        self._sources: dict[str, list[Source]] = {}
        self._ends: dict[str, list[tuple[str, int]]] = {}  # each chunk's file and last byte
        for fqn, item in tensors.items():
            parts = paths[fqn]
            if group is not None and (len(parts) < 2 or parts[0] != group):
                self.skipped.append(fqn)
                continue
            name = ".".join(parts[1:]) if group is not None else fqn
            self._fqns[name] = fqn
            self._sources[name] = self._chunks(name, fqn, item)
            self._metas[name] = TensorMeta(item.properties.dtype, tuple(item.size))
        self.skipped += [f for f in self.metadata.state_dict_metadata if f not in tensors]
        order = sorted(self._metas, key=lambda k: (self._sources[k][0].file, self._offset(k)))
        self._metas = {k: self._metas[k] for k in order}
        self._reader = FileSystemReader(path)
        self._reader.set_up_storage_reader(self.metadata, True)

    def _paths(self, fqns: list[str]) -> dict[str, tuple[str, ...]]:
        """Each entry's path in the saved (nested) state dict, from the planner's record."""
        recorded = self.metadata.planner_data
        out: dict[str, tuple[str, ...]] = {}
        for fqn in fqns:
            path = recorded.get(fqn) if isinstance(recorded, Mapping) else None
            out[fqn] = tuple(map(str, path)) if isinstance(path, (tuple, list)) and path else (fqn,)
        return out

    def _chunks(self, name: str, fqn: str, item: Any) -> list[Source]:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        sources = []
        ends = self._ends.setdefault(name, [])
        for chunk in item.chunks:
            info = self.metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            file = getattr(info, "relative_path", None)
            if info is None or not isinstance(file, str):
                raise CheckpointReadError(
                    f"{self.where(name)}: {_METADATA} lists a chunk at {list(chunk.offsets)} "
                    f"but not where it is stored; the metadata is corrupt: re-save the checkpoint"
                )
            shard = self.path / file
            end = int(info.offset) + int(info.length)
            if not shard.is_file() or shard.stat().st_size < end:
                got = f"{shard.stat().st_size} bytes" if shard.is_file() else "no such file"
                raise CheckpointReadError(
                    f"{self.path.name}/{file}, tensor {name!r}: the chunk at "
                    f"{list(chunk.offsets)} needs bytes up to {end}, got {got}; the shard is "
                    f"truncated or missing: re-copy it"
                )
            sources.append(Source(file, tuple(chunk.offsets), tuple(chunk.sizes)))
            ends.append((file, end))
        if not sources:
            raise CheckpointReadError(f"{self.where(name)}: {_METADATA} lists no chunk for it")
        return sources

    def _offset(self, key: str) -> int:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        first = self._sources[key][0]
        index = MetadataIndex(self._fqns[key], torch.Size(first.offsets))
        return int(self.metadata.storage_data[index].offset)

    def where(self, key: str | None = None) -> str:
        if key is None or key not in self._sources:
            return super().where(key)
        files = sorted({s.file for s in self._sources[key]})
        shown = files[0] if len(files) == 1 else f"{{{','.join(files)}}}"
        return f"{self.path.name}/{shown}, tensor {key!r}"

    def sources(self, key: str) -> list[Source]:
        return list(self._sources[key])

    def _read(self, key: str) -> torch.Tensor:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        meta = self._metas[key]
        target = torch.empty(meta.shape, dtype=meta.dtype)
        planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        planner.set_up_planner({self._fqns[key]: target}, self.metadata, True)
        try:
            self._reader.read_data(planner.create_local_plan(), planner).wait()
        except (RuntimeError, OSError, EOFError, ValueError, AssertionError) as error:
            text = str(error).strip().splitlines()
            raise CheckpointReadError(
                f"{self.where(key)}: cannot be read ({(text or [type(error).__name__])[0][:160]})"
                f"; the shard is truncated, corrupt or stale: re-copy it"
            ) from None
        except pickle.UnpicklingError:
            raise CheckpointReadError(
                f"{self.where(key)}: a chunk is not a weights-only pickle, and certify runs no "
                f"code from a file; re-save the checkpoint"
            ) from None
        return target

    def print_of(self, key: str) -> int:
        found = super().print_of(key)
        if self.file_hash != "none":
            for file, end in self._ends[key]:
                self.cursor(self.path / file).advance(end)
        return found

    def files(self) -> list[Path]:
        """The metadata and every file it refers to (tensors' shards and other entries')."""
        used = {getattr(i, "relative_path", "") for i in self.metadata.storage_data.values()}
        return [self.path / _METADATA, *(self.path / f for f in sorted(used - {""}))]

    def unreferenced(self) -> list[str]:
        """Files of the folder that the metadata does not refer to (left by another save)."""
        used = {
            _METADATA,
            *(getattr(i, "relative_path", "") for i in self.metadata.storage_data.values()),
        }
        return sorted(p.name for p in self.path.iterdir() if p.is_file() and p.name not in used)
