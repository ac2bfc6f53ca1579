"""What a path is opened as: a file that is no checkpoint is named with its first bytes, and a
distributed checkpoint folder is read under the group asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolate.certificates.opening import open_checkpoint
from isolate.errors import CheckpointReadError
from tests.certificates._data import base_state, save_dcp


def test_a_file_that_is_no_checkpoint_is_named_with_its_first_eight_bytes(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"GARBAGE!xyz and more bytes")
    with pytest.raises(CheckpointReadError) as error:
        open_checkpoint(junk)
    assert str(error.value) == (
        "junk.bin: not a safetensors file, a torch.save zip file or a "
        "torch.distributed.checkpoint folder (it starts b'GARBAGE!'); it may be truncated"
    )


def test_a_distributed_checkpoint_is_read_under_the_group_asked_for(tmp_path: Path) -> None:
    state = base_state()
    ema = {k: v + 1 for k, v in state.items() if v.is_floating_point()}
    save_dcp({"model": state, "ema": ema}, tmp_path / "dcp")
    with open_checkpoint(tmp_path / "dcp", key="ema") as reader:
        assert set(reader.metas) == set(ema)
        assert torch.equal(reader.read("head.weight"), ema["head.weight"])
        assert sorted(reader.skipped) == sorted(f"model.{k}" for k in state)
    with pytest.raises(CheckpointReadError, match=r"^dcp: has no group 'optim'"):
        open_checkpoint(tmp_path / "dcp", key="optim")
