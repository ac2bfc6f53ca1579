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

A stratified random sample over the whole package (``k`` mutants drawn per module with a
fixed seed, run in one working folder, ``.mutation/sample/``, traced once against the
package's whole test selection):

    python .ci/mutation.py sample --k 3 --list        # the names drawn; nothing is run
    python .ci/mutation.py sample --k 3 --max-children 1 isolate/_sharding.py ...
    python .ci/mutation.py sample-table --k 3         # per module: verdicts, Wilson interval

``run`` and ``sample`` take ``--max-children N`` (default 2) and run mutmut under ``nice``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    # Every test file that walks a graph (the audits, the sharding check, reentrant
    # checkpoints re-run for real and on fake tensors).
    "isolate/reachability.py": [
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_audit_properties.py",
        "tests/toolkit/test_audits_in_use.py",
        "tests/toolkit/test_bad_input.py",
        "tests/toolkit/test_cutoff.py",
        "tests/toolkit/test_detaching.py",
        "tests/toolkit/test_gradients.py",
        "tests/toolkit/test_patterns.py",
        "tests/toolkit/test_selectors.py",
        "tests/toolkit/test_sharding.py",
        "tests/toolkit/test_testing.py",
        "tests/seethrough/test_checkpointing.py",
        "tests/seethrough/test_fake_reruns.py",
    ],
    "isolate/_seethrough.py": [
        "tests/toolkit/test_reachability.py",
        "tests/toolkit/test_audit_properties.py",
        "tests/toolkit/test_audits_in_use.py",
        "tests/toolkit/test_cutoff.py",
        "tests/toolkit/test_cutoff_reasons.py",
        "tests/toolkit/test_gradients.py",
        "tests/toolkit/test_sharding.py",
        "tests/seethrough/test_checkpointing.py",
        "tests/seethrough/test_fake_reruns.py",
    ],
    # Tree and Names name tensors for selectors, drift, plans, checks and leaving isolate.
    "isolate/_walker.py": [
        "tests/toolkit",
        "tests/spec/test_plan.py",
        "tests/spec/test_checks.py",
        "tests/interop/test_leave.py",
    ],
    "isolate/spec/thawing.py": ["tests/spec"],
    "isolate/spec/optimizers.py": ["tests/spec"],
    "isolate/spec/clock.py": ["tests/spec"],
    "isolate/spec/checks.py": ["tests/spec"],
    "isolate/spec/identity.py": ["tests/spec"],
    "isolate/spec/handle.py": ["tests/spec"],
}


# The sample's default draw; a different seed or k is a different sample (and folder cache).
SEED = 20261201
K = 3

# Test folders the sample adds to ``[tool.mutmut]``'s selection, so that the integrations
# it leaves out (peft, transformers) are traced too.
# The verdicts given by hand to the sample's survivors (see ``hand_verdicts``).
SAMPLE_VERDICTS = ".ci/mutation_sample.json"

SAMPLE_EXTRA_TESTS = ["tests/peft/test_spec.py", "tests/transformers"]

# The order in which the sample's modules are run (a prefix of a path; the rest follow).
PRIORITY = [
    "isolate/_sharding.py",
    "isolate/spec/thawing.py",
    "isolate/spec/optimizers.py",
    "isolate/spec/clock.py",
    "isolate/spec/checks.py",
    "isolate/spec/identity.py",
    "isolate/exposure.py",
    "isolate/spec/",
    "isolate/lightning/",
    "isolate/peft/",
    "isolate/transformers/",
    "isolate/certificates/",
    "isolate/interop/",
    "isolate/",
]


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


def mutant_names(module: str) -> list[str]:
    """The module's mutants, named as ``mutmut run`` and ``mutmut show`` take them
    (``isolate.spec.clock.x_ramp__mutmut_3``, ``isolate.cutoff.xǁCutOffǁ__str____mutmut_2``),
    generated in memory: nothing is written or run."""
    from mutmut.mutation.file_mutation import mutate_file_contents

    dotted = module.removesuffix(".py").replace("/", ".")
    generated = mutate_file_contents(module, (ROOT / module).read_text()).mutant_names
    return [f"{dotted}.{name}" for name in generated]


def count() -> dict[str, int]:
    """Mutants per module, generated in memory: nothing is written or run."""
    return {module: len(mutant_names(module)) for module in modules()}


def priority(module: str) -> tuple[int, str]:
    """Where ``module`` comes in the sample's run order (``PRIORITY``)."""
    rank = next(i for i, prefix in enumerate(PRIORITY) if module.startswith(prefix))
    return rank, module


def draw(k: int, seed: int) -> dict[str, list[str]]:
    """``k`` mutants of every module (all of them if it has fewer), in run order.

    Each module draws from its own generator, seeded with ``seed`` and its path, so the
    sample of one module does not change when another module gains or loses mutants.
    """
    digest = hashlib.sha256(str(seed).encode())
    for module in modules():
        digest.update(module.encode() + (ROOT / module).read_bytes())
    cache = WORK / "sample" / f"draw-{k}-{digest.hexdigest()[:16]}.json"
    if cache.exists():
        cached: dict[str, list[str]] = json.loads(cache.read_text())
        return cached
    sample = {}
    for module in sorted(modules(), key=priority):
        names = sorted(mutant_names(module))
        if names:
            rng = random.Random(f"{seed}:{module}")
            sample[module] = sorted(rng.sample(names, min(k, len(names))))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(sample, indent=1))
    return sample


def recorded(k: int, seed: int) -> dict[str, list[str]] | None:
    """The draw kept in ``SAMPLE_VERDICTS`` for this ``k`` and ``seed``, by module (a draw
    made on an older tree stays the sample its verdicts are about), or None."""
    hand = hand_verdicts()
    if hand.get("k") != k or hand.get("seed") != seed:
        return None
    sample: dict[str, list[str]] = {}
    for name in hand["drawn"]:
        parts = name.split(".")
        at = next(i for i, part in enumerate(parts) if part.startswith(("x_", "xǁ")))
        sample.setdefault("/".join(parts[:at]) + ".py", []).append(name)
    return dict(sorted(sample.items(), key=lambda item: priority(item[0])))


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``successes / n`` ((0, 1) if n is 0).

    >>> [round(x, 3) for x in wilson(3, 3)]
    [0.439, 1.0]
    """
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def workdir(module: str, *, only: list[str] | None = None, tests: list[str] | None = None) -> Path:
    """``.mutation/<module>/`` set up for mutmut: the package and the tests linked in, and a
    pyproject.toml whose ``[tool.mutmut]`` names this module and its tests (or, for the
    folder ``sample``, the modules ``only`` and the tests ``tests``)."""
    slug = module.removesuffix(".py").replace("/", ".")
    where = WORK / slug
    only = only if only is not None else [module]
    tests = tests if tests is not None else tests_for(module)
    where.mkdir(parents=True, exist_ok=True)
    for name in ("isolate", "tests", "experiments", "examples", "configs"):
        link = where / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)
    text = (ROOT / "pyproject.toml").read_text()
    text = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[)", "", text)
    text += (
        "\n[tool.mutmut]\n"
        'source_paths = ["isolate"]\n'
        f"only_mutate = {json.dumps(only)}\n"
        f"pytest_add_cli_args = {json.dumps(pytest_args())}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        'also_copy = ["experiments", "examples", "configs"]\n'
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


def mutmut(module: str, *args: str, where: Path | None = None, niceness: int = 5) -> int:
    """Run ``mutmut ARGS`` in the module's working folder (or in ``where``)."""
    binary = Path(sys.executable).with_name("mutmut")
    command = ["nice", "-n", str(niceness), str(binary), *args]
    cwd = where if where is not None else workdir(module)
    return subprocess.call(command, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def sample_dir(sample: dict[str, list[str]]) -> Path:
    """``.mutation/sample/``: every sampled module mutated, traced once against the package's
    whole test selection (``[tool.mutmut]``'s plus ``SAMPLE_EXTRA_TESTS``)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        selection = tomllib.load(f)["tool"]["mutmut"]["pytest_add_cli_args_test_selection"]
    return workdir("sample", only=sorted(sample), tests=[*selection, *SAMPLE_EXTRA_TESTS])


def sample_verdicts(sample: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """mutmut's verdict of each sampled mutant so far, by module ("not checked" if not run)."""
    from mutmut.stats import status_by_exit_code

    verdicts = {}
    for module, names in sample.items():
        meta = WORK / "sample" / "mutants" / f"{module}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        verdicts[module] = {name: status_by_exit_code[codes.get(name)] for name in names}
    return verdicts


def sample_table(sample: dict[str, list[str]], hand: dict[str, Any]) -> str:
    """A Markdown table of the sample: per module, mutmut's verdicts, the survivors' verdicts
    given by hand (``hand``, read from ``SAMPLE_VERDICTS``), and the 95% Wilson interval of
    the suite's kill rate over the mutants that ran and are not equivalent. A timeout counts
    as killed; a mutant that no test of mutmut's selection calls counts as survived, and so
    does one that mutmut saw killed only by a test added for it."""
    rows = [
        "| Module | Sampled | Killed | Survived | No tests | Timeout | Not run | Equivalent"
        " | Killed outside mutmut | Killed by added tests | Suite's kill rate (95% Wilson) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    keys = ("n", "killed", "survived", "no tests", "other", "not", "eq", "outside", "added")
    total = dict.fromkeys(keys, 0)
    for module, verdicts in sample_verdicts(sample).items():
        row = dict.fromkeys(keys, 0)
        row["n"] = len(verdicts)
        for name, status in verdicts.items():
            if status == "not checked":
                row["not"] += 1
                continue
            if status == "killed" and name in hand.get("added", {}):
                status = "survived"  # mutmut ran it after the test that kills it was added
            row[status if status in ("killed", "survived", "no tests") else "other"] += 1
            if status in ("survived", "no tests"):
                for key, verdict in (
                    ("eq", "equivalent"),
                    ("outside", "outside"),
                    ("added", "added"),
                ):
                    row[key] += name in hand.get(verdict, {})
        for key in keys:
            total[key] += row[key]
        rows.append(f"| `{module}` | {rate_cells(row)}")
    rows.append(f"| all | {rate_cells(total)}")
    return "\n".join(rows)


def rate_cells(row: dict[str, int]) -> str:
    """The cells of one row of ``sample_table`` after the module's name."""
    caught = row["killed"] + row["other"]
    n = caught + row["survived"] + row["no tests"] - row["eq"]
    low, high = wilson(caught, n)
    rate = f"{caught}/{n} [{low:.2f}, {high:.2f}]" if n else "-"
    counts = (row[k] for k in row)
    return " | ".join(map(str, counts)) + f" | {rate} |"


def hand_verdicts() -> dict[str, Any]:
    """The sampled survivors' verdicts given by hand (``SAMPLE_VERDICTS``): ``equivalent``
    (name -> why), ``added`` (name -> the test added that kills it), ``outside`` (name -> the
    test outside mutmut's selection that kills it: dynamo, child processes)."""
    path = ROOT / SAMPLE_VERDICTS
    return json.loads(path.read_text()) if path.exists() else {}


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
    sample = sub.add_parser("sample", help="run k mutants drawn from every module")
    sample.add_argument("modules", nargs="*", help="only these modules' draws (or prefixes)")
    sample.add_argument("--k", type=int, default=K, help=f"mutants per module (default {K})")
    sample.add_argument("--seed", type=int, default=SEED)
    sample.add_argument("--max-children", type=int, default=1)
    sample.add_argument("--list", action="store_true", help="print the names; run nothing")
    sample.add_argument("--pending", action="store_true", help="only those not run yet")
    sample.add_argument("--show", action="store_true", help="the diff of every sampled survivor")
    table = sub.add_parser("sample-table", help="per module: the sample's verdicts")
    table.add_argument("--k", type=int, default=K)
    table.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)

    if args.command in ("sample", "sample-table"):
        drawn = recorded(args.k, args.seed) or draw(args.k, args.seed)
        where = sample_dir(drawn)
        if args.command == "sample-table":
            print(f"seed {args.seed}, k {args.k}")
            print(sample_table(drawn, hand_verdicts()))
            return 0
        chosen = [
            name
            for module, names in drawn.items()
            if not args.modules or any(module.startswith(m) for m in args.modules)
            for name in names
        ]
        if args.pending:
            status_of = {n: v for vs in sample_verdicts(drawn).values() for n, v in vs.items()}
            chosen = [name for name in chosen if status_of[name] == "not checked"]
        if args.list:
            print("\n".join(chosen))
            return 0
        if args.show:
            for statuses in sample_verdicts(drawn).values():
                for name, status in statuses.items():
                    if name in chosen and status in ("survived", "no tests"):
                        mutmut("sample", "show", name, where=where)
            return 0
        run_args = ("run", "--max-children", str(args.max_children), *chosen)
        return mutmut("sample", *run_args, where=where, niceness=10)

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
