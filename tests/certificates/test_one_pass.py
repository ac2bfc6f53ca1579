"""The files' own hashes and the tensors' fingerprints come from one pass over each file: the
hash recorded is the one any tool gives for the whole file, every byte is read once, and a
file cut short or a stale shard is still caught."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from isolate.certificates import certify, torch_file
from isolate.certificates import checkpoint as checkpoint_module
from isolate.certificates.dcp_folder import DcpCheckpoint
from isolate.certificates.opening import open_checkpoint
from isolate.certificates.streaming import FileCursor, Span
from isolate.errors import CheckpointReadError
from isolate.fingerprints import fingerprint
from tests.certificates._data import FORMATS, SPEC, base_state, pair, trained


def _independent(path: Path, kind: str) -> str:
    """The file's hash as ``xxhsum -H2`` or ``sha256sum`` print it, from the file alone."""
    hasher: Any = xxhash.xxh3_128() if kind == "xxh3" else hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            hasher.update(chunk)
    return f"{'xxh3_128' if kind == 'xxh3' else 'sha256'}:{hasher.hexdigest()}"


def _files(path: Path) -> list[Path]:
    return sorted(path.iterdir()) if path.is_dir() else [path]


class _Reads:
    """The bytes read from each file by the cursors, and how many tensors were fingerprinted
    from values handed out rather than from the file's bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.walked: dict[str, int] = {}
        self.from_values = 0
        walk = FileCursor._walk
        plain = checkpoint_module.fingerprint

        def walking(cursor: FileCursor, start: int, end: int, sinks: Any) -> None:
            walk(cursor, start, end, sinks)
            self.walked[str(cursor.path)] = self.walked.get(str(cursor.path), 0) + end - start

        def counted(t: torch.Tensor) -> int:
            self.from_values += 1
            return plain(t)

        monkeypatch.setattr(FileCursor, "_walk", walking)
        monkeypatch.setattr(checkpoint_module, "fingerprint", counted)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["xxh3", "sha256"])
def test_the_recorded_hash_is_the_whole_files_hash(tmp_path: Path, fmt: str, kind: str) -> None:
    tuned_state = {"aaa.first": torch.ones(3), **trained(base_state())}  # first in the tuned file
    base, tuned = pair(tmp_path, fmt, tuned_state)
    cert = certify(base, tuned, spec=SPEC, file_hash=kind)  # type: ignore[arg-type]
    assert cert.base.hashes == {f.name: _independent(f, kind) for f in _files(base)}
    assert cert.tuned.hashes == {f.name: _independent(f, kind) for f in _files(tuned)}
    assert cert.verdict("aaa.first").finding == "not in the base checkpoint"


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_each_file_is_read_once_for_its_hash_and_every_fingerprint(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tuned file holds its tensors in another order than the base's: the pass asks for
    # them in the base's order, and the cursor fingerprints those it passes on the way.
    tuned_state = dict(reversed(list(trained(base_state()).items())))
    base, tuned = pair(tmp_path, fmt, tuned_state)
    reads = _Reads(monkeypatch)
    cert = certify(base, tuned, spec=SPEC)
    assert cert.clean
    assert reads.walked == {str(f): f.stat().st_size for f in (base, tuned)}
    assert reads.from_values == 0
    plain = certify(base, tuned, spec=SPEC, file_hash="none")  # fingerprints alone: the same
    assert [(v.key, v.base, v.tuned) for v in plain.verdicts] == [
        (v.key, v.base, v.tuned) for v in cert.verdicts
    ]


def test_views_in_a_torch_file_are_fingerprinted_and_its_bytes_hashed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors sharing a storage (a tie, a slice) and a transposed view saved as such."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(4, 6, generator=g)
    flat = torch.arange(20.0)
    state = {
        "w": weight,
        "tied": weight,
        "slice": flat[5:12],
        "flat": flat,
        "wt": weight.t(),
    }
    torch.save(state, tmp_path / "views.pt")
    with open_checkpoint(tmp_path / "views.pt") as reader:
        reader.file_hash = "xxh3"
        for key, value in state.items():
            assert reader.print_of(key) == fingerprint(value), key
        hashes = reader.file_hashes()
    assert hashes == {"views.pt": _independent(tmp_path / "views.pt", "xxh3")}
    reads = _Reads(monkeypatch)
    shutil.copy(tmp_path / "views.pt", tmp_path / "again.pt")
    cert = certify(tmp_path / "views.pt", tmp_path / "again.pt", ties=[["w", "tied"]])
    assert cert.clean and cert.base.hashes["views.pt"] == cert.tuned.hashes["again.pt"]
    assert reads.from_values == 2  # the transposed view, in each file; the rest from bytes
    size = (tmp_path / "views.pt").stat().st_size
    behind = 7 * 4 + 24 * 4  # the slice and the tie: behind the cursor, read on their own
    assert reads.walked == {str(tmp_path / n): size + behind for n in ("views.pt", "again.pt")}


def test_dcp_shards_are_hashed_as_the_pass_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    reads = _Reads(monkeypatch)
    during: dict[str, int] = {}  # what was hashed of each shard before the hashes were asked for
    hashes = DcpCheckpoint.file_hashes

    def asked(reader: DcpCheckpoint) -> dict[str, str]:
        during.update(reads.walked)
        return hashes(reader)

    monkeypatch.setattr(DcpCheckpoint, "file_hashes", asked)
    cert = certify(base, tuned, spec=SPEC)
    assert cert.clean
    with DcpCheckpoint(tuned) as reader:
        tensors = {tuned / s.file for k in reader.metas for s in reader.sources(k)}
    assert {f: during.get(str(f)) for f in tensors} == {f: f.stat().st_size for f in tensors}
    assert reads.walked == {str(f): f.stat().st_size for f in _files(base) + _files(tuned)}
    assert cert.tuned.hashes == {f.name: _independent(f, "xxh3") for f in _files(tuned)}


def test_a_stale_shard_is_still_caught_and_its_own_hash_recorded(tmp_path: Path) -> None:
    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    with DcpCheckpoint(tuned) as reader:
        shard = reader.sources("head.weight")[0].file
    shutil.copy(base / shard, tuned / shard)
    cert = certify(base, tuned, spec=SPEC)
    assert [(v.key, v.finding) for v in cert.failures] == [("head.weight", "did not move")]
    assert cert.tuned.hashes[shard] == _independent(base / shard, "xxh3")


def test_a_file_cut_short_while_it_is_read_is_named(tmp_path: Path) -> None:
    data = bytes(range(256)) * 64
    path = tmp_path / "file.bin"
    path.write_bytes(data)
    cursor = FileCursor(path, "xxh3", {"t": Span(0, 4096, torch.uint8, (4096,))})
    try:
        cursor.print_of("t")
        path.write_bytes(data[:8000])
        with pytest.raises(CheckpointReadError, match=r"^file\.bin: truncated while being read"):
            cursor.finish()
    finally:
        cursor.close()
    with pytest.raises(CheckpointReadError, match=r"^file\.bin, tensor 't': truncated"):
        FileCursor(path, "xxh3", {"t": Span(0, 9000, torch.uint8, (9000,))})


def test_a_tensor_past_the_end_of_its_record_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "short.pt"
    torch.save({"w": torch.ones(4, 4)}, path)
    records = torch_file._records

    def shorter(at: Path) -> dict[int, int]:
        return {offset: size - 4 for offset, size in records(at).items()}

    monkeypatch.setattr(torch_file, "_records", shorter)
    with pytest.raises(CheckpointReadError, match=r"^short\.pt, tensor 'w': its bytes end at"):
        open_checkpoint(path)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_truncated_file_is_still_caught(tmp_path: Path, fmt: str) -> None:
    base, tuned = pair(tmp_path, fmt, trained(base_state()))
    data = tuned.read_bytes()
    tuned.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointReadError, match=r"^tuned\.(safetensors|pt)"):
        certify(base, tuned, spec=SPEC)
