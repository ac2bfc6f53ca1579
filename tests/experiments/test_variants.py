"""Variants declare themselves: each config says its role, claims and report, an unknown field
is refused, the suite and report code name no variant, and a new variant is one config file."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from experiments.suite import run_suite
from experiments.variants import discover, load
from tests._launch import REPO
from tests.experiments._shared import (
    FIVE_STEPS,
    SHARED_DATA,
    VARIANTS,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::experiments.data.TestSplitOnlyWarning"),
    # Lightning 2.6's CLI calls jsonargparse APIs that jsonargparse 4.49 deprecates.
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]


def test_each_config_declares_its_role_claims_and_report() -> None:
    names = [v.name for v in VARIANTS]
    assert names[0] == "baseline"  # the run others are compared with goes first
    assert sorted(names) == sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    for variant in VARIANTS:
        assert variant.role and variant.claims, variant.name
    guarded = {v.name: v for v in VARIANTS}["inplace_guarded"]
    assert guarded.expect_error == "InplaceModificationError"
    assert {v.name for v in VARIANTS if v.compare_with == "baseline"} >= {"detached", "attached"}


def test_a_declaration_with_an_unknown_field_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("# bad\nvariant:\n  role: x\n  claim: []\n")
    with pytest.raises(ValueError, match=r"^bad.yaml: 'variant:' has unknown fields \['claim'\]"):
        load(bad)
    bad.write_text("# bad\nmodel: {}\n")
    with pytest.raises(ValueError, match=r"^bad.yaml: no 'variant:' block"):
        load(bad)


def test_no_variant_name_in_the_suite_or_report_code() -> None:
    code = "".join(
        (REPO / "experiments" / f"{m}.py").read_text()
        for m in ("suite", "report", "claims", "sections", "variants")
    )
    for variant in VARIANTS:
        assert not re.search(rf"[\"']{variant.name}[\"']", code), variant.name
    assert 'startswith("frozen")' not in code and 'SimSiam"' not in code


def test_a_new_variant_is_one_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(REPO / "configs" / "baseline.yaml", configs)
    (configs / "two_probes.yaml").write_text(
        "# Two detached probes on the digit.\n"
        "model:\n  class_path: experiments.model.IsolationNet\n  init_args:\n    branches:\n"
        "      - {name: first, connect: detached}\n      - {name: second, connect: detached}\n"
        "variant:\n  role: two detached probes\n  compare_with: baseline\n  claims:\n"
        "    - {check: gradient_equal}\n    - {check: reaches, loss: second, expect: none}\n"
    )
    monkeypatch.chdir(REPO)
    results = run_suite(
        tmp_path / "suite",
        quick=True,
        only=["two_probes"],
        variants=discover(configs),
        data_root=str(SHARED_DATA),
        cache_dir=str(tmp_path / "cache"),
        overrides=FIVE_STEPS,
    )
    assert list(results["runs"]) == ["baseline", "two_probes"]
    checks = [(c["variant"], c["check"], c["ok"]) for c in results["checks"]]
    assert checks == [
        ("baseline", "the main loss reaches every trunk parameter (graph audit)", True),
        ("two_probes", "trunk gradient equals the compared run's at every step", True),
        (
            "two_probes",
            "final trunk weights and BatchNorm statistics equal the compared run's",
            True,
        ),
        ("two_probes", "the second loss reaches no trunk parameter (graph audit)", True),
    ]
    assert (
        "| two_probes | two detached probes | ok | 5 |"
        in (tmp_path / "suite" / "report.md").read_text()
    )
