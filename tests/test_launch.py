"""Child processes started by the tests run the checkout under test, not an installed isolate.

An editable install may point at another checkout, and a child started with only the inherited
environment imports whatever the interpreter finds first; ``child_env`` puts this checkout
first on PYTHONPATH, and every process the tests start goes through it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._launch import REPO, child_env, launch

# What a child prints: where each package of the repository came from.
WHERE = (
    "import json, isolate, tests, experiments; print(json.dumps("
    "{m.__name__: m.__file__ for m in (isolate, tests, experiments)}))"
)


@pytest.fixture
def decoy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An inherited PYTHONPATH that holds another ``isolate`` (as an editable install of another
    checkout would)."""
    fake = tmp_path / "decoy"
    for package in ("isolate", "tests", "experiments"):
        (fake / package).mkdir(parents=True)
        (fake / package / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    return fake


def _where(stdout: str) -> dict[str, Path]:
    return {name: Path(file).resolve() for name, file in json.loads(stdout).items()}


@pytest.mark.parametrize("how", ["-c", "script"])
def test_a_child_imports_this_checkout_first(tmp_path: Path, decoy: Path, how: str) -> None:
    script = tmp_path / "where.py"  # run by path, as the distributed scripts are
    script.write_text(WHERE)
    command = [sys.executable, "-c", WHERE] if how == "-c" else [sys.executable, str(script)]
    # The negative control: with the inherited environment the child takes the decoy.
    plain = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert all(path.is_relative_to(decoy) for path in _where(plain.stdout).values())
    found = _where(launch(command, cwd=tmp_path).stdout)
    assert set(found) == {"isolate", "tests", "experiments"}
    for name, path in found.items():
        assert path.is_relative_to(REPO.resolve()), (name, path)
    assert found["isolate"] == (REPO / "isolate" / "__init__.py").resolve()


def test_child_env_keeps_the_inherited_path_after_this_checkout(decoy: Path) -> None:
    env = child_env({"EXTRA": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), str(decoy)]
    assert env["OMP_NUM_THREADS"] == "1" and env["EXTRA"] == "1"


def _subprocess_calls(tree: ast.AST) -> list[ast.Call]:
    starts = {"run", "Popen", "call", "check_call", "check_output"}
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in starts
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "subprocess"
    ]


def test_every_python_child_of_the_tests_gets_child_env() -> None:
    """A new ``subprocess`` call in tests/ without ``env=`` would import whatever is installed;
    only non-Python commands (git) and this file's negative control may leave it out."""
    missing = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name in {"_launch.py", "test_launch.py"}:
            continue
        for call in _subprocess_calls(ast.parse(path.read_text())):
            command = call.args[0] if call.args else None
            if isinstance(command, ast.List) and command.elts:
                first = command.elts[0]
                if isinstance(first, ast.Constant) and first.value == "git":
                    continue
            if not any(k.arg == "env" for k in call.keywords):
                missing.append(f"{path.relative_to(REPO)}:{call.lineno}")
    assert missing == [], f"subprocess calls without env=child_env(): {missing}"
