"""Mutation testing of isolate, one module at a time (mutmut 3).

``[tool.mutmut]`` in pyproject.toml covers the whole package: ``mutmut run`` from the
repository root mutates every module of ``isolate/`` and first traces the fast test folders
to learn which tests call which function. On 2 cores that is many hours (about 17,000
mutants), so this script runs one module in its own working folder,
``.mutation/<module>/``, with only the tests that exercise that module for the tracing pass
(mutmut then runs, for each mutant, only the tests that called the mutated function).
Each folder keeps mutmut's cache, so a second run resumes where the first stopped and
``mutmut results`` / ``mutmut show NAME`` work inside it.

    python .ci/mutation.py count                      # mutants per module, nothing is run
    python .ci/mutation.py run isolate/cutoff.py      # mutate one module against its tests
    python .ci/mutation.py results isolate/cutoff.py  # survivors of the last run
    python .ci/mutation.py show isolate/cutoff.py NAME  # the diff of one mutant
    python .ci/mutation.py survivors isolate/cutoff.py  # the diff of every survivor
    python .ci/mutation.py table                      # verdicts of every module run so far

``run`` takes ``--max-children N`` (default 2) and runs mutmut under ``nice``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutation"

# The tests that exercise each module. A module not listed here is traced against the test
# file that mirrors it (tests/<layer>/test_<name>.py) or, failing that, its layer's folder.
TESTS: dict[str, list[str]] = {
    "isolate/fingerprints.py": [
        "tests/toolkit/test_fingerprints.py",
        "tests/toolkit/test_fingerprint_routes.py",
        "tests/toolkit/test_drift.py",
        "tests/toolkit/test_copies.py",
    ],
    "isolate/cutoff.py": [
        "tests/toolkit/test_cutoff.py",
        "tests/toolkit/test_cutoff_reasons.py",
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_audit_properties.py",
        "tests/toolkit/test_audits_in_use.py",
    ],
    "isolate/_sharding.py": [
        "tests/toolkit/test_sharding.py",
        "tests/toolkit/test_drift.py",
        "tests/toolkit/test_fingerprints.py",
        "tests/toolkit/test_reachability.py",
    ],
    "isolate/exposure.py": [
        "tests/toolkit/test_exposure.py",
        "tests/toolkit/test_exposure_optimizers.py",
        "tests/toolkit/test_freezing.py",
    ],
    "isolate/spec/thawing.py": ["tests/spec"],
    "isolate/spec/optimizers.py": ["tests/spec"],
    "isolate/spec/clock.py": ["tests/spec"],
    "isolate/spec/checks.py": ["tests/spec"],
    "isolate/spec/identity.py": ["tests/spec"],
    "isolate/spec/handle.py": ["tests/spec"],
}


def pytest_args() -> list[str]:
    """The options ``[tool.mutmut]`` gives every pytest run (one list for both ways to run)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["tool"]["mutmut"]["pytest_add_cli_args"]


def modules() -> list[str]:
    """Every module of the package that has code to mutate, as a path from the root."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "isolate").rglob("*.py")
        if "__pycache__" not in p.parts
    )


def tests_for(module: str) -> list[str]:
    """The test files or folders that trace ``module`` (see ``TESTS``)."""
    if module in TESTS:
        return TESTS[module]
    path = Path(module)
    layer = {"isolate": "toolkit"}.get(path.parent.as_posix(), path.parent.name)
    mirror = Path("tests") / layer / f"test_{path.stem.lstrip('_')}.py"
    if (ROOT / mirror).exists():
        return [mirror.as_posix()]
    return [(Path("tests") / layer).as_posix()]


def count() -> dict[str, int]:
    """Mutants per module, generated in memory: nothing is written or run."""
    from mutmut.mutation.file_mutation import mutate_file_contents

    return {
        module: len(mutate_file_contents(module, (ROOT / module).read_text()).mutant_names)
        for module in modules()
    }


def workdir(module: str) -> Path:
    """``.mutation/<module>/`` set up for mutmut: the package and the tests linked in, and a
    pyproject.toml whose ``[tool.mutmut]`` names this module and its tests."""
    slug = module.removesuffix(".py").replace("/", ".")
    where = WORK / slug
    where.mkdir(parents=True, exist_ok=True)
    for name in ("isolate", "tests"):
        link = where / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)
    text = (ROOT / "pyproject.toml").read_text()
    text = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[)", "", text)
    text += (
        "\n[tool.mutmut]\n"
        'source_paths = ["isolate"]\n'
        f"only_mutate = {json.dumps([module])}\n"
        f"pytest_add_cli_args = {json.dumps(pytest_args())}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests_for(module))}\n"
        'process_isolation = "forkserver"\n'
    )
    target = where / "pyproject.toml"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    return where


def tally(module: str) -> dict[str, int] | None:
    """The module's verdicts so far, by mutmut status, or None if it never ran."""
    from mutmut.stats import status_by_exit_code

    slug = module.removesuffix(".py").replace("/", ".")
    meta = WORK / slug / "mutants" / f"{module}.meta"
    if not meta.exists():
        return None
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    counts: dict[str, int] = {}
    for code in codes.values():
        status = status_by_exit_code[code]
        counts[status] = counts.get(status, 0) + 1
    return counts


def survivors(module: str) -> list[str]:
    """The names of the module's surviving mutants."""
    slug = module.removesuffix(".py").replace("/", ".")
    meta = WORK / slug / "mutants" / f"{module}.meta"
    codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    return sorted(name for name, code in codes.items() if code == 0)


def mutmut(module: str, *args: str) -> int:
    """Run ``mutmut ARGS`` in the module's working folder."""
    binary = Path(sys.executable).with_name("mutmut")
    command = ["nice", "-n", "5", str(binary), *args]
    return subprocess.call(command, cwd=workdir(module), env={**os.environ, "OMP_NUM_THREADS": "1"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("count", help="mutants per module; nothing is run")
    run = sub.add_parser("run", help="mutate one module against its tests")
    run.add_argument("module", help="a path such as isolate/cutoff.py")
    run.add_argument("--max-children", type=int, default=2)
    results = sub.add_parser("results", help="the survivors of the module's last run")
    results.add_argument("module")
    show = sub.add_parser("show", help="the diff of one mutant")
    show.add_argument("module")
    show.add_argument("name")
    sub.add_parser("table", help="verdicts per module of every module run so far")
    diffs = sub.add_parser("survivors", help="the diff of every survivor of one module")
    diffs.add_argument("module")
    args = parser.parse_args(argv)

    if args.command == "count":
        counts = count()
        for module, n in counts.items():
            print(f"{n:6d}  {module}")
        print(f"{sum(counts.values()):6d}  total")
        return 0
    if args.command == "table":
        for module in modules():
            verdicts = tally(module)
            if verdicts:
                print(module, json.dumps(verdicts, sort_keys=True))
        return 0
    if args.module not in modules():
        parser.error(f"{args.module!r} is not a module of isolate/; e.g. isolate/cutoff.py")
    if args.command == "run":
        return mutmut(args.module, "run", "--max-children", str(args.max_children))
    if args.command == "results":
        return mutmut(args.module, "results")
    if args.command == "survivors":
        for name in survivors(args.module):
            mutmut(args.module, "show", name)
        return 0
    return mutmut(args.module, "show", args.name)


if __name__ == "__main__":
    sys.exit(main())
