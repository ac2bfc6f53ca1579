"""A torch.distributed.checkpoint folder read by DcpCheckpoint: its metadata unpickled with the
checkpoint's own classes only, a chunk that cannot be read named with its shard file, a
tensor stored in several files named with all of them, and entries stored without a file."""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from isolate.certificates import certify
from isolate.certificates.dcp_folder import DcpCheckpoint, load_metadata
from isolate.errors import CheckpointReadError
from tests.certificates._data import SPEC, base_state, pair, trained


class _Opaque:
    loaded = False

    def __setstate__(self, state: object) -> None:
        _Opaque.loaded = True


def _edit_metadata(folder: Path, edit: object) -> None:
    meta = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file
    edit(meta)  # type: ignore[operator]
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def _chunk(folder: Path, key: str) -> tuple[Path, int, int]:
    """The file of the one chunk of ``key`` (a tensor of the ``model`` group), its offset and
    length."""
    [info] = [v for k, v in load_metadata(folder).storage_data.items() if k.fqn == f"model.{key}"]
    return folder / info.relative_path, int(info.offset), int(info.length)


@pytest.mark.parametrize(
    ("module", "name"),
    [("numpy", "float32"), ("builtins", "Size"), ("os", "system"), ("torch", "load")],
)
def test_metadata_naming_a_class_the_checkpoint_does_not_use_is_refused_by_name(
    tmp_path: Path, module: str, name: str
) -> None:
    # (a dtype's name or Size is taken from torch only: from another module it is refused)
    (tmp_path / ".metadata").write_bytes(f"c{module}\n{name}\n.".encode())
    with pytest.raises(CheckpointReadError) as error:
        load_metadata(tmp_path)
    assert str(error.value) == (
        f"{tmp_path.name}/.metadata: holds more than checkpoint metadata (it needs "
        f"{module}.{name}), and certify runs no code from a file; re-save the checkpoint"
    )
    (tmp_path / ".metadata").write_bytes(b"ctorch\nfloat16\n.")
    assert load_metadata(tmp_path) is torch.float16


def test_a_chunk_that_cannot_be_read_is_named_with_its_shard_and_the_errors_first_line(
    tmp_path: Path,
) -> None:
    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    shard, offset, length = _chunk(tuned, "head.weight")
    data = bytearray(shard.read_bytes())
    data[offset + 100 : offset + 400] = bytes(300)  # same length, its zip headers zeroed
    shard.write_bytes(bytes(data))
    with pytest.raises(RuntimeError) as raised:  # what torch says of these bytes
        torch.load(io.BytesIO(bytes(data[offset : offset + length])), weights_only=True)
    first = str(raised.value).strip().splitlines()[0]
    with pytest.raises(CheckpointReadError) as error:
        certify(base, tuned, spec=SPEC)
    assert str(error.value) == (
        f"tuned/{shard.name}, tensor 'head.weight': cannot be read ({first[:160]}); the shard "
        "is truncated, corrupt or stale: re-copy it"
    )


@pytest.mark.parametrize(
    ("raised", "shown"),
    [
        (RuntimeError("x" * 170 + "\nthe second line"), "x" * 160),
        (OSError(" short\nthe second line "), "short"),
        (AssertionError(), "AssertionError"),
        (EOFError(""), "EOFError"),
    ],
)
def test_a_read_error_shows_160_characters_of_its_first_line_or_its_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: Exception, shown: str
) -> None:
    _, tuned = pair(tmp_path, "dcp", trained(base_state()))

    def fail(*args: object) -> None:
        raise raised

    shard, _, _ = _chunk(tuned, "head.bias")
    with DcpCheckpoint(tuned) as reader:
        monkeypatch.setattr(reader._reader, "read_data", fail)
        with pytest.raises(CheckpointReadError) as error:
            reader.read("head.bias")
    assert str(error.value) == (
        f"tuned/{shard.name}, tensor 'head.bias': cannot be read ({shown}); the shard is "
        "truncated, corrupt or stale: re-copy it"
    )


def test_a_chunk_that_is_not_a_weights_only_pickle_is_refused_without_running_it(
    tmp_path: Path,
) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    shard, _, _ = _chunk(tuned, "head.weight")
    buffer = io.BytesIO()
    torch.save({"head": _Opaque()}, buffer)
    shard.write_bytes(buffer.getvalue())

    def point_at_it(meta: object) -> None:
        index = MetadataIndex("model.head.weight", torch.Size([0, 0]))
        info = meta.storage_data[index]  # type: ignore[attr-defined]
        meta.storage_data[index] = dataclasses.replace(  # type: ignore[attr-defined]
            info, offset=0, length=len(buffer.getvalue())
        )

    _edit_metadata(tuned, point_at_it)
    with pytest.raises(CheckpointReadError) as error:
        certify(base, tuned, spec=SPEC)
    assert str(error.value) == (
        f"tuned/{shard.name}, tensor 'head.weight': a chunk is not a weights-only pickle, and "
        "certify runs no code from a file; re-save the checkpoint"
    )
    assert not _Opaque.loaded


def test_a_tensor_stored_in_two_files_is_named_with_both(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    state = trained(base_state())
    base, tuned = pair(tmp_path, "dcp", state)
    whole, _, _ = _chunk(tuned, "head.weight")
    whole.unlink()
    fqn = "model.head.weight"
    parts = {"rows_a.distcp": (0, 2), "rows_b.distcp": (2, 3)}  # rows [0, 2) and [2, 3)

    def split(meta: object) -> None:
        item = meta.state_dict_metadata[fqn]  # type: ignore[attr-defined]
        item.chunks = []
        del meta.storage_data[MetadataIndex(fqn, torch.Size([0, 0]))]  # type: ignore[attr-defined]
        for name, (start, stop) in parts.items():
            buffer = io.BytesIO()
            torch.save(state["head.weight"][start:stop].clone(), buffer)
            (tuned / name).write_bytes(buffer.getvalue())
            chunk = ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([stop - start, 6]))
            item.chunks.append(chunk)
            meta.storage_data[MetadataIndex(fqn, chunk.offsets)] = _StorageInfo(  # type: ignore[attr-defined]
                name, 0, len(buffer.getvalue())
            )

    _edit_metadata(tuned, split)
    with DcpCheckpoint(tuned) as reader:
        assert (
            reader.where("head.weight")
            == "tuned/{rows_a.distcp,rows_b.distcp}, tensor 'head.weight'"
        )
        assert torch.equal(reader.read("head.weight"), state["head.weight"])
        assert reader.where("head.bias").endswith(".distcp, tensor 'head.bias'")
        assert reader.where("step") == "tuned, tensor 'step'"  # no tensor: the folder
        assert reader.where() == "tuned"
    assert certify(base, tuned, spec=SPEC).clean


def test_an_entry_stored_without_a_file_is_left_out_of_the_files_and_hashes(
    tmp_path: Path,
) -> None:
    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    [step] = [k for k in load_metadata(tuned).storage_data if k.fqn == "step"]
    step_file = load_metadata(tuned).storage_data[step].relative_path

    def no_file(meta: object) -> None:
        meta.storage_data[step] = None  # type: ignore[attr-defined]

    _edit_metadata(tuned, no_file)
    (tuned / "XXXX").write_bytes(b"old")  # left by another save, like the step's file now
    with DcpCheckpoint(tuned) as reader:
        files = reader.files()
        assert files[0] == tuned / ".metadata" and len(files) == 12  # and the 11 tensors'
        assert tuned / step_file not in files
        assert reader.unreferenced() == sorted(["XXXX", step_file])
    cert = certify(base, tuned, spec=SPEC, file_hash="sha256")
    assert cert.clean and set(cert.tuned.hashes) == {f.name for f in files}


@pytest.mark.parametrize(
    "recorded",
    [None, {}, "model", {"model.head.weight": "model.head.weight", "model.head.bias": ()}],
)
def test_without_a_usable_planner_record_each_entry_is_read_under_its_flat_name(
    tmp_path: Path, recorded: object
) -> None:
    state = trained(base_state())
    _, tuned = pair(tmp_path, "dcp", state)

    def record(meta: object) -> None:
        meta.planner_data = recorded  # type: ignore[attr-defined]

    _edit_metadata(tuned, record)
    with DcpCheckpoint(tuned) as reader:  # "auto": the top level holds tensors
        assert (reader.group, reader.skipped) == (None, ["step"])
        assert sorted(reader.metas) == sorted(f"model.{k}" for k in state)
        assert torch.equal(reader.read("model.head.bias"), state["head.bias"])


@pytest.mark.parametrize("stored", ["missing", None, 5])
def test_a_chunk_listed_without_where_it_is_stored_is_refused(
    tmp_path: Path, stored: object
) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    _, tuned = pair(tmp_path, "dcp", trained(base_state()))
    index = MetadataIndex("model.head.weight", torch.Size([0, 0]))

    def unplace(meta: object) -> None:
        if stored == "missing":
            del meta.storage_data[index]  # type: ignore[attr-defined]
        else:
            meta.storage_data[index] = stored  # type: ignore[attr-defined]

    _edit_metadata(tuned, unplace)
    with pytest.raises(CheckpointReadError) as error:
        DcpCheckpoint(tuned)
    assert str(error.value) == (
        "tuned, tensor 'head.weight': .metadata lists a chunk at [0, 0] but not where it is "
        "stored; the metadata is corrupt: re-save the checkpoint"
    )


@pytest.mark.parametrize(
    ("cut", "error"),
    [(0, "EOFError"), (10, "UnpicklingError"), (0.5, "UnpicklingError"), (-3, "UnpicklingError")],
)
def test_a_truncated_metadata_file_is_named_as_truncated_not_as_foreign(
    tmp_path: Path, cut: float, error: str
) -> None:
    _, tuned = pair(tmp_path, "dcp", trained(base_state()))
    data = (tuned / ".metadata").read_bytes()
    end = int(len(data) * cut) if isinstance(cut, float) else int(cut)  # or a slice's end
    (tuned / ".metadata").write_bytes(data[:end])
    with pytest.raises(CheckpointReadError) as raised:
        DcpCheckpoint(tuned)
    assert str(raised.value) == f"tuned/.metadata: truncated or corrupt ({error}); re-copy it"


def test_a_group_whose_first_entry_is_no_tensor_is_still_a_group(tmp_path: Path) -> None:
    from tests.certificates._data import save_dcp

    weight = torch.arange(6.0)
    save_dcp({"model": {"epoch": 3, "w": weight}, "optim": {"lr": 0.1, "m": weight}}, tmp_path)
    for key, name in (("auto", "w"), ("optim", "m")):  # auto: the first of the groups known
        with DcpCheckpoint(tmp_path, key=key) as reader:
            assert (reader.group, list(reader.metas)) == (key.replace("auto", "model"), [name])
            assert torch.equal(reader.read(name), weight)


def test_the_group_read_and_each_tensors_name_under_it(tmp_path: Path) -> None:
    from tests.certificates._data import save_dcp

    state = trained(base_state())
    save_dcp(dict(state), tmp_path / "flat")  # tensors at the top level: read there
    with DcpCheckpoint(tmp_path / "flat") as reader:
        assert reader.group is None and sorted(reader.metas) == sorted(state)
    save_dcp({"model": {"encoder": {"weight": state["head.weight"]}}}, tmp_path / "deep")
    with DcpCheckpoint(tmp_path / "deep") as reader:
        assert (reader.group, list(reader.metas)) == ("model", ["encoder.weight"])
    _, tuned = pair(tmp_path, "dcp", state)
    with DcpCheckpoint(tuned, window=1) as reader:  # every tensor is read whatever the window
        assert (reader.group, reader.window) == ("model", 1)
        for key in state:
            assert torch.equal(reader.read(key), state[key]), key
    with DcpCheckpoint(tuned) as reader:
        for key in state:
            assert torch.equal(reader.read(key), state[key]), key


def test_tensors_are_read_in_the_order_of_their_bytes_in_the_shards(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = trained(base_state())  # not in alphabetical order: embed, trunk..., head, out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is unavailable ... single process"
        writer = FileSystemWriter(tmp_path, single_file_per_rank=True)
        dcp.save(dict(state), storage_writer=writer)
    with DcpCheckpoint(tmp_path) as reader:
        assert list(reader.metas) == list(state)
        assert {s.file for k in state for s in reader.sources(k)} == {"__0_0.distcp"}


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_shard_cut_short_or_missing_is_named_with_the_bytes_it_needs(
    tmp_path: Path, keep: float
) -> None:
    _, tuned = pair(tmp_path, "dcp", trained(base_state()))
    shard, offset, length = _chunk(tuned, "head.weight")
    if keep:
        shard.write_bytes(shard.read_bytes()[: int(shard.stat().st_size * keep)])
        got = f"{shard.stat().st_size} bytes"
    else:
        shard.unlink()
        got = "no such file"
    with pytest.raises(CheckpointReadError) as error:
        DcpCheckpoint(tuned)
    assert str(error.value) == (
        f"tuned/{shard.name}, tensor 'head.weight': the chunk at [0, 0] needs bytes up to "
        f"{offset + length}, got {got}; the shard is truncated or missing: re-copy it"
    )


def test_a_tensor_listed_with_no_chunk_is_refused(tmp_path: Path) -> None:
    _, tuned = pair(tmp_path, "dcp", trained(base_state()))

    def no_chunks(meta: object) -> None:
        meta.state_dict_metadata["model.head.weight"].chunks = []  # type: ignore[attr-defined]

    _edit_metadata(tuned, no_chunks)
    with pytest.raises(CheckpointReadError) as error:
        DcpCheckpoint(tuned)
    assert str(error.value) == "tuned, tensor 'head.weight': .metadata lists no chunk for it"


def test_a_folder_without_metadata_lists_its_first_six_files(tmp_path: Path) -> None:
    for i in range(8):
        (tmp_path / f"file{i}.bin").write_bytes(b"")
    with pytest.raises(CheckpointReadError) as error:
        load_metadata(tmp_path)
    assert str(error.value) == (
        f"{tmp_path.name}: a folder without .metadata, so not a torch.distributed.checkpoint "
        f"(its files: {[f'file{i}.bin' for i in range(6)]}); give the checkpoint folder itself"
    )
