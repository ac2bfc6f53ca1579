"""docs/contracts.md: its Python runs, its YAML builds specs, and what it prints is what the
page shows."""

from __future__ import annotations

import contextlib
import io
import re

import yaml

from isolate.spec import IsolationSpec
from tests._launch import REPO

PAGE = REPO / "docs" / "contracts.md"


def blocks() -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_every_yaml_block_is_a_valid_spec() -> None:
    specs = [yaml.safe_load(body) for kind, body in blocks() if kind == "yaml"]
    assert len(specs) == 6
    for data in specs:
        assert IsolationSpec.from_dict(data).contracts


def test_the_python_runs_and_prints_what_the_page_shows() -> None:
    namespace: dict[str, object] = {}
    found = blocks()
    printed = 0
    for i, (kind, body) in enumerate(found):
        if kind != "python":
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(body, str(PAGE), "exec"), namespace)
        if "print(" in body:
            shown = next(b for k, b in found[i + 1 :] if k == "text")
            assert out.getvalue() == shown
            printed += 1
    assert printed == 2
