"""``isolate certify`` on the command line: exit 0 clean, 1 a claim fails, 2 bad input (one
line on stderr, no traceback); the JSON certificate written with --output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isolate.certificates import main
from tests.certificates._data import (
    base_state,
    lora_adapter,
    lora_base,
    merged,
    pair,
    trained,
    write_lora,
)


def test_clean_run_exits_0_and_writes_the_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, tuned = pair(tmp_path, "safetensors", trained(base_state()))
    out = tmp_path / "cert.json"
    assert main([str(base), str(tuned), "--freeze", "trunk", "--output", str(out)]) == 0
    report = capsys.readouterr().out
    assert ": CLEAN" in report and "head: 2 trainable, moved" in report
    data = json.loads(out.read_text())
    assert data["clean"] is True and data["claims"]["spec"]["freeze"] == ["trunk"]


def test_a_failed_claim_exits_1_and_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tuned = trained(base_state())
    tuned["trunk.1.running_mean"] += 1
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"freeze": ["trunk"], "bn": "eval"}))
    files = pair(tmp_path, "torch", tuned)
    assert main([*map(str, files), "--spec", str(spec)]) == 1
    report = capsys.readouterr().out
    assert "NOT CLEAN: 1 failed" in report
    assert "FAIL held      trunk.1.running_mean: changed" in report
    assert main([*map(str, files), "--freeze", "trunk", "--bn", "train", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["clean"] is True


def test_rows_ties_and_ignore_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = base_state()
    tuned = trained(base)
    tuned["embed.weight"] = base["embed.weight"].clone()
    tuned["embed.weight"][4] += 1
    tuned["out.weight"] = tuned["embed.weight"].clone()
    files = [str(p) for p in pair(tmp_path, "torch", tuned)]
    args = ["--freeze", "trunk", "--rows", "embed.weight=4", "--tie", "embed.weight,out.weight"]
    assert main([*files, *args, "--no-detect-ties"]) == 0
    assert main([*files, "--rows", "embed.weight=4,5", "--ignore", "trunk", "head", "out"]) == 1
    assert "1 trainable rows did not move (rows [5])" in capsys.readouterr().out


def test_a_lora_merge_from_the_command_line(tmp_path: Path) -> None:
    adapter = lora_adapter()
    paths = write_lora(tmp_path, merged(lora_base(), adapter, scale=1.0), adapter)
    argv = [str(paths["base"]), str(paths["tuned"]), "--adapter-config", str(paths["config"])]
    assert main([*argv, "--adapter", str(paths["adapter"])]) == 1
    assert main(argv) == 0  # the config alone: the target moved, the rest is bitwise


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--freeze", "trunc"],
            "isolate certify: error: certify(): 'trunc' matched none of the keys",
        ),
        (["--rows", "embed.weight"], "argument --rows: expected KEY=ROW,ROW,..."),
        (["--spec", "s.yaml", "--freeze", "trunk"], "give --spec or --freeze, not both"),
        ([], "nothing to certify: give spec="),
        (["--freeze", "trunk", "--hash", "md5"], "argument --hash: invalid choice: 'md5'"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    files = [str(p) for p in pair(tmp_path, "torch", trained(base_state()))]
    assert main([*files, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("isolate certify: error: ") and message in captured.err


def test_a_truncated_file_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, tuned = pair(tmp_path, "safetensors", trained(base_state()))
    tuned.write_bytes(tuned.read_bytes()[:200])
    assert main([str(base), str(tuned), "--freeze", "trunk"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("isolate certify: error: tuned.safetensors") and err.count("\n") == 1


def test_every_option_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    from isolate.certificates.cli import parser

    for action in parser()._actions:
        assert action.help, action.dest
    assert main(["--help"]) == 0
    assert "it cannot show which loss changed" in capsys.readouterr().out
