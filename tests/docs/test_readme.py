"""The README's snippets run, and its two commands are the ones CI and newcomers use."""

from __future__ import annotations

import re

from tests._launch import REPO

README = REPO / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_python_snippets_run(capsys: object) -> None:
    blocks = _blocks("python")
    assert blocks
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_two_commands_do_all_the_set_up() -> None:
    text = README.read_text()
    commands = re.findall(r"<!-- (main|test)-command -->\n```bash\n(.*?)\n```", text)
    assert [kind for kind, _ in commands] == ["main", "test"]
    for _, command in commands:
        assert "python3 -m venv .venv" in command and "pip install" in command
    assert commands[1][1].endswith("-m pytest")
    ci = (README.parent / ".ci" / "run").read_text()
    assert "test-command" in ci  # CI runs the README's own test command, not a copy of it
