"""``python -m experiments fit`` with a spec that cannot work: one line, status 2."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from experiments.__main__ import main
from tests._launch import REPO

pytestmark = [
    pytest.mark.filterwarnings("ignore::experiments.data.TestSplitOnlyWarning"),
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]


def _idx(data: bytes, code: int, *dims: int) -> bytes:
    return struct.pack(">HBB", 0, code, len(dims)) + struct.pack(f">{len(dims)}I", *dims) + data


def fake_test_split(root: Path, n: int = 40) -> Path:
    """An MNIST test split of ``n`` blank images (IDX files, not checked against the md5s)."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "t10k-images-idx3-ubyte").write_bytes(_idx(bytes(n * 28 * 28), 0x08, n, 28, 28))
    (raw / "t10k-labels-idx1-ubyte").write_bytes(_idx(bytes(i % 10 for i in range(n)), 0x08, n))
    return root


def test_a_bad_selector_in_the_callback_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "typo.yaml"
    config.write_text(
        (REPO / "configs" / "frozen_trunk.yaml").read_text().replace("[trunk]", "[trunkk]")
    )
    status = main(
        [
            "fit",
            "--config",
            str(config),
            f"--data.data_root={fake_test_split(tmp_path / 'data')}",
            "--data.verify_md5=false",
            "--data.batch_size=8",
            f"--trainer.default_root_dir={tmp_path / 'runs'}",
            "--trainer.max_steps=1",
        ]
    )
    assert status == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert err == [
        "python -m experiments: error: SelectorError: IsolationCallback(freeze): 'trunkk' "
        "matched no parameter of IsolationNet; its children are ['trunk', 'head', 'branches']; "
        "a module name must name a submodule that has parameters"
    ]
