"""``isolate certify`` on the command line: exit 0 clean, 1 a claim fails, 2 bad input (one
line on stderr, no traceback); the JSON certificate written with --output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isolate.certificates import main
from isolate.certificates.claims import BUFFERS
from isolate.spec.data import SpecData
from tests.certificates._data import (
    SPEC,
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


@pytest.mark.parametrize(
    ("name", "text", "why"),
    [
        (
            "spec.json",
            "{freeze",
            "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        (
            "spec.yaml",
            "freeze: [trunk\n",
            "expected ',' or ']', but got '<stream end>' (line 2, column 1)",
        ),
        ("spec.yaml", b"\xff\xfe\x00", "not UTF-8 text"),
    ],
    ids=["json", "yaml", "binary"],
)
def test_a_spec_file_that_does_not_parse_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str | bytes, why: str
) -> None:
    files = [str(p) for p in pair(tmp_path, "torch", trained(base_state()))]
    spec = tmp_path / name
    spec.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main([*files, "--spec", str(spec)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err == f"isolate certify: error: certify(): cannot read the spec {name}: {why}\n"
    )


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


def test_the_help_gives_the_usage_the_examples_every_group_and_every_option(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # no help line wrapped (nor split at a hyphen)
    assert main(["--help"]) == 0
    raw = capsys.readouterr().out
    assert raw.startswith("usage: isolate certify [-h] [--spec SPEC] ")
    # the description is printed as written: its line breaks and indented examples kept
    assert (
        "\n\nCertify from two checkpoints alone what a run froze, trained, merged and tied; write "
        "the\ncertificate as JSON:\n\n    isolate certify base.safetensors tuned.safetensors "
        "--freeze backbone -o certificate.json\n    isolate certify base.ckpt last.ckpt --spec "
        "isolation.yaml --prefix net\n\n"
    ) in raw
    assert raw.count("\noptions:\n") == 1  # argparse's own (-h); the module's has its title
    text = " ".join(raw.split())
    for line in (
        "base the checkpoint before: a .safetensors file, a torch.save file, or a "
        "torch.distributed.checkpoint folder "
        "tuned the checkpoint after (fine-tuned, merged, or the run's last)",
        "claims (give at least one): "
        "--spec SPEC an IsolationSpec as a JSON or YAML file (freeze, thaw, bn) "
        "--freeze SELECTOR [SELECTOR ...] frozen keys, as spec freeze selectors (names, globs, "
        "'!' exclusions); instead of --spec "
        "--bn {eval,train} with --freeze: BatchNorm statistics of the frozen part are held "
        "(eval) or may update (train); default eval "
        "--adapter-config FILE a PEFT LoRA adapter_config.json (or its folder): TUNED is the "
        "base merged with it "
        "--adapter FILE the adapter's weights (adapter_model.safetensors): check the merge "
        "value by value "
        "--rows KEY=ROWS only these rows of KEY train, e.g. embed.weight=3,7 (repeatable) "
        "--tie KEYS keys that must stay equal, e.g. embed.weight,head.weight (repeatable)",
        "reading, comparing and output: --no-detect-ties do not treat keys bitwise equal in "
        "BASE as tied "
        "--buffers GLOB [GLOB ...] keys that are buffers (default: *.running_mean "
        "*.running_var *.num_batches_tracked) "
        "--ignore SELECTOR [SELECTOR ...] keys to leave out of the certificate "
        "--key KEY where the weights sit in each file: auto (Lightning's state_dict, a "
        "distributed checkpoint's model), a group name, or none for the top level "
        "--prefix PREFIX prefix the spec's selectors with this module name (a LightningModule "
        "holding the model as self.net: net) "
        "--ulps ULPS merge tolerance in units of the dtype's rounding (default 2) "
        "--hash {xxh3,sha256,none} hash of each file recorded in the certificate (default "
        "xxh3: XXH3-128, as xxhsum -H2 prints it)",
        # (how argparse shows "--output, -o" differs between Python versions)
        "OUTPUT write the certificate as JSON to this file "
        "--json print the JSON certificate instead of the report "
        "A certificate shows which tensors changed; it cannot show which loss changed them.",
    ):
        assert line in text


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """What the command hands certify(), each call's keywords with the two paths; certify()
    answers with a clean certificate of a real pair."""
    from isolate.certificates import cli

    clean = cli.certify(*pair(tmp_path, "torch", trained(base_state())), spec=SPEC)
    seen: list[dict[str, object]] = []

    def record(base: object, tuned: object, **kwargs: object) -> object:
        seen.append({"paths": [Path(str(base)), Path(str(tuned))], **kwargs})
        return clean

    monkeypatch.setattr(cli, "certify", record)
    return seen


def test_every_option_is_handed_to_certify_and_each_default_is_certifys(
    tmp_path: Path, calls: list[dict[str, object]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["b.pt", "t.pt", "--freeze", "trunk", "!trunk.1"]) == 0
    out = tmp_path / "cert.json"
    given = [
        *("b.pt", "t.pt", "--spec", "s.yaml", "--adapter-config", "cfg", "--adapter", "a.st"),
        *("--rows", "embed.weight=3,7", "--rows", "head.weight=0", "--tie", "embed.weight,out"),
        *("--tie", "a,b,c", "--no-detect-ties", "--buffers", "*.mean", "*.var"),
        *("--ignore", "out", "head.bias", "--key", "ema", "--prefix", "net", "--ulps", "0.5"),
        *("--hash", "sha256", "-o", str(out), "--json"),
    ]
    assert main(given) == 0
    paths = [Path("b.pt"), Path("t.pt")]
    assert calls == [
        {
            "paths": paths,
            "spec": SpecData(freeze=("trunk", "!trunk.1"), bn="eval"),
            "adapter_config": None,
            "adapter": None,
            "rows": {},
            "ties": [],
            "detect_ties": True,
            "buffers": list(BUFFERS),
            "ignore": [],
            "key": "auto",
            "prefix": None,
            "ulps": 2.0,
            "file_hash": "xxh3",
        },
        {
            "paths": paths,
            "spec": "s.yaml",
            "adapter_config": "cfg",
            "adapter": "a.st",
            "rows": {"embed.weight": [3, 7], "head.weight": [0]},
            "ties": [["embed.weight", "out"], ["a", "b", "c"]],
            "detect_ties": False,
            "buffers": ["*.mean", "*.var"],
            "ignore": ["out", "head.bias"],
            "key": "ema",
            "prefix": "net",
            "ulps": 0.5,
            "file_hash": "sha256",
        },
    ]
    printed = capsys.readouterr().out
    assert ": CLEAN" in printed.split("\n{")[0]  # the first run prints the report
    assert json.loads(out.read_text()) == json.loads("{" + printed.split("\n{", 1)[1])


@pytest.mark.parametrize(
    ("argv", "key", "file_hash"),
    [
        (["--key", "none"], None, "xxh3"),
        (["--key", "NONE", "--hash", "none"], None, "none"),
        (["--key", "None", "--hash", "xxh3"], None, "xxh3"),
        (["--key", "state_dict", "--hash", "sha256"], "state_dict", "sha256"),
        ([], "auto", "xxh3"),
    ],
)
def test_key_none_in_any_case_means_the_top_level_and_each_hash_is_a_choice(
    calls: list[dict[str, object]], argv: list[str], key: str | None, file_hash: str
) -> None:
    assert main(["b.pt", "t.pt", "--freeze", "trunk", *argv]) == 0
    assert (calls[0]["key"], calls[0]["file_hash"]) == (key, file_hash)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--rows", "embed.weight=3=4"],
            "argument --rows: expected KEY=ROW,ROW,... (e.g. "
            "embed.weight=3,7), got 'embed.weight=3=4' (see isolate certify --help)",
        ),
        (
            ["--rows", "=3"],
            "argument --rows: expected KEY=ROW,ROW,... (e.g. embed.weight=3,7), "
            "got '=3' (see isolate certify --help)",
        ),
        (
            ["--rows", "embed.weight=,"],
            "argument --rows: expected KEY=ROW,ROW,... (e.g. "
            "embed.weight=3,7), got 'embed.weight=,' (see isolate certify --help)",
        ),
        (
            ["--tie", "embed.weight,"],
            "argument --tie: expected KEY,KEY[,...] (two keys or "
            "more), got 'embed.weight,' (see isolate certify --help)",
        ),
        (["--spec", "s.yaml", "--freeze", "trunk"], "give --spec or --freeze, not both"),
    ],
)
def test_a_malformed_claim_is_refused_in_one_whole_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    files = [str(p) for p in pair(tmp_path, "torch", trained(base_state()))]
    assert main([*files, *argv]) == 2
    assert capsys.readouterr().err == f"isolate certify: error: {message}\n"
