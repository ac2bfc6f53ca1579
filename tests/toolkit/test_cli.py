"""The ``isolate`` command: every option has help, every user error is one line that names the
culprit and the fix (with a close match where there is one) and exits with status 2."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from isolate.cli import VERBS, build_parser, main
from isolate.spec import IsolationSpec
from tests._launch import child_env

FACTORIES = """
from torch import nn

def build_net():
    return nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 1))

class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.body, self.head = nn.Linear(2, 4), nn.Linear(4, 4), nn.Linear(4, 1)

def build_tower():
    return Tower()
"""


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "cli_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cli_factories", raising=False)
    return "cli_factories"


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``isolate argv``: it must fail with status 2 and exactly one line on stderr."""
    try:
        status = main(argv)
    except SystemExit as stop:  # argparse's own errors
        status = stop.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_every_verb_and_option_has_help() -> None:
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert verbs.help
    assert set(verbs.choices) == set(VERBS) >= {"schedule", "migrate"}
    for name, sub in verbs.choices.items():
        assert "\n    isolate " in (sub.description or ""), name  # an example, kept as written
        for action in sub._actions:
            assert action.help and action.help.strip(), (name, action.dest)
        assert f"isolate {name} " in sub.format_help()


def test_help_keeps_the_example_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["migrate", "--help"])
    assert stop.value.code == 0
    assert (
        "\n    isolate migrate Model_ft_schedule.yaml > isolation.yaml\n" in capsys.readouterr().out
    )


def test_the_top_help_says_what_isolate_is_and_what_each_verb_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Declarative, verifiable gradient isolation for PyTorch: the tools." in out
    for verb, (_, help_text) in VERBS.items():
        assert f" {verb} {' '.join(help_text.split())}" in out


def test_a_misspelt_verb_gets_a_close_match(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(capsys, ["schedul", "x:y"])
    assert line.startswith("isolate: error: unknown verb 'schedul'; did you mean 'schedule'?")
    assert f"The verbs are {', '.join(VERBS)} (see" in line


def test_extra_arguments_name_the_first(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(capsys, ["schedule", "x:y", "extra", "more"])
    assert (
        line
        == "isolate schedule: error: unexpected argument 'extra' (see 'isolate schedule --help')"
    )


def test_no_verb_names_the_verbs(capsys: pytest.CaptureFixture[str]) -> None:
    assert one_line_error(capsys, []) == (
        f"isolate: error: name a verb: {', '.join(VERBS)} (see 'isolate --help')"
    )


def test_a_misspelt_option_gets_a_close_match(
    capsys: pytest.CaptureFixture[str], factories: str
) -> None:
    line = one_line_error(capsys, ["schedule", f"{factories}:build_net", "--by_epoch"])
    assert line == (
        "isolate schedule: error: unknown option '--by_epoch'; did you mean '--by-epoch'? "
        "(see 'isolate schedule --help')"
    )
    line = one_line_error(capsys, ["migrate", "--modle", f"{factories}:build_net", "s.yaml"])
    assert line.startswith(
        "isolate migrate: error: unknown option '--modle'; did you mean '--model'?"
    )


def test_a_misspelt_factory_gets_a_close_match(
    capsys: pytest.CaptureFixture[str], factories: str
) -> None:
    line = one_line_error(capsys, ["schedule", f"{factories}:build_towr"])
    assert line.startswith(
        f"isolate schedule: error: {factories}:build_towr: {factories} has no attribute "
        "'build_towr'; did you mean 'build_tower'"
    )
    line = one_line_error(capsys, ["schedule", "cli_factorie:build_tower"])
    assert "no module named 'cli_factorie'; did you mean 'cli_factories'?" in line
    assert "PYTHONPATH" in line
    line = one_line_error(capsys, ["schedule", "torch.nn:Linear"])  # needs arguments
    assert "calling it without arguments failed" in line
    line = one_line_error(capsys, ["schedule", f"{factories}.build_net"])
    assert "expected module:callable" in line


def test_a_file_that_does_not_exist_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.yaml"
    line = one_line_error(capsys, ["migrate", str(missing)])
    assert (
        line == f"isolate migrate: error: cannot read {str(missing)!r}: No such file or directory"
    )


def test_a_file_that_is_not_yaml_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("0: {params: [a\n1: x\n")
    line = one_line_error(capsys, ["migrate", str(broken)])
    assert line.startswith(f"isolate migrate: error: {broken} is not valid YAML at line")
    unreadable = tmp_path / "bell.yaml"
    unreadable.write_text("0: \x07\n")  # refused by the reader, which marks no line
    line = one_line_error(capsys, ["migrate", str(unreadable)])
    assert line.startswith(f"isolate migrate: error: {unreadable} is not valid YAML: ")


def test_migrate_resolves_regexes_against_the_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, factories: str
) -> None:
    schedule = tmp_path / "Tower_ft_schedule.yaml"
    schedule.write_text(
        "0: {params: [head.weight, head.bias], max_transition_epoch: 2}\n"
        "1: {params: ['(body|stem)\\.weight'], lr: 1.0e-04}\n"
    )
    line = one_line_error(capsys, ["migrate", str(schedule)])  # no glob form without a model
    assert "--model module:callable" in line
    assert main(["migrate", str(schedule), "--model", f"{factories}:build_tower"]) == 0
    spec = IsolationSpec.from_dict(yaml.safe_load(capsys.readouterr().out))
    assert list(spec.thaw[0].select) == ["stem.weight", "body.weight"]  # the model's order, as FTS
    assert spec.freeze == ("*", "!head.weight", "!head.bias")


def test_python_m_isolate_prints_no_warning() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error", "-m", "isolate", "--help"],
        capture_output=True,
        text=True,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "schedule" in done.stdout and "migrate" in done.stdout


def test_a_misspelt_choice_gets_a_close_match_and_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = one_line_error(capsys, ["certify", "a", "b", "--bn", "tran"])
    assert line == (
        "isolate certify: error: unknown value for --bn 'tran'; did you mean 'train'? The "
        "choices are eval, train (see 'isolate certify --help')"
    )
    line = one_line_error(capsys, ["certify", "a", "b", "--bn", "zzz"])
    assert line == (
        "isolate certify: error: unknown value for --bn 'zzz'; the choices are eval, train "
        "(see 'isolate certify --help')"
    )


def test_every_unknown_option_is_named_and_help_is_no_close_match(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = one_line_error(capsys, ["schedule", "x:y", "extra", "--by_epoch=a=b", "--helpme"])
    assert line == (
        "isolate schedule: error: unknown option '--by_epoch'; did you mean '--by-epoch'?; "
        "unknown option '--helpme' (see 'isolate schedule --help')"
    )


def test_the_top_help_gives_the_usage_the_description_and_the_verbs_argument(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith(
        "usage: isolate [-h] VERB ... Declarative, verifiable gradient isolation for PyTorch: "
        "the tools. "
    )
    assert " VERB the tool to run (isolate VERB --help) schedule " in out


def test_other_argparse_errors_are_passed_on_as_argparse_words_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert one_line_error(capsys, ["schedule"]) == (
        "isolate schedule: error: the following arguments are required: module:callable "
        "(see 'isolate schedule --help')"
    )


VERB = """
from isolate.errors import SpecError

def add_arguments(parser):
    parser.add_argument("what")

def run(args):
    if args.what == "spec":
        raise SpecError("first line\\n   second   line")
    if args.what == "empty":
        raise SpecError("")
    if args.what == "disk":
        raise OSError(28, "No space left on device")
    if args.what == "file":
        raise FileNotFoundError(2, "No such file or directory", "gone.yaml")
    if args.what == "bug":
        raise KeyError("not a user error")
    return 1
"""


@pytest.fixture
def verb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "cli_test_verb.py").write_text(VERB)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cli_test_verb", raising=False)
    monkeypatch.setitem(VERBS, "probe", ("cli_test_verb", "a verb of the tests"))
    return "probe"


def test_a_verbs_user_error_is_one_line_and_its_status_passes_through(
    capsys: pytest.CaptureFixture[str], verb: str
) -> None:
    expected = {
        "spec": "first line second line",
        "empty": "SpecError",
        "disk": "[Errno 28] No space left on device",
        "file": "cannot read 'gone.yaml': No such file or directory",
    }
    for what, message in expected.items():
        assert one_line_error(capsys, [verb, what]) == f"isolate probe: error: {message}"
    assert main([verb, "ok"]) == 1
    with pytest.raises(KeyError, match="not a user error"):  # a bug keeps its traceback
        main([verb, "bug"])
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: isolate probe [-h] what\n\na verb of the tests\n")
