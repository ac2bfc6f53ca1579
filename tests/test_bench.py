"""The benchmark script runs and writes its numbers (timings are never asserted on)."""

from __future__ import annotations

import json
from pathlib import Path

from experiments import bench


def test_quick_benchmark_writes_json_and_markdown(tmp_path: Path) -> None:
    assert bench.main(["--quick", "--only", "freeze", "report", "--output", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["env"]["quick"] is True and payload["env"]["torch"]
    names = [row["name"] for row in payload["rows"]]
    assert any(name.startswith("freeze+restore") for name in names)
    assert any(name.startswith("gradient_report") for name in names)
    for row in payload["rows"]:
        assert row["candidate_s"] > 0 and row["baseline_s"] > 0 and row["ratio"] > 0
        assert isinstance(row["ok"], bool) and row["target"]
    table = (tmp_path / "bench.md").read_text()
    assert table.count("\n| ") == len(payload["rows"]) + 2  # header, separator, rows
