"""The five planted corruptions, each caught and named in the certificate: one base row
changed, a tie broken, a merge scale off by alpha/r, a stale shard, a drifted buffer."""

from __future__ import annotations

import shutil
from pathlib import Path

from isolate.certificates import certify
from isolate.certificates.dcp_folder import DcpCheckpoint
from tests.certificates._data import (
    ALPHA,
    SPEC,
    TARGET,
    R,
    base_state,
    lora_adapter,
    lora_base,
    merged,
    pair,
    trained,
    write_lora,
)


def test_one_base_row_changed(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["trunk.0.weight"][3] += 1e-6
    [fail] = certify(*pair(tmp_path, "safetensors", tuned), spec=SPEC).failures
    assert (fail.key, fail.claim, fail.finding) == ("trunk.0.weight", "frozen", "changed")
    assert fail.detail.startswith("1 of 6 rows differ (rows [3])")


def test_a_tie_broken(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["out.weight"] = tuned["out.weight"] + 0.5  # trained apart from the embedding
    [fail] = certify(*pair(tmp_path, "torch", tuned), spec=SPEC).failures
    assert (fail.key, fail.finding) == ("embed.weight = out.weight", "tie broken")


def test_a_merge_scale_off_by_alpha_over_r(tmp_path: Path) -> None:
    adapter = lora_adapter()
    tuned = merged(lora_base(), adapter, scale=1.0)  # merged without lora_alpha / r
    paths = write_lora(tmp_path, tuned, adapter)
    cert = certify(
        paths["base"], paths["tuned"], adapter_config=paths["config"], adapter=paths["adapter"]
    )
    [fail] = cert.failures
    assert (fail.key, fail.claim, fail.finding) == (f"{TARGET}.weight", "merged", "merge off")
    assert f"not base + {ALPHA / R:g} x B@A" in fail.detail


def test_a_stale_shard(tmp_path: Path) -> None:
    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    with DcpCheckpoint(tuned) as reader:
        [source] = reader.sources("head.weight")
    shutil.copy(base / source.file, tuned / source.file)  # the shard left from the base
    [fail] = certify(base, tuned, spec=SPEC).failures
    assert (fail.key, fail.claim, fail.finding) == ("head.weight", "trainable", "did not move")
    assert f"stored in ['{source.file}']" in fail.detail


def test_a_drifted_buffer(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["trunk.1.running_mean"][2] += 0.01  # BatchNorm statistics of the frozen trunk
    [fail] = certify(*pair(tmp_path, "torch", tuned), spec=SPEC).failures
    assert (fail.key, fail.claim, fail.finding) == ("trunk.1.running_mean", "held", "changed")
    assert "rows [2]" in fail.detail
