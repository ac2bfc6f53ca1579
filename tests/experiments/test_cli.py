"""``python -m experiments``: help names the program and the suite, mistakes get a suggestion
or the flag to pass, and the suite's options are spelled like fit's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from experiments.__main__ import main
from experiments.suite import _split
from tests._launch import REPO

pytestmark = [
    pytest.mark.filterwarnings("ignore::experiments.data.TestSplitOnlyWarning"),
    # Lightning 2.6's CLI calls jsonargparse APIs that jsonargparse 4.49 deprecates.
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]


def test_help_lists_the_suite_and_names_the_program(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "usage: python -m experiments [-c CONFIG] {fit,validate,test,predict,suite}"
    )
    assert re.search(r"^    suite +Run every variant in configs/", out, flags=re.M)
    assert "__main__" not in out
    with pytest.raises(SystemExit) as info:
        main(["suite", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m experiments suite")
    for option in ("--data.data_root", "--data.download", "--data.dataset", "--threads"):
        assert option in out


def test_fit_without_a_config_says_which_flag_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fit"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "python -m experiments: error: fit needs a model: pass a variant's config, e.g. "
        "python -m experiments fit --config configs/detached.yaml (variants in configs/: "
        "attached, baseline,"
    )
    assert len(err.splitlines()) == 2  # the message and where the full usage is


def test_a_misspelt_subcommand_or_option_gets_a_suggestion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["fitt"])
    assert "invalid choice: 'fitt'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(REPO / "configs" / "baseline.yaml"), "--data.batch_sise=3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "python -m experiments fit: error: unrecognized arguments: --data.batch_sise=3; "
        "did you mean 'data.batch_size'?"
    )


def test_an_unknown_variant_is_refused_with_a_suggestion(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["suite", "--only=detachd", f"--output={tmp_path}"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(
        "python -m experiments suite: error: unknown variants ['detachd']; did you mean "
        "['detached']?; choose from ['attached', 'baseline',"
    )
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


def test_suite_options_are_spelled_like_fits_and_the_old_ones_still_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    mine, runs = _split(
        ["--quick", "--data.data_root=x", "--data.limit_train=64", "--trainer.max_steps", "3"]
    )
    assert mine == ["--quick", "--data.data_root=x"]
    assert runs == ["--data.limit_train=64", "--trainer.max_steps=3"]
    mine, runs = _split(["--data-root", "x", "--no-download", "--no-progress-bar"])
    assert mine == ["--data.data_root", "x", "--data.download=false"]
    assert runs == ["--trainer.enable_progress_bar=false"]
    err = capsys.readouterr().err
    assert "--data-root is deprecated; use --data.data_root" in err


@pytest.mark.parametrize("command", ["fit", "suite"])
def test_missing_data_is_one_message_with_the_flag_to_pass(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [
        f"--data.data_root={empty}",
        "--data.download=false",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    if command == "fit":
        args += [
            "--config",
            str(REPO / "configs" / "baseline.yaml"),
            f"--trainer.default_root_dir={tmp_path / 'runs'}",
        ]
    else:
        args += [f"--output={tmp_path / 'suite'}"]
    assert main([command, *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m experiments: data error: ")
    assert "--data.download=true" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) < 10  # the data module's message: what, where, fix
