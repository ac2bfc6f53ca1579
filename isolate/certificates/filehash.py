"""The files' own hashes, as ``xxhsum -H2`` (XXH3-128) or ``sha256sum`` would print them."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import xxhash

__all__ = ["FileHash", "label", "new_hasher"]

FileHash = Literal["xxh3", "sha256", "none"]
"""The hash recorded for each file: XXH3-128, SHA-256, or none."""


def new_hasher(kind: FileHash) -> Any:
    """A fresh hasher of ``kind`` (``update(bytes)``, ``hexdigest()``)."""
    return xxhash.xxh3_128() if kind == "xxh3" else hashlib.sha256()


def label(kind: FileHash, hasher: Any) -> str:
    """``"xxh3_128:<hex>"`` or ``"sha256:<hex>"``."""
    return f"{'xxh3_128' if kind == 'xxh3' else 'sha256'}:{hasher.hexdigest()}"
