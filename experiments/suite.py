"""The suite: every variant with identical seeds and data order, then one report.

::

    python -m experiments suite                       # writes outputs/suite/report.md
    python -m experiments suite --quick               # a short version of every run
    python -m experiments suite --ddp                 # every run under DDP, 2 CPU processes

Each variant is one ``fit`` of ``python -m experiments`` with its ``configs/<variant>.yaml``
(plus ``configs/presets/quick.yaml`` with ``--quick``, ``configs/presets/ddp.yaml`` with
``--ddp``, and any ``--config``), measured by :class:`~experiments.recording.Recorder`. The
baseline runs first and saves its trunk gradient of every step; every other
:class:`~experiments.model.IsolationNet` run compares its own with it, step by step. Runs go
in-process, or, when the strategy is DDP (which relaunches the command line in new
processes), each as ``python -m experiments fit ...`` in a subprocess.

The report (``report.md``, ``results.json`` and PNG plots, see :mod:`experiments.report`)
lists every check with its expected and observed value; the command exits with status 1 if a
check fails. Two suites with the same options write the same report, byte for byte: wall-clock
times go to ``timings.json`` (and the console) instead, and the data root is shown relative to
the working directory when it lies below or beside it (:func:`experiments.cli.display_path`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from experiments.cli import (
    CONFIGS,
    REPO,
    cli_main,
    default_data_root,
    display_path,
    has_test_split,
    quiet_known_noise,
)
from experiments.data import ENV_DATA_ROOT, MNISTDataModule, TestSplitOnlyWarning
from experiments.recording import GRADS_FILE, RUN_FILE, TRUNK_FILE, load_run, summary_line

__all__ = ["VARIANTS", "Variant", "evaluate_checks", "main", "run_suite"]

PRESETS = CONFIGS / "presets"
BASELINE = "baseline"
TIMINGS_FILE = "timings.json"


@dataclass(frozen=True)
class Variant:
    """One run of the suite.

    Attributes:
        name: the run's name, also its config file ``configs/<name>.yaml``.
        role: what the run shows, one line for the report.
        expect_error: the exception type that must stop the run, if any.
    """

    name: str
    role: str
    expect_error: str | None = None

    @property
    def config(self) -> Path:
        return CONFIGS / f"{self.name}.yaml"


VARIANTS: tuple[Variant, ...] = (
    Variant(BASELINE, "no auxiliary branch: the reference"),
    Variant("detached", "linear probes (digit, ink) behind isolate.Detached"),
    Variant("attached", "the digit probe attached plainly (negative control)"),
    Variant(
        "inplace_guarded",
        "branch editing its input in place, behind isolate.Detached",
        expect_error="InplaceModificationError",
    ),
    Variant("inplace_cloned", "the editing branch fed a copy: Detached(inplace='copy')"),
    Variant("frozen_trunk", "IsolationCallback(freeze=['trunk'], bn='eval'): only the head trains"),
    Variant("frozen_trunk_naive", "trunk.requires_grad_(False) alone (negative control)"),
    Variant("reversal", "ink adversary behind isolate.GradientScale(-0.1), and an ink probe"),
    Variant("simsiam", "SimSiam with isolate.stop_gradient"),
    Variant("simsiam_no_stopgrad", "SimSiam without the stop-gradient (collapses)"),
)


# --------------------------------------------------------------------------------------------
# Running


def _is_ddp(configs: Sequence[Path], overrides: Sequence[str]) -> bool:
    strategy = ""
    for path in configs:
        loaded = yaml.safe_load(path.read_text()) or {}
        value = (loaded.get("trainer") or {}).get("strategy")
        if value is not None:
            strategy = str(value)
    for arg in overrides:
        if arg.startswith("--trainer.strategy="):
            strategy = arg.partition("=")[2]
    return strategy.startswith("ddp")


def _run_in_process(args: list[str]) -> None:
    with warnings.catch_warnings():
        # The suite prints where the data came from once, before the first run.
        warnings.simplefilter("ignore", TestSplitOnlyWarning)
        cli_main(args)


def _run_subprocess(args: list[str], log: Path, threads: int | None) -> int:
    env = dict(os.environ)
    # A fresh launch: Lightning would take these for a process it is meant to join.
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if threads is not None:
        # Else Lightning gives each process cores // processes threads: results would depend
        # on the machine's core count.
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with log.open("w") as out:
        # The working directory stays the suite's: the data root may be relative to it.
        proc = subprocess.run(
            [sys.executable, "-m", "experiments", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    return proc.returncode


def run_variant(
    variant: Variant,
    run_dir: Path,
    *,
    presets: Sequence[Path],
    overrides: Sequence[str],
    reference: Path | None,
    save_grads: bool,
    progress_bar: bool,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run one variant into ``run_dir`` and return its record (``run.json``).

    A run that stops with an exception still has a record (status ``"error"``): the suite
    reports it and carries on. ``threads`` sets ``OMP_NUM_THREADS`` for runs in a subprocess
    (DDP); in-process runs use the caller's ``torch.get_num_threads()``.
    """
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    configs = [variant.config, *presets]
    args = ["fit"]
    for path in configs:
        args += ["--config", str(path)]
    args += [
        f"--trainer.default_root_dir={run_dir}",
        f"--trainer.enable_progress_bar={str(progress_bar).lower()}",
        f"--record.output={run_dir}",
        f"--record.name={variant.name}",
        "--record.verbose=false",
        f"--record.progress={str(not progress_bar).lower()}",
        f"--record.save_grads={str(save_grads).lower()}",
        *overrides,
    ]
    if reference is not None:
        args.append(f"--record.reference={reference}")
    (run_dir / "command.txt").write_text("python -m experiments " + " ".join(args) + "\n")
    crash: str | None = None
    if _is_ddp(configs, overrides):
        code = _run_subprocess(args, run_dir / "log.txt", threads)
        if code != 0 and not (run_dir / RUN_FILE).exists():
            crash = f"exit status {code}; see {run_dir / 'log.txt'}"
    else:
        try:
            _run_in_process(args)
        except Exception as exc:  # recorded in run.json by the Recorder; reported, not raised
            if not (run_dir / RUN_FILE).exists():
                crash = f"{type(exc).__name__}: {exc}"
    if crash is not None:
        return {
            "name": variant.name,
            "status": "error",
            "error": {"type": "crash", "message": crash},
        }
    return load_run(run_dir)


def _prepare_data(
    data_root: str | None, cache_dir: str | None, download: bool | None, dataset: str = "mnist"
) -> dict[str, Any]:
    """Find (or download) the data once, so the runs never try the network again."""
    dm = MNISTDataModule(
        dataset=dataset,  # type: ignore[arg-type]
        data_root=data_root,
        cache_dir=cache_dir,
        download=download,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TestSplitOnlyWarning)
        dm.prepare_data()
        dm.setup()
    return {
        "note": dm.source_note,
        "split": dm.split_info,
        "data_root": dm.data_root.as_posix(),
    }


def _data_root(
    data_root: str | None, download: bool | None, dataset: str = "mnist"
) -> tuple[str | None, bool | None]:
    """The data root to pass to every run, as shown in the report, and the ``download`` to use.

    The root is relative to the working directory when it lies below or beside it, so the
    datamodule's notes, and with them the report, name no folder of this machine.
    """
    root = data_root or os.environ.get(ENV_DATA_ROOT) or default_data_root()
    if root is None:
        return None, download  # the datamodule's own default, a relative "data"
    if download is None and has_test_split(root, dataset):
        # As in the CLI: data on disk are used as they are; --download fetches the rest.
        download = False
    return display_path(root), download


def run_suite(
    output: Path,
    *,
    quick: bool = False,
    ddp: bool = False,
    configs: Sequence[Path] = (),
    overrides: Sequence[str] = (),
    only: Sequence[str] | None = None,
    data_root: str | None = None,
    cache_dir: str | None = None,
    download: bool | None = None,
    threads: int | None = 1,
    progress_bar: bool = False,
    keep_grads: bool = False,
    dataset: str = "mnist",
) -> dict[str, Any]:
    """Run the variants and write the report into ``output``; returns the results.

    Args:
        output: the folder of the report; each run writes into ``output/runs/<name>``.
        quick: add ``configs/presets/quick.yaml`` to every run.
        ddp: add ``configs/presets/ddp.yaml`` to every run (each run then goes in a
            subprocess of 2 DDP processes).
        configs: more config files added to every run, after the presets.
        overrides: more ``--key=value`` arguments for every run.
        only: run only these variants (the baseline always runs when another
            :class:`~experiments.model.IsolationNet` variant does).
        data_root: the data root; default: see :func:`experiments.cli.default_data_root`.
        cache_dir: the datamodule's cache folder.
        download: the datamodule's ``download`` for the one preparation of the data before
            the runs (which then never download). ``None``: ``False`` when the data root
            holds the official test split already (``../shared/data`` holds only that, on
            purpose), else try a download.
        threads: ``torch.set_num_threads`` for in-process runs, restored afterwards, and
            ``OMP_NUM_THREADS`` for runs in subprocesses; ``None`` keeps torch's setting (which
            depends on the machine's core count, and so may the last bits of the results).
            One thread is the default: the network is small, and a second thread gains little
            when the machine is idle but costs several times over when other work shares the
            cores.
        progress_bar: show Lightning's progress bar (else a line per validation).
        keep_grads: keep the baseline's per-step gradients (``grads.pt``, tens of MB).
        dataset: ``"mnist"`` or ``"fashion_mnist"`` (Debian's ``dataset-fashion-mnist``
            package, or torchvision's download, provides the latter).

    Returns:
        The results that ``results.json`` holds. Wall-clock times are not among them, so that
        two suites with the same options write the same report: they are printed, and written
        to ``timings.json``.
    """
    from experiments import report

    start = time.perf_counter()
    quiet_known_noise()
    # Every run prints "Seed set to 0"; the report states the seed once.
    logging.getLogger("lightning_fabric.utilities.seed").setLevel(logging.WARNING)
    output = output.resolve()
    runs = output / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    variants = _select(only)
    root, download = _data_root(data_root, download, dataset)
    data = _prepare_data(root, cache_dir, download, dataset)
    print(f"suite: {len(variants)} runs into {output}", flush=True)
    print(f"data: {data['note']}", flush=True)
    builtin = [PRESETS / "quick.yaml"] * quick + [PRESETS / "ddp.yaml"] * ddp
    presets = [*builtin, *(Path(c).resolve() for c in configs)]
    shown_presets = [_relative(p) for p in (*builtin, *map(Path, configs))]
    # Runs share the suite's working directory (subprocesses too), so a relative root holds.
    data_args = [
        f"--data.data_root={data['data_root']}",
        "--data.download=false",
        f"--data.dataset={dataset}",
    ]
    if cache_dir is not None:
        data_args.append(f"--data.cache_dir={Path(cache_dir).resolve()}")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    records: dict[str, dict[str, Any]] = {}
    timings: dict[str, dict[str, float | None]] = {}
    try:
        for i, variant in enumerate(variants, 1):
            print(f"[{i}/{len(variants)}] {variant.name}: {variant.role}", flush=True)
            is_net = _is_isolation_net(variant)
            reference = None
            if is_net and variant.name != BASELINE:
                candidate = runs / BASELINE / GRADS_FILE
                reference = candidate if candidate.exists() else None
            run_start = time.perf_counter()
            record = run_variant(
                variant,
                runs / variant.name,
                presets=presets,
                overrides=[*data_args, *overrides],
                reference=reference,
                save_grads=is_net and variant.name == BASELINE,
                progress_bar=progress_bar,
                threads=threads,
            )
            timings[variant.name] = {
                "fit": record.get("seconds"),  # measured by the Recorder, from fit start to end
                "run": time.perf_counter() - run_start,  # with building the model and trainer
            }
            expected = ""
            if variant.expect_error is not None:
                hit = record.get("error", {}).get("type") == variant.expect_error
                expected = " (expected)" if hit else f" (expected {variant.expect_error})"
            print(f"    {summary_line(record)}{expected}", flush=True)
            record.pop("seconds", None)  # in timings.json, not in the report
            records[variant.name] = record
    finally:
        torch.set_num_threads(previous_threads)
    results = {
        "setup": {
            "quick": quick,
            "ddp": ddp,
            "presets": shown_presets,
            "overrides": list(overrides),
            "threads": threads,
            "torch": torch.__version__,
            "lightning": _lightning_version(),
            "data": data,
        },
        "variants": {v.name: {"role": v.role, "expect_error": v.expect_error} for v in variants},
        "runs": records,
        "trunk_vs_baseline": _compare_trunks(runs, records),
    }
    results["checks"] = evaluate_checks(results)
    written = report.write_report(results, output)
    if not keep_grads:
        (runs / BASELINE / GRADS_FILE).unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    (output / TIMINGS_FILE).write_text(
        json.dumps({"seconds": seconds, "runs": timings}, indent=1) + "\n"
    )
    failed = [c for c in results["checks"] if not c["ok"]]
    print(
        f"suite: {len(results['checks']) - len(failed)}/{len(results['checks'])} checks "
        f"passed in {seconds:.0f} s; report: {written[0]}",
        flush=True,
    )
    for check in failed:
        print(f"  FAILED {check['variant']}: {check['check']}: {check['observed']}", flush=True)
    return results


def _select(only: Sequence[str] | None) -> list[Variant]:
    if not only:
        return list(VARIANTS)
    known = {v.name for v in VARIANTS}
    unknown = sorted(set(only) - known)
    if unknown:
        raise SystemExit(f"suite: unknown variants {unknown}; choose from {sorted(known)}")
    wanted = set(only)
    if any(_is_isolation_net(v) for v in VARIANTS if v.name in wanted):
        wanted.add(BASELINE)
    return [v for v in VARIANTS if v.name in wanted]


def _is_isolation_net(variant: Variant) -> bool:
    loaded = yaml.safe_load(variant.config.read_text()) or {}
    return (loaded.get("model") or {}).get("class_path") == "experiments.model.IsolationNet"


def _relative(path: Path) -> str:
    """A config file relative to the repository, else as :func:`display_path` shows it."""
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return display_path(path)


def _lightning_version() -> str:
    import pytorch_lightning as pl

    return pl.__version__


def _compare_trunks(runs: Path, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each run's final trunk (weights and BatchNorm buffers) against the baseline's."""
    reference_path = runs / BASELINE / TRUNK_FILE
    if not reference_path.exists():
        return {}
    reference = torch.load(reference_path)
    out: dict[str, Any] = {}
    for name in records:
        path = runs / name / TRUNK_FILE
        if name == BASELINE or not path.exists():
            continue
        state = torch.load(path)
        deltas = {
            key: (
                0.0
                if torch.equal(value, state[key])
                else float((value.double() - state[key].double()).abs().max())
            )
            for key, value in reference.items()
            if key in state
        }
        out[name] = {
            "bitwise_equal": set(state) == set(reference)
            and all(d == 0.0 for d in deltas.values()),
            "max_delta": max(deltas.values(), default=0.0),
            "tensors": len(deltas),
        }
    return out


# --------------------------------------------------------------------------------------------
# Checks


def _check(variant: str, check: str, expected: str, observed: str, ok: bool) -> dict[str, Any]:
    return {
        "variant": variant,
        "check": check,
        "expected": expected,
        "observed": observed,
        "ok": ok,
    }


def _deltas(record: dict[str, Any]) -> list[float | None]:
    return list(record.get("grad_delta") or [])


def evaluate_checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The suite's claims, each with the expected and the observed value."""
    runs: dict[str, dict[str, Any]] = results["runs"]
    trunks: dict[str, Any] = results.get("trunk_vs_baseline", {})
    checks: list[dict[str, Any]] = []
    base_steps = runs.get(BASELINE, {}).get("steps")

    def ran(name: str) -> dict[str, Any] | None:
        record = runs.get(name)
        if record is None:
            return None
        expect = results["variants"][name]["expect_error"]
        if record.get("status") != "ok" and expect is None:
            error = record.get("error", {})
            checks.append(
                _check(
                    name,
                    "the run finishes",
                    "status ok",
                    f"{error.get('type')}: {str(error.get('message'))[:200]}",
                    False,
                )
            )
            return None
        return record

    def reaches(name: str, record: dict[str, Any], branch: str, expect_all: bool) -> None:
        reach = record.get("audit", {}).get(branch, {}).get("trunk")
        observed = f"{reach[0]}/{reach[1]}" if reach else "not audited"
        if expect_all:
            claim, expected = f"the {branch} loss reaches the trunk (graph audit)", "all"
            ok = bool(reach) and reach[0] == reach[1] > 0
        else:
            claim, expected = f"the {branch} loss reaches no trunk parameter (graph audit)", "0"
            ok = bool(reach) and reach[0] == 0
        checks.append(_check(name, claim, f"{expected} trunk parameters", observed, ok))

    def learns(name: str, record: dict[str, Any], output: str) -> None:
        test, chance = record.get("test", {}), record.get("chance", {})
        acc, floor = test.get(f"acc/{output}"), chance.get(f"acc/{output}")
        what = "the head alone" if output == "main" else f"the {output} branch"
        checks.append(
            _check(
                name,
                f"{what} still learns",
                f"test accuracy above chance ({_fmt(floor)})",
                _fmt(acc),
                acc is not None and floor is not None and acc > floor,
            )
        )

    def isolated(name: str) -> None:
        record = ran(name)
        if record is None:
            return
        deltas = _deltas(record)
        zero = [d for d in deltas if d == 0.0]
        checks.append(
            _check(
                name,
                "trunk gradient equals the baseline's at every step",
                f"max|Δ| == 0.0 at all {base_steps} steps",
                f"{len(zero)}/{len(deltas)} steps exactly 0.0, max|Δ| = {_max(deltas)}",
                bool(deltas) and len(zero) == len(deltas) == base_steps,
            )
        )
        trunk = trunks.get(name, {})
        checks.append(
            _check(
                name,
                "final trunk weights and BatchNorm statistics equal the baseline's",
                "bitwise equal",
                f"bitwise equal: {trunk.get('bitwise_equal')}, max|Δ| = {trunk.get('max_delta')}",
                trunk.get("bitwise_equal") is True,
            )
        )
        for branch, spec in _branches(record).items():
            reaches(name, record, branch, expect_all=False)
            if spec.get("target") == "digit":
                learns(name, record, branch)

    def leaks(name: str) -> None:
        record = ran(name)
        if record is None:
            return
        deltas = _deltas(record)
        positive = [d for d in deltas if d is not None and d > 0.0]
        checks.append(
            _check(
                name,
                "trunk gradient differs from the baseline's at every step",
                f"max|Δ| > 0 at all {base_steps} steps",
                f"{len(positive)}/{len(deltas)} steps > 0, smallest {_min(deltas)}",
                bool(deltas) and len(positive) == len(deltas) == base_steps,
            )
        )
        for branch, spec in _branches(record).items():
            reaches(name, record, branch, expect_all=spec.get("connect") in _REACHING)

    if BASELINE in runs:
        record = ran(BASELINE)
        if record is not None:
            reach = record.get("audit", {}).get("main", {}).get("trunk")
            checks.append(
                _check(
                    BASELINE,
                    "the main loss reaches every trunk parameter (graph audit)",
                    "all trunk parameters",
                    f"{reach[0]}/{reach[1]}" if reach else "not audited",
                    bool(reach) and reach[0] == reach[1] > 0,
                )
            )
    if "detached" in runs:
        isolated("detached")
    if "attached" in runs:
        leaks("attached")
    if "inplace_guarded" in runs:
        record = runs["inplace_guarded"]
        error = record.get("error", {})
        message = str(error.get("message", ""))
        checks.append(
            _check(
                "inplace_guarded",
                "stops at the first step with the guard's error naming the branch",
                "InplaceModificationError mentioning Detached(editor)",
                f"{error.get('type', record.get('status'))} after {record.get('steps')} steps: "
                f"{message[:120]}",
                error.get("type") == "InplaceModificationError"
                and "Detached(editor)" in message
                and record.get("steps") == 0,
            )
        )
    if "inplace_cloned" in runs:
        isolated("inplace_cloned")
    for name, policy in (("frozen_trunk", "isolate"), ("frozen_trunk_naive", "naive")):
        record = ran(name) if name in runs else None
        if record is None:
            continue
        drift = record.get("drift", {})
        params, buffers = drift.get("parameters", []), drift.get("buffers", [])
        counters = drift.get("counters", [])
        checks.append(
            _check(
                name,
                "trunk parameters never move",
                "max|Δ| == 0.0 at every step",
                f"max|Δ| = {_max(params)} over {len(params)} steps",
                bool(params) and all(d == 0.0 for d in params),
            )
        )
        if policy == "isolate":
            checks.append(
                _check(
                    name,
                    "BatchNorm running statistics and num_batches_tracked never move",
                    "max|Δ| == 0.0 at every step",
                    f"max|Δ| = {_max(buffers)} (statistics), {_max(counters)} (counters) "
                    f"over {len(buffers)} steps",
                    bool(buffers)
                    and all(d == 0.0 for d in buffers)
                    and all(d == 0.0 for d in counters),
                )
            )
            learns(name, record, "main")
        else:
            checks.append(
                _check(
                    name,
                    "BatchNorm running statistics move anyway (why bn='eval' exists)",
                    "max|Δ| > 0",
                    f"max|Δ| = {_max(buffers)}",
                    bool(buffers) and max(buffers) > 0.0,
                )
            )
    if "reversal" in runs:
        leaks("reversal")
    if "simsiam" in runs and "simsiam_no_stopgrad" in runs:
        with_sg, without = ran("simsiam"), ran("simsiam_no_stopgrad")
        if with_sg is not None and without is not None:
            std_sg = with_sg["train"]["z_std"][-1]
            std_no = without["train"]["z_std"][-1]
            reference = with_sg["train"]["z_std_ref"][-1]
            checks.append(
                _check(
                    "simsiam",
                    "without stop-gradient the output collapses",
                    "final std without < half the final std with stop-gradient",
                    f"with {std_sg:.4f}, without {std_no:.4f} (1/sqrt(dim) = {reference:.4f})",
                    std_no < 0.5 * std_sg,
                )
            )
    return checks


# Connections through which a branch's loss reaches the trunk.
_REACHING = ("attached", "cloned", "reversal")


def _branches(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The run's branches by name, as configured."""
    specs = (record.get("hparams") or {}).get("branches") or []
    return {spec["name"]: spec for spec in specs if isinstance(spec, dict)}


def _number(value: float) -> str:
    return "0.0" if value == 0.0 else f"{value:.3g}"


def _max(values: Sequence[float | None]) -> str:
    numbers = [v for v in values if v is not None]
    return _number(max(numbers)) if numbers else "n/a"


def _min(values: Sequence[float | None]) -> str:
    numbers = [v for v in values if v is not None]
    return _number(min(numbers)) if numbers else "n/a"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


# --------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments suite",
        description="Run every variant with identical seeds and data order and write the "
        "report (Markdown, JSON, PNG) into --output.",
    )
    parser.add_argument("--output", type=Path, default=Path("outputs/suite"))
    parser.add_argument("--quick", action="store_true", help="add configs/presets/quick.yaml")
    parser.add_argument(
        "--ddp", action="store_true", help="add configs/presets/ddp.yaml (2 CPU processes)"
    )
    parser.add_argument(
        "--config", action="append", default=[], type=Path, help="another preset for every run"
    )
    parser.add_argument("--only", help="comma-separated variant names")
    parser.add_argument(
        "--dataset",
        choices=["mnist", "fashion_mnist"],
        default="mnist",
        help="the same experiments on Fashion-MNIST with fashion_mnist",
    )
    parser.add_argument("--data-root", help="default: ISOLATE_DATA_ROOT, else ../shared/data")
    parser.add_argument("--cache-dir", help="the datamodule's cache folder")
    parser.add_argument(
        "--download",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="download MNIST if the full dataset is missing (default: only when the data "
        "root lacks even the test split)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--progress-bar",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Lightning's progress bar (default: when stderr is a terminal)",
    )
    parser.add_argument("--keep-grads", action="store_true", help="keep the baseline's grads.pt")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments suite``; returns 1 if a check failed."""
    options, overrides = _parser().parse_known_args(argv)
    bad = [arg for arg in overrides if not arg.startswith("--") or "=" not in arg]
    if bad:
        _parser().error(f"unrecognized arguments {bad}; run options are passed as --key=value")
    progress_bar = options.progress_bar
    if progress_bar is None:
        progress_bar = sys.stderr.isatty()
    results = run_suite(
        options.output,
        quick=options.quick,
        ddp=options.ddp,
        configs=options.config,
        overrides=overrides,
        only=options.only.split(",") if options.only else None,
        data_root=options.data_root,
        cache_dir=options.cache_dir,
        download=options.download,
        threads=options.threads,
        progress_bar=progress_bar,
        keep_grads=options.keep_grads,
        dataset=options.dataset,
    )
    return 0 if all(check["ok"] for check in results["checks"]) else 1
