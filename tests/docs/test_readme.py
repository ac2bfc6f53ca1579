"""The README's snippets run, and its two commands are the ones CI and newcomers use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._launch import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"


def _blocks(language: str, page: Path = README) -> list[str]:
    """The ``language`` code blocks of ``page``, but those marked ``<!-- not run -->``."""
    found = re.findall(
        rf"(<!-- not run -->\n)?```{language}\n(.*?)```", page.read_text(), flags=re.S
    )
    return [block for skipped, block in found if not skipped]


@pytest.mark.parametrize(
    "page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: str(p.relative_to(REPO))
)
def test_python_snippets_run(page: Path, capsys: object) -> None:
    namespace: dict[str, object] = {}  # a page reads top to bottom: later blocks build on earlier
    for block in _blocks("python", page):
        exec(compile(block, str(page), "exec"), namespace)


def test_the_readme_and_the_guides_have_snippets_that_run() -> None:
    assert _blocks("python", README)
    for page in ("guide.md", "spec.md", "proving.md", "migration.md"):
        assert _blocks("python", DOCS / page), page


def test_two_commands_do_all_the_set_up() -> None:
    text = README.read_text()
    commands = re.findall(r"<!-- (main|test)-command -->\n```bash\n(.*?)\n```", text)
    assert [kind for kind, _ in commands] == ["main", "test"]
    for _, command in commands:
        assert "python3 -m venv .venv" in command and "pip install" in command
    assert commands[1][1].endswith("-m pytest")
    ci = (README.parent / ".ci" / "run").read_text()
    assert "test-command" in ci  # CI runs the README's own test command, not a copy of it
