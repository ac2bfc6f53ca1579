"""``import isolate`` against ``import torch``, each in a fresh interpreter.

Each side is timed inside its own new process (the import statement alone, not the
interpreter's start), in alternating order; one more ``python -X importtime -c "import
isolate"`` names, for each package that ``import isolate`` loads beyond ``import torch``, the
innermost isolate module under which it was first imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from experiments.bench._rows import Row
from experiments.bench._timing import alternating, geometric_mean_ratio

__all__ = ["first_importers", "run"]

_CHILD = (
    "import json, sys, time\n"
    "start = time.perf_counter()\n"
    "import {module}\n"
    "seconds = time.perf_counter() - start\n"
    "print(json.dumps({{'seconds': seconds, 'modules': sorted(sys.modules)}}))\n"
)
_LISTED = 8  # how many packages the row's extra names


def _env() -> dict[str, str]:
    """This environment, with the folder of the isolate this process would import first on the
    path (the children also run there, since ``-c`` puts the working directory first)."""
    spec = importlib.util.find_spec("isolate")
    if spec is None or spec.origin is None:
        raise RuntimeError("imports section: isolate is not importable from this process")
    root = str(Path(spec.origin).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _python(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    root = env["PYTHONPATH"].split(os.pathsep)[0]
    command = [sys.executable, *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"imports section: python {' '.join(args)} failed:\n{done.stderr}")
    return done


def _fresh_import(module: str, env: dict[str, str]) -> dict[str, Any]:
    """The seconds of ``import module`` in a new interpreter, and the modules it left loaded."""
    done = _python(["-c", _CHILD.format(module=module)], env)
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def _package(module: str) -> str:
    """``torch._dynamo`` for torch's submodules, the top-level name for anything else."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "torch" and len(parts) > 1 else parts[0]


def first_importers(log: str, packages: list[str]) -> dict[str, str]:
    r"""For each of ``packages``, the innermost isolate module under which the ``python -X
    importtime`` output ``log`` shows it first imported (packages not under isolate are left
    out), in the order of ``packages``.

    >>> log = "\n".join([
    ...     "import time: self [us] | cumulative | imported package",
    ...     "import time:   5 |   5 |       sympy.core",
    ...     "import time:   9 |  14 |     sympy",
    ...     "import time:   2 |  16 |   isolate.freezing",
    ...     "import time:   1 |  17 | isolate",
    ...     "import time:   3 |   3 | torch._numpy",
    ... ])
    >>> first_importers(log, ["torch._numpy", "sympy"])
    {'sympy': 'isolate.freezing'}
    """
    lines = [line.split("|")[-1] for line in log.splitlines() if line.startswith("import time:")]
    found: dict[str, str] = {}
    ancestors: list[str] = []
    # importtime prints a module after everything it imported: read backwards, each line's
    # ancestors are the lines above it with less indentation.
    for line in reversed(lines[1:]):  # the first line is the header
        name = line.strip()
        depth = (len(line) - len(line.lstrip()) - 1) // 2
        del ancestors[depth:]
        owner = next((a for a in reversed(ancestors) if a.split(".")[0] == "isolate"), None)
        package = _package(name)
        if package in packages and package not in found and owner is not None:
            found[package] = owner
        ancestors.append(name)
    return {package: found[package] for package in packages if package in found}


def run(quick: bool) -> list[Row]:
    """The median import times, the geometric mean of the per-pair ratios, and what
    ``import isolate`` loads beyond ``import torch``."""
    env = _env()
    loaded: dict[str, list[str]] = {}

    def timed(module: str) -> float:
        result = _fresh_import(module, env)
        loaded[module] = result["modules"]
        return float(result["seconds"])

    timed("isolate")  # warm-up: the files into the page cache
    timed("torch")
    with_isolate, with_torch = alternating(
        lambda: timed("isolate"), lambda: timed("torch"), 2 if quick else 10
    )
    extra_modules = sorted(set(loaded["isolate"]) - set(loaded["torch"]))
    counts = Counter(_package(m) for m in extra_modules if not m.startswith("isolate"))
    packages = [p for p, _ in counts.most_common(_LISTED)]
    importtime = _python(["-X", "importtime", "-c", "import isolate"], env).stderr
    extra = {
        "modules loaded beyond import torch": len(extra_modules),
        "torch._dynamo loaded": "torch._dynamo" in loaded["isolate"],
        "packages loaded beyond import torch (modules)": dict(counts.most_common(_LISTED)),
        "first imported under": first_importers(importtime, packages),
    }
    ratio = geometric_mean_ratio(with_isolate, with_torch)
    return [Row("import isolate vs import torch, each in a fresh interpreter", "import isolate",
                "import torch", statistics.median(with_isolate), statistics.median(with_torch),
                "<= 1.2", False, extra, paired_ratio=ratio, limit=1.2)]  # fmt: skip
