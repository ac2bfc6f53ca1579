"""The benchmark script runs and writes its numbers (timings are never asserted on): every
row is well formed, and its verdict is its own stated limit applied to its own number."""

from __future__ import annotations

import doctest
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from experiments.bench import imports
from experiments.bench.__main__ import main
from experiments.bench.certify import CertifyConfig
from experiments.bench.networks import transformer
from experiments.bench.scale import ScaleConfig, callback_verification
from experiments.bench.sharded import ShardedConfig
from isolate.errors import DriftError
from tests._launch import REPO, launch

COLUMNS = {
    "name",
    "candidate",
    "baseline",
    "candidate_s",
    "baseline_s",
    "target",
    "ok",
    "extra",
    "paired_ratio",
    "limit",
    "metric_name",
    "unit",
    "ratio",
    "metric",
}


def check_rows(out: Path) -> list[dict[str, Any]]:
    payload = json.loads((out / "bench.json").read_text())
    rows: list[dict[str, Any]] = payload["rows"]
    assert rows
    for row in rows:
        assert set(row) == COLUMNS, row["name"]
        assert row["unit"] in ("s", "bytes")
        for key in ("candidate_s", "baseline_s", "ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["name"], key)
        assert math.isfinite(row["metric"])
        if row["metric_name"] == "ratio":
            assert row["metric"] == row["ratio"]
        else:
            assert row["metric"] == row["extra"][row["metric_name"]]
        if row["limit"] is None:  # measured only: no verdict, and the table says so
            assert row["ok"] is None and not row["target"].startswith("<=")
        else:  # the verdict is the stated limit applied to the number written beside it
            assert row["ok"] is (row["metric"] <= row["limit"]), row["name"]
            assert f"{row['limit']:g}".rstrip("0") in row["target"] or row["limit"] == 1 / 0.97
    table = (out / "bench.md").read_text().splitlines()
    lines = [line for line in table if line.startswith("| ")][2:]  # after header, separator
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert cells[0] == row["name"]
        assert cells[-1] == {None: "-", True: "yes", False: "NO"}[row["ok"]]
        assert float(cells[5]) == float(f"{row['ratio']:.4g}")
        unit = " MB" if row["unit"] == "bytes" else " ms"
        assert cells[3].endswith(unit) and cells[4].endswith(unit)
    return rows


def test_quick_benchmark_writes_json_and_markdown(tmp_path: Path) -> None:
    assert main(["--quick", "--only", "freeze", "report", "--output", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["env"]["quick"] is True and payload["env"]["torch"]
    rows = check_rows(tmp_path)
    names = [row["name"] for row in rows]
    assert any(name.startswith("freeze+restore") for name in names)
    assert any(name.startswith("gradient_report") for name in names)
    assert all(isinstance(row["ok"], bool) for row in rows)


TINY = {"layers": 2, "width": 64, "heads": 4, "batch": 2, "tokens": 8, "report_layers": 2}
TINY_SHARDED = {
    "layers": 2,
    "width": 64,
    "heads": 4,
    "batch": 2,
    "tokens": 8,
    "warmup": 1,
    "repeat": 2,
}


def test_scale_section_in_a_tiny_configuration(tmp_path: Path) -> None:
    sizes = [f"--scale-{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    argv = ["--only", "scale", "--output", str(tmp_path), "--scale-repeat=2", *sizes]
    assert main(argv) == 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["env"]["scale"] == vars(ScaleConfig(**TINY, repeat=2))
    rows = {row["name"].split(",")[0]: row for row in check_rows(tmp_path)}
    assert list(rows) == [
        "fingerprint snapshot",
        "fingerprint check",
        "fingerprint snapshot extra resident memory",
        "callback verification vs training step",
        "reachable_parameters vs one backward",
        "gradient_report peak extra memory",
        "Detached per-call overhead",
        "Cloned per-call overhead",
        "GradientScale(-1) per-call overhead",
        "apply + restore of a resolved selection",
        "thaw + restore of a resolved selection",
        "resolving 2 glob selectors from scratch",
    ]
    check = rows["fingerprint check"]["extra"]
    assert check["device scheme on this CPU / one read"] > 0
    memory = rows["fingerprint snapshot extra resident memory"]
    assert memory["unit"] == "bytes" and memory["metric_name"] == "extra MB"
    assert memory["baseline_s"] == sum(
        p.numel() * p.element_size() for p in transformer(2, 64, 4).parameters()
    )
    assert memory["extra"]["snapshot(drift='copy') extra MB"] >= 0
    callback = rows["callback verification vs training step"]
    assert callback["name"].endswith("checks every 50 steps (amortised)")
    assert callback["extra"]["check / one step"] > 0
    assert rows["gradient_report peak extra memory"]["ok"] is None


def test_contracts_section_in_a_tiny_configuration(tmp_path: Path) -> None:
    sizes = ["--contracts-layers=1", "--contracts-width=16", "--contracts-repeats=1"]
    assert main(["--only", "contracts", "--output", str(tmp_path), *sizes]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    names = [n for n in rows if n.startswith(("contracts/", "ledger/"))]
    assert names == [
        "contracts/IsolationNet probes",
        "contracts/IsolationNet frozen teacher",
        "contracts/IsolationNet reversal",
        "contracts/SimSiam",
        "contracts/BYOL 2x1x16",
        "ledger/BYOL 2x1x16",
    ]
    teacher = rows["contracts/IsolationNet frozen teacher"]
    assert teacher["extra"]["contracts"] == ["teacher"] and teacher["limit"] == 0.02
    assert teacher["ok"] == (teacher["metric"] <= 0.02) and teacher["baseline_s"] > 0
    ledger = rows["ledger/BYOL 2x1x16"]
    assert ledger["extra"]["tensors"] > 0 and ledger["limit"] == 1.0


def test_the_verification_hook_sees_a_frozen_tensor_move() -> None:
    defaults = ScaleConfig()
    assert (defaults.layers, defaults.width) == (24, 1024)  # the 302M-parameter default
    model = transformer(2, 32, 4)
    verify = callback_verification(model, ["layers.0.linear1.weight"])
    loss = model(torch.randn(1, 3, 32)).square().mean()
    verify(loss)  # unchanged: passes
    with torch.no_grad():
        model.layers[0].linear1.weight[0, 0] += 1
    try:
        verify(loss)
    except DriftError as error:
        assert "layers.0.linear1.weight" in str(error)
    else:
        raise AssertionError("the verification hook did not see the frozen weight move")


@pytest.mark.slow
def test_sharded_section_in_a_tiny_configuration(tmp_path: Path) -> None:
    """2 processes under fully_shard (it launches them): the verification runs every check,
    the ranks collective on both ranks, and catches a frozen shard that moved on one rank."""
    sizes = [f"--sharded-{k.replace('_', '-')}={v}" for k, v in TINY_SHARDED.items()]
    assert main(["--only", "sharded", "--output", str(tmp_path), *sizes]) == 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["env"]["sharded"] == vars(ShardedConfig(**TINY_SHARDED))
    rows = {row["name"].split(",")[0]: row for row in check_rows(tmp_path)}
    assert list(rows) == [
        "FSDP2 verification vs one training step",
        "FSDP2 verification vs training step",
    ]
    per_check, amortised = rows.values()
    assert "(2x64), fully_shard on 2 gloo processes" in per_check["name"]
    assert amortised["name"].endswith("checks every 50 steps (amortised)")
    assert per_check["ok"] is None and amortised["limit"] == 0.01
    ratio = per_check["extra"]["check / one step"]
    assert math.isfinite(ratio) and ratio > 0 and ratio == per_check["ratio"]
    assert math.isclose(amortised["ratio"], ratio / 50)
    assert 0 < per_check["extra"]["rank 1 check / one step"] < math.inf
    verification = per_check["extra"]["verification (rank 0)"]
    frozen = per_check["extra"]["frozen tensors"]
    assert frozen == 12  # layers.0 of 2: every tensor of one encoder layer
    # Every check ran, on the sharded parameters, and the ranks were compared.
    assert verification == {
        "params": frozen,  # none replaced since the spec was applied
        "losses": {"loss": frozen},
        "reach": frozen,  # the trainable half: as many tensors as the frozen half
        "drift": frozen,
        "flags": frozen,
        "optimizers": 1,
        "ranks": 2,
        "contracts": {},
        "violations": [],
    }
    # The ranks check's own collective ran on both ranks, once per verify.
    assert per_check["extra"]["all_gather_object calls per verify, by rank"] == [1, 1]
    # One element of a frozen shard moved on rank 1: its owner's drift check saw it, and the
    # ranks check handed the verdict to rank 0 as well (a shard has one owner under FSDP, so
    # there is no copy to compare; rank 0 would otherwise go on alone into a collective).
    raised = per_check["extra"]["layers.0.linear1.weight moved on rank 1, raised by rank"]
    assert raised[0].startswith("DriftError: IsolationSpec: on rank 1 of 2: frozen tensors moved")
    assert raised[1].startswith("DriftError: ") and "'layers.0.linear1.weight'" in raised[1]


def test_each_package_is_credited_to_the_innermost_isolate_module_that_imported_it() -> None:
    result = doctest.testmod(imports)
    assert result.failed == 0 and result.attempted > 0
    log = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:   4 |   4 | numpy",  # before isolate: not its doing
            "import time:   3 |   3 |         torch._dynamo.utils",
            "import time:   6 |   9 |       torch._dynamo",
            "import time:   2 |  11 |     torch.compiler",
            "import time:   1 |  12 |   isolate.freezing",
            "import time:   5 |   5 |       sympy.core",
            "import time:   1 |   6 |     isolate.drift",
            "import time:   1 |   7 |   isolate.spec",
            "import time:   1 |  20 | isolate",
        ]
    )
    packages = ["sympy", "torch._dynamo", "numpy", "torch.compiler"]
    assert imports.first_importers(log, packages) == {
        "sympy": "isolate.drift",
        "torch._dynamo": "isolate.freezing",
        "torch.compiler": "isolate.freezing",
    }


@pytest.mark.slow
def test_import_section_times_fresh_interpreters_and_names_what_isolate_loads(
    tmp_path: Path,
) -> None:
    assert main(["--quick", "--only", "imports", "--output", str(tmp_path)]) == 0
    (row,) = check_rows(tmp_path)
    assert row["name"] == "import isolate vs import torch, each in a fresh interpreter"
    assert (row["candidate"], row["baseline"], row["limit"]) == (
        "import isolate",
        "import torch",
        1.2,
    )
    extra = row["extra"]
    # What a fresh interpreter says itself, against what the row reports.
    probe = "import sys, isolate; print('torch._dynamo' in sys.modules)"
    done = launch([sys.executable, "-c", probe], cwd=REPO)
    assert extra["torch._dynamo loaded"] is (done.stdout.strip() == "True")
    counts = extra["packages loaded beyond import torch (modules)"]
    assert sum(counts.values()) <= extra["modules loaded beyond import torch"]
    credited = extra["first imported under"]
    assert set(credited) <= set(counts)
    assert all(module.split(".")[0] == "isolate" for module in credited.values())


TINY_PEFT = {
    "hidden": 32,
    "intermediate": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 128,
    "tokens": 8,
    "steps": 2,
    "repeat": 2,
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_peft_section_in_a_tiny_configuration(tmp_path: Path) -> None:
    """A tiny Llama with LoRA behind reentrant checkpointing: every row is written, and each
    check really ran on the model (counts, a real walk, a moved base weight caught)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from experiments.bench.peft_llama import PeftConfig

    sizes = [f"--peft-{k.replace('_', '-')}={v}" for k, v in TINY_PEFT.items()]
    assert main(["--only", "peft", "--output", str(tmp_path), *sizes]) == 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["env"]["peft"] == vars(PeftConfig(**TINY_PEFT))
    rows = {row["name"].split(",")[0]: row for row in check_rows(tmp_path)}
    assert list(rows) == [
        "drift check of the frozen base vs one read",
        "drift check extra memory",
        "peers: deepcopy before + compare after vs one read",
        "peers: deepcopy extra resident memory",
        "reachable_parameters through checkpointed segments vs one forward",
        "cut_off_parameters through checkpointed segments vs one forward",
        "verification every 50 steps vs training",
    ]
    frozen, adapters = 21, 8  # 2 layers: 9 tensors each, embeddings, norm, head; q, v: A, B
    drift = rows["drift check of the frozen base vs one read"]
    assert (drift["limit"], drift["candidate"]) == (1.2, "verify(checks=('drift',))")
    assert drift["extra"]["frozen tensors"] == frozen
    assert drift["extra"]["trainable tensors"] == adapters
    assert drift["extra"]["frozen tensors checked per drift check"] == frozen
    moved = drift["extra"]["a base weight moved, the drift check raised"]
    name = moved.split(":")[0]
    assert name.startswith("base_model.model.model.layers.") and "lora" not in name
    assert f"frozen tensors moved (at epoch 0, step 1): ['{name}']" in moved
    memory = rows["drift check extra memory"]
    assert memory["unit"] == "bytes" and memory["metric_name"] == "extra MB"
    parts = memory["extra"]
    assert (
        parts["extra MB"]
        == parts["watch kept (tracemalloc) MB"] + parts["check peak resident growth MB"]
    )
    assert parts["watch kept (tracemalloc) MB"] > 0
    peers = rows["peers: deepcopy before + compare after vs one read"]["extra"]
    assert peers["unchanged"] is True and peers["compared tensors"] == frozen
    assert rows["peers: deepcopy extra resident memory"]["ok"] is None
    reach = rows["reachable_parameters through checkpointed segments vs one forward"]
    assert reach["extra"] == {
        "reached": adapters,
        "trainable": adapters,
        "reached == trainable": True,
    }
    cut = rows["cut_off_parameters through checkpointed segments vs one forward"]
    assert cut["extra"] == {"cut off": 0, "checked": adapters} and cut["limit"] == 1.0
    verify = rows["verification every 50 steps vs training"]
    assert verify["name"].endswith("(amortised)") and verify["limit"] == 0.01
    assert math.isclose(verify["ratio"], verify["extra"]["verify / one step"] / 50)
    assert len(verify["extra"]["step seconds"]) == len(verify["extra"]["verify seconds"]) == 1
    assert verify["extra"]["verification"] == {
        "params": frozen,
        "losses": {"loss": frozen},
        "reach": adapters,
        "drift": frozen,
        "flags": frozen,
        "optimizers": 1,
        "ranks": 1,
        "contracts": {},
        "violations": [],
    }
    assert verify["extra"]["handle.check_every(50) check step"] == "passed"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_seethrough_section_runs_every_walk_it_times(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    assert main(["--quick", "--only", "seethrough", "--output", str(tmp_path)]) == 0
    rows = check_rows(tmp_path)
    assert [(row["name"].split(" (")[0], row["baseline"]) for row in rows] == [
        ("walk", "one backward"),
        ("walk", "one forward"),
        ("gradients", "one backward"),
        ("walk peak resident growth", "activations a forward without checkpointing saves"),
        ("walk", "one backward"),
        ("walk", "one forward"),
        ("gradients", "one backward"),
        ("walk", "one backward"),
        ("walk", "one backward"),
    ]
    assert all(row["ok"] is None for row in rows)  # measured, no targets
    memory = rows[3]
    assert memory["unit"] == "bytes"
    assert (
        memory["extra"]["forward without checkpointing saved MB"]
        > memory["extra"]["checkpointed forward saved MB"]
    )


TINY_CERTIFY = {"params": 2_000_000, "tensor_mb": 1, "trainable": 2, "repeat": 2}


@pytest.mark.slow
def test_certify_section_in_a_tiny_configuration(tmp_path: Path) -> None:
    """A fresh process times certify against one read of both files of a generated pair and
    measures its memory; five planted corruptions are each caught, their pairs clean as saved."""
    sizes = [f"--certify-{k.replace('_', '-')}={v}" for k, v in TINY_CERTIFY.items()]
    assert main(["--only", "certify", "--output", str(tmp_path), *sizes]) == 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["env"]["certify"] == vars(CertifyConfig(**TINY_CERTIFY))
    warm, bare, floor, cold, memory, planted = check_rows(tmp_path)
    label = "2.1M bf16 parameters, 0.00419 GB per file"
    assert warm["name"] == f"certify vs one sequential read of both files, {label}, page cache warm"
    assert cold["name"] == f"certify vs one sequential read of both files, {label}, page cache cold"
    assert bare["name"].startswith("certify without the files' hashes vs one sequential read")
    assert floor["name"].startswith("the floor (two threads, every byte read once and XXH3-hashed")
    assert floor["ok"] is None and floor["extra"]["certify over the floor (paired)"] > 0
    assert memory["name"].startswith("certify peak resident memory over its start")
    assert planted["name"].startswith("planted corruptions missed, of 5")
    assert warm["limit"] == cold["limit"] == 1.2 and warm["extra"]["large pair clean"] is True
    assert warm["extra"]["tensors per file"] == 4  # 1 MiB tensors: 2.1M parameters
    assert warm["extra"]["cpu ratio (all threads)"] > 0
    cached = "fraction of the pair in the page cache, before and after the timings"
    assert all(f > 0.9 for f in warm["extra"][cached])  # 8 MB read just before: cached
    assert cold["extra"]["fraction of the pair in the page cache after a drop"] < 0.5
    assert memory["unit"] == "bytes" and memory["metric_name"] == "peak MB"
    assert memory["limit"] == 100.0 and 4 * 2**20 < memory["baseline_s"] < 4 * 2**20 + 4096
    assert planted["extra"]["missed"] == 0 and planted["ok"] is True
    assert planted["extra"]["caught"] == "5 of 5"
    found = {
        c["name"]: (c["clean_pair_clean"], c["failures"]) for c in planted["extra"]["corruptions"]
    }
    assert found == {
        "base row changed": (True, [["trunk.0.weight", "changed"]]),
        "tie broken": (True, [["embed.weight = out.weight", "tie broken"]]),
        "drifted buffer": (True, [["trunk.1.running_mean", "changed"]]),
        "stale shard": (True, [["head.weight", "did not move"]]),
        "merge scale off by alpha/r": (True, [["q.weight", "merge off"]]),
    }
