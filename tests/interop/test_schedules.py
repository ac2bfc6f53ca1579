"""Default schedules: one phase per top-level block, from the head back, written as YAML by
``isolate schedule`` (also run as ``python -m isolate``) that applies as a spec."""

from __future__ import annotations

import math
import sys
from pathlib import Path

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


class _Wrapped(nn.Module):
    """A wrapper with a parameter of its own over a single child: not looked through."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.body = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


def _nest(**children: nn.Module) -> nn.Module:
    module = nn.Module()
    for name, child in children.items():
        module.add_module(name, child)
    return module


def test_wrappers_are_looked_through_only_when_they_hold_no_parameter_of_their_own() -> None:
    two_deep = _nest(outer=_nest(inner=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))))
    assert default_schedule(two_deep) == {
        "freeze": ["outer.inner.0"],
        "thaw": [{"select": "outer.inner.0", "monitor": "val_loss", "patience": 3}],
    }
    with pytest.raises(SpecError) as raised:
        default_schedule(_Wrapped())
    assert str(raised.value) == (
        "default_schedule(): _Wrapped has 1 top-level block(s) with parameters under the root; "
        "a phased schedule needs a head and at least one block before it. Write the schedule "
        "by hand"
    )
    with pytest.raises(SpecError) as raised:
        default_schedule(_nest(model=nn.Linear(2, 2)))
    assert str(raised.value).startswith(
        "default_schedule(): Module has 0 top-level block(s) with parameters under 'model'; "
    )


def test_by_epoch_the_first_thaw_is_at_epoch_one() -> None:
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 1))
    assert default_schedule(net, monitor=None) == {
        "freeze": ["0", "2"],
        "thaw": [{"select": "2", "epoch": 1}, {"select": "0", "epoch": 2}],
    }


def test_strings_yaml_would_read_as_something_else_are_quoted() -> None:
    bare = ["model.stem", "type:Linear", "a/b<c>", "x=y+z-w", "_x", "layer.*.weight"]
    quoted = [
        *("0", "1.5", "1e5", ".inf", "~", ""),  # numbers, null
        *("null", "True", "yes", "Off", "n"),  # words YAML 1.1 reads as null or a boolean
        *("layers.[0-3].*", "model?classifier*", "a,b", "a #b", "a ", "x]", "a:"),  # flow
        *("!head", "*", "-x", 'q"x', "a\\d", "line\nbreak", "é"),  # indicators, escapes
    ]
    text = to_yaml({"freeze": [*bare, *quoted], "thaw": [{"select": q} for q in quoted]})
    first = text.splitlines()[0]
    assert first.startswith("freeze: [model.stem, type:Linear, a/b<c>, x=y+z-w, _x, layer.*.")
    assert '"0", "1.5", "1e5", ".inf", "~", "", "null", "True", "yes", "Off", "n", ' in first
    assert '"a\\\\d", "line\\nbreak", "é"]' in first
    assert yaml.safe_load(text) == {
        "freeze": [*bare, *quoted],
        "thaw": [{"select": q} for q in quoted],
    }


def test_to_yaml_writes_null_floats_with_a_point_and_an_empty_header_line() -> None:
    text = to_yaml({"monitor": None, "lr": [1.5e-05, 2e-07, 0.5]}, "one\n\nthree")
    assert text == "# one\n#\n# three\nmonitor: null\nlr: [1.5e-05, 2.0e-07, 0.5]\n"
    assert yaml.safe_load(text) == {"monitor": None, "lr": [1.5e-05, 2e-07, 0.5]}


def test_a_sequential_schedule_applies_as_written() -> None:
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 1))
    spec = IsolationSpec.from_dict(yaml.safe_load(to_yaml(default_schedule(net, monitor=None))))
    with spec.applied(net):
        assert [n for n, p in net.named_parameters() if p.requires_grad] == ["3.weight", "3.bias"]


def test_the_command_passes_its_options_and_writes_the_whole_header(
    capsys: pytest.CaptureFixture[str],
) -> None:
    factory = "tests.interop._schedule_models:build_tower"
    assert main(["schedule", factory]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"# Default isolate schedule for {factory} (Tower).\n"
        "# Phase 0 trains what is not frozen (the head); each thaw step is one more phase.\n"
        "# Per step: epoch/step (a fixed time), or monitor/patience/min_delta/mode (a plateau;\n"
        "# epoch/step then is the latest), lr, warmup_ratio + warmup_steps|warmup_epochs,\n"
        "# warmup_shape, align. Selectors: names, globs, 'type:<Class>', '!' exclusions.\n"
        "freeze: [model.stem, "
    )
    assert yaml.safe_load(out)["thaw"][0] == {
        "select": "model.stage2",
        "monitor": "val_loss",
        "patience": 3,
    }
    assert main(["schedule", factory, "--monitor", "val_acc", "--patience", "5"]) == 0
    thaw = yaml.safe_load(capsys.readouterr().out)["thaw"]
    assert thaw[-1] == {"select": "model.stem", "monitor": "val_acc", "patience": 5}


def test_the_schedule_help_names_the_factory_and_every_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["schedule", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith(
        "usage: isolate schedule [-h] [--monitor MONITOR] [--patience PATIENCE] [--by-epoch] "
        "module:callable "
    )
    for line in (
        "module:callable what builds the model, called without arguments (e.g. "
        "torchvision.models:resnet18)",
        "--monitor MONITOR metric whose plateau ends a phase (default val_loss)",
        "--patience PATIENCE checks without improvement (default 3)",
        "--by-epoch one phase per epoch instead of plateaus",
    ):
        assert line in out


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "schedule_factories.py").write_text(
        "_build_model = None\nnot_a_module = dict\npi = 3.14\n"
    )
    (tmp_path / "needs_a_dependency.py").write_text("import a_package_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("schedule_factories", "needs_a_dependency"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return "schedule_factories"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "torch.nn:",
            "expected module:callable (e.g. torchvision.models:resnet18), got 'torch.nn:'",
        ),
        (":build", "expected module:callable (e.g. torchvision.models:resnet18), got ':build'"),
        (
            "torch.nn:Linear:x",
            "torch.nn:Linear:x: torch.nn has no attribute 'Linear:x'; did you mean 'Linear' or "
            "'LazyLinear'? (give module:callable, a callable that returns the model)",
        ),
        (
            "schedule_factories:build_model",
            "schedule_factories:build_model: schedule_factories has no attribute 'build_model' "
            "(give module:callable, a callable that returns the model)",
        ),
        (
            "schedule_factories:pi",
            "schedule_factories:pi: float is not callable; give a model factory",
        ),
        (
            "schedule_factories:not_a_module",
            "schedule_factories:not_a_module() returned dict, not a torch.nn.Module",
        ),
        (
            "needs_a_dependency:f",
            "needs_a_dependency:f: importing needs_a_dependency needs "
            "'a_package_that_is_not_installed', which is not installed; install it",
        ),
        (
            "isolate.interopp.schedules:f",
            "isolate.interopp.schedules:f: no module named 'isolate.interopp'; did you mean "
            "'interop'? (run from the folder that holds it, or put that folder on PYTHONPATH)",
        ),
        (  # a module is no package: no close match among the top-level modules either
            "isolate.cli.torchh:f",
            "isolate.cli.torchh:f: no module named 'isolate.cli.torchh' (run from the folder "
            "that holds it, or put that folder on PYTHONPATH)",
        ),
    ],
)
def test_a_factory_that_gives_no_model_is_named_with_the_fix(
    factories: str, spec: str, message: str
) -> None:
    with pytest.raises(SpecError) as raised:
        load_model(spec)
    assert str(raised.value) == message
