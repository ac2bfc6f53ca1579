"""The core stays free of frameworks; the package ships its type information."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import isolate


def test_import_isolate_pulls_in_neither_lightning_nor_torchvision() -> None:
    code = (
        "import sys, json, isolate; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in {'pytorch_lightning', 'lightning', 'torchvision', 'pytest'})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_package_ships_py_typed() -> None:
    assert (Path(isolate.__file__).parent / "py.typed").is_file()
