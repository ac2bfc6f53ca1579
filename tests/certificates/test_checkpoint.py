"""What every reader shares: the mapping let go every ``window`` bytes, a tensor checked
against the index, where a tensor is stored, and no file hash unless one is asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolate.certificates.checkpoint import Checkpoint, Source, TensorMeta
from isolate.certificates.opening import open_checkpoint
from isolate.errors import CheckpointReadError
from isolate.fingerprints import fingerprint


class _Memory(Checkpoint):
    """A checkpoint held in memory that logs what it reads and when it lets go of its mapping."""

    format = "memory"

    def __init__(self, tensors: dict[str, torch.Tensor], *, window: int) -> None:
        super().__init__(Path("mem.pt"), window=window)
        self.tensors = tensors
        self._metas = {k: TensorMeta(v.dtype, tuple(v.shape)) for k, v in tensors.items()}
        self.log: list[str] = []

    def files(self) -> list[Path]:
        return [self.path]

    def _read(self, key: str) -> torch.Tensor:
        self.log.append(key)
        return self.tensors[key]

    def _release(self) -> None:
        self.log.append("release")


def test_the_mapping_is_let_go_when_the_next_tensor_would_pass_the_window() -> None:
    tensors = {name: torch.zeros(4) for name in "abcde"}  # 16 bytes each
    reader = _Memory(tensors, window=32)
    for name in tensors:
        reader.read(name)
    # two tensors fill the window exactly; the third would pass it
    assert reader.log == ["a", "b", "release", "c", "d", "release", "e"]


def test_a_window_smaller_than_a_tensor_lets_go_before_every_tensor_but_the_first() -> None:
    reader = _Memory({"a": torch.zeros(8), "b": torch.zeros(2), "c": torch.zeros(1)}, window=4)
    for name in ("a", "b", "c"):
        reader.read(name)
    assert reader.log == ["a", "release", "b", "release", "c"]


@pytest.mark.parametrize(
    ("data", "found"),
    [
        (torch.zeros(2, 3, dtype=torch.float64), "float64[2, 3]"),
        (torch.zeros(3, 2), "float32[3, 2]"),
    ],
)
def test_a_tensor_that_is_not_what_the_index_says_is_refused_as_corrupt(
    data: torch.Tensor, found: str
) -> None:
    reader = _Memory({"head.weight": torch.zeros(2, 3)}, window=1 << 20)
    reader.tensors["head.weight"] = data  # the dtype alone, or the shape alone, differs
    with pytest.raises(CheckpointReadError) as error:
        reader.read("head.weight")
    assert str(error.value) == (
        f"mem.pt, tensor 'head.weight': the index says float32[2, 3] but the data is {found}; "
        "the file is corrupt: re-save it"
    )


def test_a_single_file_stores_each_tensor_whole_and_names_it_alone_or_with_a_key(
    tmp_path: Path,
) -> None:
    torch.save({"w": torch.ones(2, 3), "s": torch.tensor(1.0)}, tmp_path / "x.pt")
    with open_checkpoint(tmp_path / "x.pt") as reader:
        assert reader.sources("w") == [Source("x.pt", (0, 0), (2, 3))]
        assert reader.sources("s") == [Source("x.pt", (), ())]
        assert reader.where() == "x.pt"
        assert reader.where("w") == "x.pt, tensor 'w'"


@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_a_reader_opened_alone_hashes_no_file_and_still_fingerprints(
    tmp_path: Path, suffix: str
) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    if suffix == "pt":
        torch.save(state, tmp_path / "x.pt")
    else:
        from safetensors.torch import save_file

        save_file(state, str(tmp_path / "x.safetensors"))
    with open_checkpoint(tmp_path / f"x.{suffix}") as reader:
        assert reader.file_hash == "none"
        assert reader.print_of("w") == fingerprint(state["w"])
        assert reader.file_hashes() == {}
