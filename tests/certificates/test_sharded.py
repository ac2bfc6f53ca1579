"""Distributed checkpoints written by two ranks (tensors sharded by rows): read shard by
shard, certified clean, and a stale shard named with its file and the rows it holds.

The checkpoints are written by ``_dcp_script.py`` (2 CPU processes, gloo).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from isolate.certificates import certify
from isolate.certificates.dcp_folder import DcpCheckpoint
from tests._launch import launch
from tests.certificates._data import SPEC, base_state, trained

SCRIPT = Path(__file__).with_name("_dcp_script.py")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp_sharded")
    launch([sys.executable, str(SCRIPT), str(out)], cwd=out)
    return out


@pytest.mark.slow
def test_sharded_tensors_are_assembled_from_their_shards(folders: Path) -> None:
    with DcpCheckpoint(folders / "tuned") as reader:
        assert [s.file for s in reader.sources("head.weight")] == ["__0_0.distcp", "__1_0.distcp"]
        assert [s.offsets for s in reader.sources("head.weight")] == [(0, 0), (2, 0)]
        expected = trained(base_state())
        for key in expected:
            assert torch.equal(reader.read(key), expected[key]), key


@pytest.mark.slow
def test_a_sharded_run_is_certified_clean(folders: Path) -> None:
    cert = certify(folders / "base", folders / "tuned", spec=SPEC)
    assert cert.clean, str(cert)
    assert set(cert.base.hashes) == {".metadata", "__0_0.distcp", "__1_0.distcp"}


@pytest.mark.slow
def test_a_stale_shard_is_named_with_its_file(folders: Path, tmp_path: Path) -> None:
    stale = shutil.copytree(folders / "tuned", tmp_path / "stale")
    shutil.copy(folders / "base" / "__1_0.distcp", stale / "__1_0.distcp")  # rank 1's old shard
    cert = certify(folders / "base", stale, spec=SPEC)
    failed = {v.key: v for v in cert.failures}
    assert set(failed) == {"embed.weight", "out.weight", "head.weight", "head.bias"}
    head = failed["head.weight"]
    assert head.finding == "part did not move"
    assert "a stale shard? (__1_0.distcp at [2, 0])" in head.detail
