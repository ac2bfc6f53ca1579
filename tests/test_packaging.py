"""The core stays free of frameworks; the package ships its type information."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import isolate
from tests._launch import REPO, launch


def test_package_ships_py_typed() -> None:
    assert (Path(isolate.__file__).parent / "py.typed").is_file()


def test_the_core_declares_exactly_the_packages_it_imports() -> None:
    """A fresh install gets what `import isolate` needs: every third-party module the core
    imports at module level is in [project].dependencies, and nothing else is."""
    root = Path(isolate.__file__).parent
    imported: set[str] = set()
    for path in root.glob("*.py"):  # the core; isolate/lightning is the `lightning` extra
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"isolate", "__future__"}
    text = (root.parent / "pyproject.toml").read_text()  # tomllib is 3.11+, we support 3.10
    listed = re.search(r"^dependencies = \[(.*?)\]", text, re.MULTILINE | re.DOTALL)
    assert listed is not None
    declared = {re.split(r"[<>=!~ ;\[]", d)[0] for d in re.findall(r'"([^"]+)"', listed[1])}
    assert third_party == declared == {"torch", "xxhash"}


def test_import_isolate_does_not_pull_the_lightning_adapter() -> None:
    code = "import sys, isolate; isolate.IsolationSpec(); print('lightning_fabric' in sys.modules)"
    out = launch([sys.executable, "-c", code], cwd=REPO)
    assert out.stdout.strip() == "False"
