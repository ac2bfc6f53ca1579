"""The torch.save reader: a weights-only load onto the meta device for the index, each
failure named in one line, the group that holds the weights, and the tensors located in the
zip file's stored records."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
import torch

from isolate.certificates.torch_file import TorchCheckpoint, _records, load_weights_only
from isolate.errors import CheckpointReadError


class Opaque:
    """A class a weights-only load refuses."""


def _rewrite(src: Path, dst: Path, *, drop: str = "", byteorder: bytes | None = None) -> Path:
    """``src``'s zip records again (stored), without the one ending in ``drop``."""
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w") as new:
        for info in old.infolist():
            if drop and info.filename.endswith(drop):
                continue
            data = old.read(info)
            if byteorder is not None and info.filename.endswith("/byteorder"):
                data = byteorder
            new.writestr(zipfile.ZipInfo(info.filename), data, zipfile.ZIP_STORED)
    return dst


def test_a_pickle_that_needs_a_class_names_the_class(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2), "o": Opaque()}, path)
    with pytest.raises(CheckpointReadError) as error:
        load_weights_only(path, meta=True)
    assert str(error.value) == (
        f"x.pt: not a weights-only pickle (it needs {__name__}.Opaque), and certify runs no "
        f"code from a file; save the weights alone: torch.save(model.state_dict(), ...) or "
        f"safetensors"
    )
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_a_pickle_refused_for_no_class_needs_nothing_named(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(b"PK" + b"x" * 300)  # not a zip: read as a legacy pickle
    with pytest.raises(CheckpointReadError) as error:
        load_weights_only(path, meta=True)
    assert str(error.value) == (
        "x.pt: not a weights-only pickle, and certify runs no code from a file; save the "
        "weights alone: torch.save(model.state_dict(), ...) or safetensors"
    )


def test_an_empty_file_is_named_by_its_error_s_type(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(b"")
    with pytest.raises(CheckpointReadError) as error:
        TorchCheckpoint(path)
    assert str(error.value) == (
        "x.pt: cannot be read as a torch.save zip file (EOFError); it is truncated or "
        "corrupt: re-copy or re-save it"
    )
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_a_legacy_file_is_indexed_and_its_values_refused_in_160_characters(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.arange(4.0)}, path, _use_new_zipfile_serialization=False)
    with TorchCheckpoint(path) as reader:
        assert list(reader.metas) == ["w"] and reader._spans == {}  # not a zip: no records
        with pytest.raises(CheckpointReadError) as error:
            reader.read("w")
    reason = (
        "mmap can only be used with files saved with `torch.save(_use_new_zipfile_"
        "serialization=True), please torch.save your checkpoint with this option in order to use"
    )
    assert len(reason) == 160
    assert str(error.value) == (
        f"x.pt: cannot be read as a torch.save zip file ({reason}); it is truncated or "
        f"corrupt: re-copy or re-save it"
    )


def test_a_file_that_holds_no_mapping_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save([torch.ones(1)], path)
    with pytest.raises(CheckpointReadError) as error:
        TorchCheckpoint(path)
    assert str(error.value) == "x.pt: holds a list, not a state dict; save model.state_dict()"


def test_a_lightning_checkpoint_s_weights_are_found_by_default(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    torch.save({"epoch": 3, "state_dict": {"w": torch.ones(2), "step": 4}}, path)
    with TorchCheckpoint(path) as reader:
        assert reader.group == "state_dict" and list(reader.metas) == ["w"]
        assert reader.skipped == ["step"] and torch.equal(reader.read("w"), torch.ones(2))
    torch.save({"w": torch.ones(2), "step": 4}, path)
    with TorchCheckpoint(path) as reader:
        assert reader.group is None and reader.skipped == ["step"]


def test_tensors_are_read_in_the_order_of_their_bytes_and_views_last(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    w = torch.arange(6.0).reshape(2, 3)
    torch.save({"t": w.t(), "a": torch.ones(2), "b": w}, path)
    with TorchCheckpoint(path) as reader:
        assert list(reader.metas) == ["b", "a", "t"]
        spans = {k: (s.end - s.start, s.dtype, s.shape) for k, s in reader._spans.items()}
        assert spans == {"b": (24, torch.float32, (2, 3)), "a": (8, torch.float32, (2,))}
        data = path.read_bytes()
        for key in ("a", "b"):
            span = reader._spans[key]
            raw = torch.frombuffer(bytearray(data[span.start : span.end]), dtype=torch.float32)
            assert torch.equal(raw.reshape(span.shape), reader.read(key))


def test_records_are_found_without_a_byteorder_and_none_in_the_other_order(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    raw = torch.arange(4.0).numpy().tobytes()
    for name, drop in (("plain.pt", ""), ("none.pt", "/byteorder")):
        copy = _rewrite(path, tmp_path / name, drop=drop)
        [(offset, size)] = _records(copy).items()
        assert (size, copy.read_bytes()[offset : offset + size]) == (16, raw), name
    other = b"big" if sys.byteorder == "little" else b"little"
    assert _records(_rewrite(path, tmp_path / "other.pt", byteorder=other)) == {}


def test_a_tensor_past_the_end_of_its_record_is_named_with_both_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from isolate.certificates import torch_file

    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(4)}, path)
    [(offset, size)] = _records(path).items()
    monkeypatch.setattr(torch_file, "_records", lambda at: {offset: size - 1})
    with pytest.raises(CheckpointReadError) as error:
        TorchCheckpoint(path)
    assert str(error.value) == (
        f"x.pt, tensor 'w': its bytes end at {offset + 16}, past the end of its record in the "
        f"file ({offset + 15}); the file is corrupt: re-save it"
    )


def test_a_quantised_tensor_is_refused_by_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    quantised = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    torch.save({"w": torch.ones(2), "q": quantised}, path)
    with pytest.raises(CheckpointReadError) as error:
        TorchCheckpoint(path)
    assert str(error.value) == (
        "x.pt, tensor 'q': a quantised torch.qint8 tensor, whose bytes do not hold its scale "
        "and zero point; certify reads plain tensors only: save its int_repr(), q_scale() and "
        "q_zero_point(), or its dequantize()"
    )


def test_a_sparse_tensor_is_refused_as_one_not_as_a_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2), "s": torch.eye(2).to_sparse()}, path)
    with (
        pytest.warns(UserWarning, match="sparse tensor invariants"),
        pytest.raises(CheckpointReadError) as error,
    ):
        TorchCheckpoint(path)
    assert str(error.value) == (
        "x.pt, tensor 's': a torch.sparse_coo tensor; certify reads dense tensors only: save it "
        "with .to_dense()"
    )


@pytest.mark.filterwarnings("ignore:.*sparse.*:UserWarning")
@pytest.mark.parametrize("layout", ["csr", "csc", "bsr", "bsc"])
def test_a_compressed_sparse_tensor_is_refused_as_one_not_as_a_corrupt_file(
    tmp_path: Path, layout: str
) -> None:
    # Loading onto the meta device fails for these layouts with a RuntimeError, not the
    # NotImplementedError of COO: it must not read as a corrupt file.
    path = tmp_path / "x.pt"
    eye = torch.eye(4)
    sparse = {
        "csr": eye.to_sparse_csr(),
        "csc": eye.to_sparse_csc(),
        "bsr": eye.to_sparse_bsr((2, 2)),
        "bsc": eye.to_sparse_bsc((2, 2)),
    }[layout]
    torch.save({"w": torch.ones(2), "s": sparse}, path)
    with pytest.raises(CheckpointReadError) as error:
        TorchCheckpoint(path)
    assert str(error.value) == (
        f"x.pt, tensor 's': a torch.sparse_{layout} tensor; certify reads dense tensors only: "
        f"save it with .to_dense()"
    )


def test_a_sparse_tensor_outside_the_weights_leaves_them_readable(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    weights = {"w": torch.arange(4.0)}
    torch.save({"state_dict": weights, "extra": {"s": torch.eye(2).to_sparse()}}, path)
    with (
        pytest.warns(UserWarning, match="sparse tensor invariants"),
        TorchCheckpoint(path) as reader,
    ):
        assert reader.group == "state_dict" and list(reader.metas) == ["w"]
        assert torch.equal(reader.read("w"), weights["w"])


def test_a_file_saved_from_a_gpu_is_read_onto_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.serialization

    path = tmp_path / "x.pt"
    with monkeypatch.context() as patch:  # each storage recorded as on cuda:0
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"w": torch.arange(3.0)}, path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with TorchCheckpoint(path) as reader:
        value = reader.read("w")
    assert value.device == torch.device("cpu") and torch.equal(value, torch.arange(3.0))


def test_a_pickle_that_needs_a_class_is_refused_whatever_torch_s_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2), "o": Opaque()}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # torch < 2.6's default
    with pytest.raises(CheckpointReadError, match=r"^x\.pt: not a weights-only pickle \(it needs"):
        TorchCheckpoint(path)


def test_entries_after_one_that_is_no_tensor_are_read_and_the_window_kept(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"step": 4, "w": torch.ones(2)}, path)
    with TorchCheckpoint(path, window=1) as reader:
        assert reader.window == 1
        assert list(reader.metas) == ["w"] and reader.skipped == ["step"]
