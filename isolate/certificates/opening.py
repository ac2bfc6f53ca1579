"""Opening a checkpoint by what it is: a folder, a safetensors file, or a ``torch.save`` file."""

from __future__ import annotations

from pathlib import Path

from isolate.certificates.checkpoint import Checkpoint
from isolate.certificates.dcp_folder import DcpCheckpoint
from isolate.certificates.safetensors_file import SafetensorsCheckpoint
from isolate.certificates.torch_file import TorchCheckpoint
from isolate.errors import CheckpointReadError

__all__ = ["open_checkpoint"]


def _sniff(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(16)
    if head.startswith(b"PK\x03\x04"):
        return "torch"
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:1] == b"\x80":
        raise CheckpointReadError(
            f"{path.name}: a plain pickle (or the legacy torch.save format), which cannot be "
            f"memory-mapped or read weights-only; re-save it with torch.save (PyTorch >= 1.6) "
            f"or as safetensors"
        )
    raise CheckpointReadError(
        f"{path.name}: not a safetensors file, a torch.save zip file or a "
        f"torch.distributed.checkpoint folder (it starts {head[:8]!r}); it may be truncated"
    )


def open_checkpoint(path: str | Path, *, key: str | None = "auto") -> Checkpoint:
    """Open a safetensors file, a ``torch.save`` file or a torch.distributed.checkpoint folder.

    Args:
        path: the file or folder.
        key: the group that holds the weights (a Lightning checkpoint's ``"state_dict"``);
            ``"auto"`` takes the top level if it holds tensors, else the first of
            :data:`GROUPS` present; ``None`` takes the top level.

    Raises:
        CheckpointReadError: the path does not exist, or is not a checkpoint that can be read
            safely (a pickle that is not weights-only, a truncated file).
    """
    path = Path(path)
    if path.is_dir():
        return DcpCheckpoint(path, key=key)
    if not path.is_file():
        raise CheckpointReadError(f"{path}: no such file or folder; check the path")
    if _sniff(path) == "safetensors":
        return SafetensorsCheckpoint(path, key=key)
    return TorchCheckpoint(path, key=key)
