"""The files' own hashes, as ``xxhsum -H2`` (XXH3-128) or ``sha256sum`` would print them."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

import xxhash

__all__ = ["FileHash", "hash_file", "label", "new_hasher"]

FileHash = Literal["xxh3", "sha256", "none"]
"""The hash recorded for each file: XXH3-128, SHA-256, or none."""


def new_hasher(kind: FileHash) -> Any:
    """A fresh hasher of ``kind`` (``update(bytes)``, ``hexdigest()``)."""
    return xxhash.xxh3_128() if kind == "xxh3" else hashlib.sha256()


def label(kind: FileHash, hasher: Any) -> str:
    """``"xxh3_128:<hex>"`` or ``"sha256:<hex>"``."""
    return f"{'xxh3_128' if kind == 'xxh3' else 'sha256'}:{hasher.hexdigest()}"


def hash_file(path: Path, kind: FileHash) -> str:
    """The hash of the file's bytes, read once, 8 MiB at a time."""
    hasher = new_hasher(kind)
    view = memoryview(bytearray(8 << 20))
    with path.open("rb", buffering=0) as f:
        while size := f.readinto(view):
            hasher.update(view[:size])
    return label(kind, hasher)
