"""Default schedules: one phase per top-level block, from the head back, written as YAML by
``isolate schedule`` (also run as ``python -m isolate``) that applies as a spec."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import yaml
from torch import nn

from isolate import IsolationSpec
from isolate.cli import main
from isolate.errors import SpecError
from isolate.interop.schedules import default_schedule, load_model, to_yaml
from tests._launch import REPO, launch
from tests.interop._schedule_models import Tower


def test_default_schedule_thaws_one_block_per_phase_from_the_head_back() -> None:
    schedule = default_schedule(Tower(), patience=2)
    assert schedule["freeze"] == ["model.stem", "model.stage0", "model.stage1", "model.stage2"]
    assert [t["select"] for t in schedule["thaw"]] == [
        "model.stage2",
        "model.stage1",
        "model.stage0",
        "model.stem",
    ]
    assert all(t["monitor"] == "val_loss" and t["patience"] == 2 for t in schedule["thaw"])
    with pytest.raises(SpecError, match=r"has 0 top-level block"):
        default_schedule(nn.Sequential(nn.Linear(2, 2)))


def test_schedule_command_writes_yaml_that_applies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "tests.interop._schedule_models:build_tower", "--by-epoch"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "# Default isolate schedule for tests.interop._schedule_models:build_tower (Tower)"
    )
    spec = IsolationSpec.from_dict(yaml.safe_load(out))
    model = Tower()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.warns(UserWarning, match="frozen parameters out"),
        spec.applied(model, opt) as handle,
    ):
        assert [n for n, p in model.named_parameters() if p.requires_grad] == [
            "model.head.weight",
            "model.head.bias",
        ]
        for epoch in range(1, 5):
            handle.step(epoch=epoch, step=0)
        assert all(p.requires_grad for p in model.parameters())
        assert handle.thawed == ("model.stage2", "model.stage1", "model.stage0", "model.stem")


@pytest.mark.slow
def test_schedule_command_runs_as_a_module() -> None:
    out = launch(
        [sys.executable, "-m", "isolate", "schedule", "tests.interop._schedule_models:build_tower"],
        cwd=REPO,
    ).stdout
    thaw = yaml.safe_load(out)["thaw"]
    assert thaw[0] == {"select": "model.stage2", "monitor": "val_loss", "patience": 3}


def test_to_yaml_writes_flags_as_yaml_booleans() -> None:
    text = to_yaml({"thaw": [{"select": "a", "align": True, "x": False}]})
    assert text == "thaw:\n  - {select: a, align: true, x: false}\n"
    assert yaml.safe_load(text) == {"thaw": [{"select": "a", "align": True, "x": False}]}


def test_to_yaml_writes_numbers_that_yaml_reads_back_as_floats() -> None:
    step = {"select": "a", "lr": 1e-05, "min_delta": float("nan"), "hi": float("inf")}
    text = to_yaml({"thaw": [{**step, "lo": float("-inf")}]})
    assert text == "thaw:\n  - {select: a, lr: 1.0e-05, min_delta: .nan, hi: .inf, lo: -.inf}\n"
    (read,) = yaml.safe_load(text)["thaw"]
    assert math.isnan(read.pop("min_delta"))
    assert read == {"select": "a", "lr": 1e-05, "hi": float("inf"), "lo": float("-inf")}


def test_a_misspelt_module_of_a_package_gets_a_close_match_among_its_modules() -> None:
    with pytest.raises(SpecError) as raised:
        load_model("isolate.interop.schedulez:f")
    assert str(raised.value) == (
        "isolate.interop.schedulez:f: no module named 'isolate.interop.schedulez'; did you mean "
        "'schedules'? (run from the folder that holds it, or put that folder on PYTHONPATH)"
    )
