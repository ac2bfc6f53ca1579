"""The safetensors reader: the header read before anything (every malformed or truncated
header named in one line), the keys under a prefix, and the tensors located in the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from isolate.certificates.safetensors_file import SafetensorsCheckpoint, read_header
from isolate.errors import CheckpointReadError


def _raw(path: Path, header: object, data: bytes = b"", *, length: int | None = None) -> Path:
    """A file of a header's length, the header as JSON, then ``data``."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    size = len(text) if length is None else length
    path.write_bytes(size.to_bytes(8, "little") + text + data)
    return path


def _two(path: Path, **kw: object) -> Path:
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(path), **kw)  # type: ignore[arg-type]
    return path


def test_a_file_shorter_than_the_header_s_length_is_named_with_no_length(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00")
    with pytest.raises(CheckpointReadError) as error:
        read_header(path)
    assert str(error.value) == (
        "x.safetensors: not a safetensors file or truncated in its header (header of -1 bytes, "
        "file of 5); re-copy or re-save the file"
    )


def test_a_header_that_ends_the_file_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    path = _raw(tmp_path / "x.safetensors", {})
    assert read_header(path) == (10, {})
    _raw(path, b"{}", length=3)
    with pytest.raises(CheckpointReadError) as error:
        read_header(path)
    assert str(error.value) == (
        "x.safetensors: not a safetensors file or truncated in its header (header of 3 bytes, "
        "file of 10); re-copy or re-save the file"
    )
    _raw(path, b"", length=0)
    with pytest.raises(CheckpointReadError, match=r"\(header of 0 bytes, file of 8\)"):
        read_header(path)


def test_a_header_of_one_byte_is_read_as_json(tmp_path: Path) -> None:
    path = _raw(tmp_path / "x.safetensors", b"1")
    with pytest.raises(CheckpointReadError) as error:
        read_header(path)
    assert str(error.value) == "x.safetensors: the safetensors header is not a JSON object"


def test_a_header_is_read_up_to_the_format_s_limit_of_100_mib(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    limit = 100 << 20
    with path.open("wb") as f:  # sparse: a header of zeros, read only at the limit
        f.write(limit.to_bytes(8, "little"))
        f.truncate(8 + limit + 1)
    with pytest.raises(
        CheckpointReadError, match=r"^x\.safetensors: the safetensors header is not"
    ):
        read_header(path)
    with path.open("r+b") as f:
        f.write((limit + 1).to_bytes(8, "little"))
    with pytest.raises(CheckpointReadError) as error:
        read_header(path)
    assert str(error.value).startswith(
        f"x.safetensors: not a safetensors file or truncated in its header (header of {limit + 1} "
        f"bytes, file of {8 + limit + 1})"
    )


@pytest.mark.parametrize(("text", "reason"), [(b"{\xff}", "'utf-8' codec"), (b"{,}", "Expecting")])
def test_a_header_that_is_not_json_is_named_with_the_reason(
    tmp_path: Path, text: bytes, reason: str
) -> None:
    path = _raw(tmp_path / "x.safetensors", text)
    with pytest.raises(CheckpointReadError) as error:
        read_header(path)
    message = str(error.value)
    assert message.startswith(f"x.safetensors: the safetensors header is not valid JSON ({reason}")
    assert message.endswith("); the file is corrupt: re-save it")
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_the_metadata_entry_is_not_a_tensor(tmp_path: Path) -> None:
    path = _two(tmp_path / "x.safetensors", metadata={"format": "pt"})
    start, header = read_header(path)
    assert start == 8 + int.from_bytes(path.read_bytes()[:8], "little")
    assert set(header) == {"a", "b"}
    with SafetensorsCheckpoint(path) as reader:
        assert list(reader.metas) == ["a", "b"] and reader.skipped == []


def test_a_truncated_file_names_the_first_tensor_cut_and_where_its_bytes_end(
    tmp_path: Path,
) -> None:
    path = _two(tmp_path / "x.safetensors")
    data = path.read_bytes()
    end = len(data)
    path.write_bytes(data[:-1])
    with pytest.raises(CheckpointReadError) as error:
        read_header(path)
    assert str(error.value) == (
        f"x.safetensors, tensor 'b': truncated: its bytes end at {end} but the file ends at "
        f"{end - 1}; re-copy the file"
    )
    path.write_bytes(data[: end - 13])  # a's last byte is gone too: a is named first
    with pytest.raises(
        CheckpointReadError, match=rf"tensor 'a': truncated: its bytes end at {end - 12} "
    ):
        read_header(path)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [1]},
        {"data_offsets": [0]},
        {"data_offsets": [0, 4, 8]},
        {"data_offsets": [0, "4"]},
        {"data_offsets": "04"},
        {"data_offsets": 4},
        [0, 4],
    ],
)
def test_an_entry_without_two_integer_offsets_is_named(tmp_path: Path, entry: object) -> None:
    path = _raw(tmp_path / "x.safetensors", {"a": entry}, bytes(4))
    with pytest.raises(CheckpointReadError) as error:
        read_header(path)
    assert str(error.value) == f"a safetensors header entry has no data_offsets: {entry!r}"


def test_keys_under_a_prefix_are_read_stripped_and_the_others_skipped(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    save_file(
        {"model.a": torch.ones(2), "extra": torch.zeros(1), "model.b": torch.ones(3)}, str(path)
    )
    with SafetensorsCheckpoint(path, key="model") as reader:
        assert reader.group == "model"
        assert set(reader.metas) == {"a", "b"} and reader.skipped == ["extra"]
        assert torch.equal(reader.read("b"), torch.ones(3))
    for key in (None, "", "auto"):
        with SafetensorsCheckpoint(path, key=key) as reader:
            assert reader.group is None and reader.skipped == []
            assert set(reader.metas) == {"model.a", "model.b", "extra"}
    with SafetensorsCheckpoint(path) as reader:  # "auto" by default
        assert reader.group is None and set(reader.metas) == {"model.a", "model.b", "extra"}
    with pytest.raises(CheckpointReadError, match=r"no key starts with 'mod\.'"):
        SafetensorsCheckpoint(path, key="mod")  # a prefix ends at a dot


def test_a_prefix_no_key_starts_with_is_refused(tmp_path: Path) -> None:
    path = _two(tmp_path / "x.safetensors")
    with pytest.raises(CheckpointReadError) as error:
        SafetensorsCheckpoint(path, key="model")
    assert str(error.value) == (
        "x.safetensors: no key starts with 'model.'; give key=None for the top level"
    )


def test_every_tensor_is_located_in_the_file_on_a_little_endian_machine(tmp_path: Path) -> None:
    path = _two(tmp_path / "x.safetensors", metadata={"format": "pt"})
    with SafetensorsCheckpoint(path) as reader:
        start = reader.data_start
        assert reader.offsets == {"a": (0, 8), "b": (8, 20)}
        if sys.byteorder == "little":
            spans = {k: (s.start, s.end, s.dtype, s.shape) for k, s in reader._spans.items()}
            assert spans == {
                "a": (start, start + 8, torch.float32, (2,)),
                "b": (start + 8, start + 20, torch.float32, (3,)),
            }


def test_a_file_safetensors_cannot_open_is_named(tmp_path: Path) -> None:
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}  # 8 bytes for 4
    path = _raw(tmp_path / "x.safetensors", header, bytes(4))
    with pytest.raises(CheckpointReadError) as error:
        SafetensorsCheckpoint(path)
    message = str(error.value)
    assert message.startswith("x.safetensors: safetensors cannot open it (")
    assert message.endswith("); re-save the file") and "\n" not in message


def test_a_tensor_safetensors_cannot_read_is_named(tmp_path: Path) -> None:
    class Refuses:
        def get_tensor(self, name: str) -> torch.Tensor:
            raise RuntimeError(f"no {name}")

    reader = SafetensorsCheckpoint(_two(tmp_path / "x.safetensors"))
    with reader, pytest.raises(CheckpointReadError) as error:
        reader._get(Refuses(), "a", "model.a")
    assert str(error.value) == (
        "x.safetensors, tensor 'a': safetensors cannot read it (no model.a); re-save the file"
    )


def test_without_the_safetensors_package_the_install_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _two(tmp_path / "x.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(CheckpointReadError) as error:
        SafetensorsCheckpoint(path)
    assert str(error.value) == (
        "x.safetensors: reading safetensors needs the safetensors package: "
        "pip install 'isolate[certify]'"
    )


def test_a_truncated_file_names_the_tensor_cut_first_in_the_file_not_by_name(
    tmp_path: Path,
) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    }
    path = _raw(tmp_path / "x.safetensors", header, bytes(3))
    start = path.stat().st_size - 3
    with pytest.raises(CheckpointReadError) as error:
        read_header(path)
    assert str(error.value) == (
        f"x.safetensors, tensor 'b': truncated: its bytes end at {start + 4} but the file ends "
        f"at {start + 3}; re-copy the file"
    )


def test_an_empty_tensor_is_read_in_the_order_of_where_its_bytes_start(tmp_path: Path) -> None:
    header = {
        "empty": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    }
    path = _raw(tmp_path / "x.safetensors", header, bytes(4))
    with SafetensorsCheckpoint(path) as reader:
        assert list(reader.metas) == ["a", "empty"]
        assert reader.read("empty").shape == (0,) and torch.equal(reader.read("a"), torch.zeros(1))


def test_the_window_given_is_the_reader_s(tmp_path: Path) -> None:
    with SafetensorsCheckpoint(_two(tmp_path / "x.safetensors"), window=1) as reader:
        assert reader.window == 1


class _Unreadable:
    """A safetensors handle whose tensors cannot be read."""

    def __init__(self, path: str, framework: str) -> None:
        pass

    def get_tensor(self, name: str) -> torch.Tensor:
        raise RuntimeError(f"no {name}")


def test_a_tensor_that_cannot_be_read_is_named_when_opened_and_when_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors

    path = tmp_path / "p.safetensors"
    save_file({"model.a": torch.ones(2)}, str(path))
    with SafetensorsCheckpoint(path, key="model") as reader:
        reader._safe_open = _Unreadable
        reader._release()
        with pytest.raises(CheckpointReadError) as error:
            reader.read("a")
    expected = (
        "p.safetensors, tensor 'a': safetensors cannot read it (no model.a); re-save the file"
    )
    assert str(error.value) == expected
    monkeypatch.setattr(safetensors, "safe_open", _Unreadable)
    with pytest.raises(CheckpointReadError) as error:
        SafetensorsCheckpoint(path, key="model")
    assert str(error.value) == expected
