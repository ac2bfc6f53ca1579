"""The core stays free of frameworks; the package ships its type information."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import isolate


def test_import_isolate_pulls_in_neither_lightning_nor_torchvision() -> None:
    code = (
        "import sys, json, isolate; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in {'pytorch_lightning', 'lightning', 'torchvision', 'pytest', "
        "'transformers', 'peft'})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


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
