"""Claims are checked against what the recorder measured and fail when a run breaks them; the
report sections draw the recorded series; the recorder takes its trace off when a run fails."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import experiments.cli
import experiments.formats
import experiments.model
import experiments.simsiam
from experiments.claims import evaluate_checks
from experiments.model import Branch, IsolationNet
from tests.experiments._shared import (
    BEFORE_THE_LAST_LAYER,
    VARIANTS,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::experiments.data.TestSplitOnlyWarning"),
    # Lightning 2.6's CLI calls jsonargparse APIs that jsonargparse 4.49 deprecates.
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]


def _not_contracts(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The checks other than the contracts' (their verdicts are tested with the contracts)."""
    return [c for c in checks if not c["check"].startswith("contract ")]


def _fake_results(**runs: dict[str, Any]) -> dict[str, Any]:
    """Results with declarations taken from the real configs, and the given records."""
    by_name = {v.name: v for v in VARIANTS}
    return {
        "runs": runs,
        "variants": {name: by_name[name].declaration() for name in runs},
        "trunk_vs_reference": {},
    }


def test_claims_fail_when_the_run_breaks_them() -> None:
    steps = 3
    good = {"status": "ok", "steps": steps, "grad_delta": [0.0] * steps}
    base = {"status": "ok", "steps": steps, "audit": {"main": {"trunk": [8, 8]}}}
    results = _fake_results(baseline=base, detached=dict(good))
    results["trunk_vs_reference"] = {"detached": {"bitwise_equal": True, "max_delta": 0.0}}
    results["runs"]["detached"]["audit"] = {
        "probe": {"trunk": [0, 8]},
        "ink_probe": {"trunk": [0, 8]},
    }
    results["runs"]["detached"]["test"] = {"acc/probe": 0.5}
    results["runs"]["detached"]["chance"] = {"acc/probe": 0.11}
    results["runs"]["detached"]["cut_off"] = {"trainable": 14, "parameters": {}}
    held = {"clauses": {"only the probe": {"checked": 3, "violated": 0, "first": None}}}
    results["runs"]["detached"]["contracts"] = {"probe": held, "ink_probe": held}
    assert [c["ok"] for c in evaluate_checks(results)] == [True] * 9
    # One step off by the smallest amount, one parameter reached, a probe at chance, one
    # parameter cut off.
    results["runs"]["detached"]["grad_delta"] = [0.0, 1e-30, 0.0]
    results["runs"]["detached"]["audit"]["probe"]["trunk"] = [1, 8]
    results["runs"]["detached"]["test"] = {"acc/probe": 0.11}
    results["runs"]["detached"]["cut_off"]["parameters"] = {"head.2.bias": "why"}
    checks = evaluate_checks(results)
    assert [c["ok"] for c in checks] == [True, False, True, False, False, True, False, True, True]
    assert checks[6]["observed"] == "head.2.bias"
    assert checks[1]["observed"] == "2/3 steps exactly 0.0, max|Δ| = 1e-30"
    # A run that should finish and crashed: one failed check instead of its claims.
    results["runs"]["detached"] = {"status": "error", "error": {"type": "crash", "message": "x"}}
    assert [(c["check"], c["ok"]) for c in evaluate_checks(results)[1:]] == [
        ("the run finishes", False)
    ]
    results["variants"]["detached"]["claims"] = [{"check": "teleports"}]
    results["runs"]["detached"] = dict(good)
    with pytest.raises(ValueError, match=r"^detached: unknown claim 'teleports'"):
        evaluate_checks(results)


def test_the_recorder_takes_its_trace_off_when_the_first_step_fails(tmp_path: Path) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from experiments.recording import Recorder

    class FailsAfterTheTrunk(IsolationNet):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.trunk(batch[0])  # traced
            raise RuntimeError("the step failed")

    model = FailsAfterTheTrunk()
    data = TensorDataset(torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)))
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        callbacks=[Recorder(output=str(tmp_path / "run"), verbose=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    with pytest.raises(RuntimeError, match=r"^the step failed$"):
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=4))
    assert [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks] == []
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "error" and "cut_off" not in record


def test_cut_off_claims_name_exactly_the_parameters() -> None:
    why = {name: "no path" for name in BEFORE_THE_LAST_LAYER}
    early = {
        "status": "ok",
        "cut_off": {"trainable": 14, "parameters": why, "changed": []},
        "test": {"acc/main": 0.85},
        "chance": {"acc/main": 0.116},
    }
    results = _fake_results(detached_early=early)
    checks = _not_contracts(evaluate_checks(results))
    assert [(c["check"], c["ok"]) for c in checks] == [
        ("exactly these parameters are cut off from the loss at step 0 (graph audit)", True),
        ("the cut-off parameters keep their step-0 values to the end", True),
        ("the main head learns", True),
    ]
    assert checks[0]["observed"] == checks[0]["expected"] == ", ".join(BEFORE_THE_LAST_LAYER)
    assert checks[1]["observed"] == "6 of 6 bitwise unchanged"
    # One too few, one too many, one that moved: each fails.
    for parameters, changed in (
        (BEFORE_THE_LAST_LAYER[:-1], []),
        ([*BEFORE_THE_LAST_LAYER, "trunk.9.module.bias"], []),
        (BEFORE_THE_LAST_LAYER, ["trunk.1.bias"]),
    ):
        early["cut_off"] = {
            "trainable": 14,
            "parameters": dict.fromkeys(parameters, "no path"),
            "changed": changed,
        }
        ok = [c["ok"] for c in _not_contracts(evaluate_checks(results))][:2]
        assert ok == ([True, False] if changed else [False, True]), parameters
    assert evaluate_checks(results)[1]["observed"] == (
        "5 of 6 bitwise unchanged; changed: trunk.1.bias"
    )
    del early["cut_off"]  # not audited: no claim passes by default
    assert [c["observed"] for c in evaluate_checks(results)][:2] == ["not audited", "n/a"]
    assert [c["ok"] for c in evaluate_checks(results)][:2] == [False, False]
    results["variants"]["detached_early"]["claims"] = [{"check": "cut_off", "expect": "all"}]
    with pytest.raises(ValueError, match=r"^cut_off: expect='all' must be 'none' or a list"):
        evaluate_checks(results)


def test_the_cut_off_and_gradient_sections_draw_what_the_recorder_measured(
    tmp_path: Path,
) -> None:
    import isolate
    from experiments.recording import _figure_groups, _groups
    from experiments.sections import gradient_report_of, render_declared

    records = {}
    for name, early in (("detached", 0), ("detached_early", 1)):
        torch.manual_seed(0)
        net = IsolationNet(branches=[Branch(name="probe", detach_early=early)])
        outputs, labels = net._outputs(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))
        losses = {k: torch.nn.functional.cross_entropy(v, labels) for k, v in outputs.items()}
        total = losses["main"] + losses["probe"]
        cut = isolate.cutoff.cut_off_parameters(total, net)
        report = isolate.gradient_report(
            losses, net, groups=_figure_groups(net, "trunk", _groups(net))
        )
        data = json.loads(json.dumps(experiments.formats.jsonable(report.to_dict())))
        assert str(gradient_report_of(data)) == str(report)  # the round trip through run.json
        records[name] = {
            "status": "ok",
            "test": {"acc/main": 0.5},
            "cut_off": {
                "trainable": cut.trainable,
                "parameters": dict(cut.parameters),
                "changed": [],
            },
            "gradients": data,
        }
    lines = render_declared(_fake_results(**records), tmp_path)
    text = "\n".join(lines)
    for name in records:
        png = tmp_path / f"gradient_shares_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in text
    assert "| detached | 12 | none |  | 0.500 |" in text
    assert f"| detached_early | 12 | {', '.join(BEFORE_THE_LAST_LAYER)} | 6 of 6 | 0.500 |" in text
    # Without a trace, one reason for all six: one row.
    assert f"| detached_early | {', '.join(BEFORE_THE_LAST_LAYER)} | no path from any loss" in text
    assert "| detached | probe | no path | 0 of 5 | branches.probe |" in text
    assert re.search(r"\| detached_early \| main \| 9\d\.\d% \| 1 of 5 \| trunk\.9, head \|", text)


def test_frozen_and_collapse_claims_read_the_declared_series() -> None:
    zeros = {"parameters": [0.0, 0.0], "buffers": [0.0, 0.0], "counters": [0.0, 0.0]}
    moved = {"parameters": [0.0, 0.0], "buffers": [0.0, 0.5], "counters": [1.0, 2.0]}
    frozen = {
        "status": "ok",
        "drift": zeros,
        "test": {"acc/main": 0.6},
        "chance": {"acc/main": 0.1},
    }
    naive = {"status": "ok", "drift": moved}
    siam = {"status": "ok", "train": {"z_std": [0.1, 0.11], "z_std_ref": [0.125, 0.125]}}
    collapsed = {"status": "ok", "train": {"z_std": [0.1, 0.02], "z_std_ref": [0.125, 0.125]}}
    results = _fake_results(
        frozen_trunk=frozen, frozen_trunk_naive=naive, simsiam=siam, simsiam_no_stopgrad=collapsed
    )
    assert all(c["ok"] for c in _not_contracts(evaluate_checks(results)))
    frozen["drift"] = {**zeros, "counters": [0.0, 1.0]}  # the counter moved once
    collapsed["train"]["z_std"] = [0.1, 0.06]  # more than half of simsiam's 0.11
    checks = _not_contracts(evaluate_checks(results))
    failed = [(c["variant"], c["check"]) for c in checks if not c["ok"]]
    assert failed == [
        ("frozen_trunk", "BatchNorm running statistics and num_batches_tracked never move"),
        ("simsiam_no_stopgrad", "the output collapses: its spread falls far below simsiam's"),
    ]


def test_thaw_and_rank_claims_fail_when_the_run_breaks_them() -> None:
    steps = 5
    record: dict[str, Any] = {
        "status": "ok",
        "drift": {"parameters": [0.0] * steps, "buffers": [0.0] * steps, "counters": [0.0] * steps},
        "drift_layers": {
            "0": [0.0] * steps,
            "1": [0.0] * steps,
            "9": [0.0, 0.0, 0.1, 0.2, 0.3],
        },
        "thaw": {
            "step": 2,
            "world_size": 2,
            "parameters": 10,
            "checked_steps": [2, 3, 4],
            "differing": [0, 0, 0],
        },
        "test": {"acc/main": 0.6},
        "chance": {"acc/main": 0.1},
    }
    results = _fake_results(frozen_trunk_thaw=record)
    checks = evaluate_checks(results)
    assert all(c["ok"] for c in checks) and len(checks) == 5
    ranks = checks[3]
    assert ranks["observed"] == (
        "3/3 steps with all 10 parameters bitwise equal on 2 processes; most differing: 0"
    )
    record["drift_layers"]["9"] = [0.0, 0.1, 0.1, 0.2, 0.3]  # moved before its thaw
    record["drift_layers"]["1"] = [0.0, 0.0, 0.0, 0.0, 1e-9]  # a frozen layer moved
    record["thaw"]["differing"] = [0, 1, 0]  # one parameter differed on a process at step 3
    failed = [c["check"] for c in evaluate_checks(results) if not c["ok"]]
    assert failed == [
        "trunk.9 is still before its thaw and moves from then on",
        "the rest of the trunk (2 layers) never moves",
        "every process holds the same full parameters after the thaw",
    ]
    # One process: trivially identical, and said so; no step after a thaw is no pass.
    record["thaw"] = {**record["thaw"], "world_size": 1, "differing": [0, 0, 0]}
    (ranks,) = [c for c in evaluate_checks(results) if c["check"].startswith("every process")]
    assert (
        ranks["ok"]
        and ranks["observed"] == "1 process: trivially identical (3 steps after the thaw)"
    )
    record["drift_layers"] = {**record["drift_layers"], "1": [0.0] * steps, "9": [0.0] * steps}
    record["thaw"] = {**record["thaw"], "step": None, "checked_steps": [], "differing": []}
    failed = [c["check"] for c in evaluate_checks(results) if not c["ok"]]
    assert failed == [
        "trunk.9 is still before its thaw and moves from then on",
        "every process holds the same full parameters after the thaw",
    ]


def _verdict(kind: str, clauses: list[str], broken: tuple[str, ...] = ()) -> dict[str, Any]:
    """A contract's verdict as the Recorder keeps it: each clause checked once."""
    return {
        "kind": kind,
        "clauses": {
            c: {"checked": 1, "violated": int(c in broken), "first": "x" if c in broken else None}
            for c in clauses
        },
    }


TEACHER = ["no loss reaches it", "in no optimizer", "in eval mode", "bitwise still"]


def test_contract_claims_need_the_verdict_and_the_report_lists_it() -> None:
    from experiments.report import _contracts

    results = _fake_results(frozen_trunk={"status": "ok", "drift": {}})
    observed = {c["check"]: c for c in evaluate_checks(results)}
    claim = observed["contract teacher:trunk holds"]
    assert claim["observed"] == "not declared" and not claim["ok"]
    unchecked = _verdict("teacher", TEACHER)
    unchecked["clauses"]["bitwise still"]["checked"] = 0
    results["runs"]["frozen_trunk"]["contracts"] = {"teacher:trunk": unchecked}
    claim = {c["check"]: c for c in evaluate_checks(results)}["contract teacher:trunk holds"]
    assert not claim["ok"] and claim["observed"].endswith("(never checked: bitwise still)")
    results["variants"]["frozen_trunk"]["claims"] = [
        {"check": "contract", "contract": "teacher:trunk", "holds": False}
    ]
    with pytest.raises(ValueError, match=r"holds=false needs the clause that must break"):
        evaluate_checks(results)
    broken = _verdict("teacher", TEACHER, ("in eval mode",))
    broken["clauses"]["in eval mode"]["first"] = (
        "IsolationCallback: at step 0, contract 'teacher:trunk' (teacher) breaks its clause "
        "'in eval mode': ['trunk.1'] run in train mode"
    )
    results["runs"]["frozen_trunk"]["contracts"] = {"teacher:trunk": broken}
    lines = _contracts(results)
    assert lines[0] == "## Contracts"
    assert (
        "| frozen_trunk | teacher:trunk | teacher | 4 | broken: 'in eval mode' | "
        "'in eval mode': ['trunk.1'] run in train mode |" in "\n".join(lines)
    )
