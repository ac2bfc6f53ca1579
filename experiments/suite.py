"""The suite: every variant with identical seeds and data order, then one report.

::

    python -m experiments suite                       # writes outputs/suite/report.md
    python -m experiments suite --quick               # a short version of every run
    python -m experiments suite --ddp                 # every run under DDP, 2 CPU processes
    python -m experiments suite --fsdp                # every run under FSDP2, 2 CPU processes

Each variant is one ``configs/<variant>.yaml`` (see :mod:`experiments.variants`: its
``variant:`` block declares what it claims and how it is reported), run as one ``fit`` of
``python -m experiments`` (plus ``configs/presets/quick.yaml`` with ``--quick``,
``configs/presets/ddp.yaml`` with ``--ddp``, ``configs/presets/fsdp.yaml`` with ``--fsdp``, and
any ``--config``), measured by :class:`~experiments.recording.Recorder`. The run others are
compared with runs first and saves its trunk gradient of every step (``grads.pt``); every run
that declares ``compare_with`` compares its own with it, step by step. Runs go in-process, or,
when the run has more than one device (DDP and FSDP2 relaunch the command line in new
processes), each as ``python -m experiments fit ...`` in a subprocess. Under
``ModelParallelStrategy`` (FSDP2) a variant whose model has no ``configure_model`` to shard it
is not run: the report lists it as skipped, with that reason, and its claims are not checked.

Every run's ``command.txt`` holds the command that repeats it, from the suite's working
directory, with the suite's thread count (``--threads``); the files it reads (``grads.pt``) are
kept. The report (``report.md``, ``results.json`` and PNG plots, see :mod:`experiments.report`)
lists every check with its expected and observed value; the command exits with status 1 if a
check fails. Two suites with the same options on the same machine write the same report, byte
for byte: wall-clock times go to ``timings.json`` (and the console) instead, and the data root
is shown relative to the working directory when it lies below or beside it
(:func:`experiments.cli.display_path`).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from experiments.claims import evaluate_checks
from experiments.cli import cli_main, display_path, quiet_known_noise, resolve_data_root
from experiments.data import MNISTDataModule, TestSplitOnlyWarning
from experiments.parsing import BASE_PRESET, CONFIGS, PROG, REPO, suite_parser
from experiments.recording import GRADS_FILE, RUN_FILE, TRUNK_FILE, load_run, summary_line
from experiments.variants import Variant, discover, select

__all__ = ["evaluate_checks", "main", "run_suite", "run_variant"]

PRESETS = CONFIGS / "presets"
TIMINGS_FILE = "timings.json"


# --------------------------------------------------------------------------------------------
# Running


def _setting(configs: Sequence[Path], overrides: Sequence[str], key: str) -> Any:
    """The value of ``trainer.<key>`` that the last config or override giving it sets."""
    value: Any = None
    for path in configs:
        loaded = yaml.safe_load(path.read_text()) or {}
        value = (loaded.get("trainer") or {}).get(key, value)
    for arg in overrides:
        if arg.startswith(f"--trainer.{key}="):
            value = yaml.safe_load(arg.partition("=")[2])
    return value


def _strategy(configs: Sequence[Path], overrides: Sequence[str]) -> str:
    """The strategy's name as written (``ddp``), or its class's for a ``class_path``."""
    value = _setting(configs, overrides, "strategy")
    if isinstance(value, dict):
        return str(value.get("class_path", "")).rpartition(".")[2]
    return "" if value is None else str(value)


def _launches_processes(configs: Sequence[Path], overrides: Sequence[str]) -> bool:
    devices = _setting(configs, overrides, "devices")
    return _strategy(configs, overrides).startswith("ddp") or (
        isinstance(devices, int) and devices > 1
    )


def _unshardable(variant: Variant, strategy: str) -> str | None:
    """Why ``variant`` cannot run under ``strategy``, or ``None``.

    ``ModelParallelStrategy`` refuses a LightningModule without its own ``configure_model``
    (which shards it); such a run would only stop with Lightning's error.
    """
    if strategy != "ModelParallelStrategy":
        return None
    import importlib

    import pytorch_lightning as pl

    loaded = yaml.safe_load(variant.config.read_text()) or {}
    class_path = str((loaded.get("model") or {}).get("class_path", ""))
    module, _, name = class_path.rpartition(".")
    model = getattr(importlib.import_module(module), name, None) if module else None
    if isinstance(model, type) and model.configure_model is not pl.LightningModule.configure_model:
        return None
    return (
        f"{name or 'its model'} has no configure_model to shard it with fully_shard, which "
        f"ModelParallelStrategy requires"
    )


def _run_in_process(args: list[str]) -> None:
    with warnings.catch_warnings():
        # The suite prints where the data came from once, before the first run.
        warnings.simplefilter("ignore", TestSplitOnlyWarning)
        cli_main(args)


def _run_subprocess(args: list[str], log: Path) -> int:
    env = dict(os.environ)
    # A fresh launch: Lightning would take these for a process it is meant to join.
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
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
    threads: int | None = 1,
) -> dict[str, Any]:
    """Run one variant into ``run_dir`` and return its record (``run.json``).

    The command is written to ``run_dir/command.txt`` first, as it can be run again from the
    same working directory; its paths are shown relative to that directory where they lie
    below or beside it. A run that stops with an exception still has a record (status
    ``"error"``): the suite reports it and carries on. ``threads`` goes into the command
    (``--threads``), in-process and in a subprocess alike.
    """
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    configs = [variant.config, *presets]
    args = ["fit"]
    for path in configs:
        args += ["--config", display_path(path)]
    args += [
        f"--threads={'null' if threads is None else threads}",
        f"--trainer.default_root_dir={display_path(run_dir)}",
        f"--trainer.enable_progress_bar={str(progress_bar).lower()}",
        f"--record.output={display_path(run_dir)}",
        f"--record.name={variant.name}",
        "--record.verbose=false",
        f"--record.progress={str(not progress_bar).lower()}",
        f"--record.save_grads={str(save_grads).lower()}",
        f"--record.certify={str(variant.certify).lower()}",
        *overrides,
    ]
    if reference is not None:
        args.append(f"--record.reference={display_path(reference)}")
    command = " ".join(shlex.quote(arg) for arg in [*PROG.split(), *args])
    (run_dir / "command.txt").write_text(command + "\n")
    crash: str | None = None
    if _launches_processes(configs, overrides):
        code = _run_subprocess(args, run_dir / "log.txt")
        if code != 0 and not (run_dir / RUN_FILE).exists():
            crash = f"exit status {code}; see {display_path(run_dir / 'log.txt')}"
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
        "data_root": Path(dm.data_root).as_posix(),
    }


def run_suite(
    output: Path,
    *,
    quick: bool = False,
    ddp: bool = False,
    fsdp: bool = False,
    configs: Sequence[Path] = (),
    overrides: Sequence[str] = (),
    only: Sequence[str] | None = None,
    data_root: str | None = None,
    cache_dir: str | None = None,
    download: bool | None = None,
    threads: int | None = 1,
    progress_bar: bool = False,
    dataset: str = "mnist",
    variants: Sequence[Variant] | None = None,
) -> dict[str, Any]:
    """Run the variants and write the report into ``output``; returns the results.

    Args:
        output: the folder of the report; each run writes into ``output/runs/<name>``.
        quick: add ``configs/presets/quick.yaml`` to every run.
        ddp: add ``configs/presets/ddp.yaml`` to every run (each run then goes in a
            subprocess of 2 DDP processes).
        fsdp: add ``configs/presets/fsdp.yaml`` to every run (FSDP2 through
            ``ModelParallelStrategy``; each run goes in a subprocess of 2 processes). A
            variant whose model cannot be sharded is skipped, with the reason in the report.
        configs: more config files added to every run, after the presets.
        overrides: more ``--key=value`` arguments for every run.
        only: run only these variants, and the runs they are compared with.
        data_root: the data root; default: see :func:`experiments.cli.resolve_data_root`.
        cache_dir: the datamodule's cache folder.
        download: the datamodule's ``download`` for the one preparation of the data before
            the runs (which then never download). ``None``: ``False`` when the data root
            holds the official test split already (``../shared/data`` holds only that, on
            purpose), else try a download.
        threads: torch threads of every run (``--threads`` of its command, restored here
            afterwards); ``None`` keeps torch's setting, which depends on the machine's core
            count, and so may the last bits of the results. One thread is the default, as
            for ``fit``: the network is small, and a second thread gains little when the
            machine is idle but costs several times over when other work shares the cores.
        progress_bar: show Lightning's progress bar (else a line per validation).
        dataset: ``"mnist"`` or ``"fashion_mnist"`` (Debian's ``dataset-fashion-mnist``
            package, or torchvision's download, provides the latter).
        variants: the variants to choose from; default: every ``configs/*.yaml``
            (:func:`experiments.variants.discover`).

    Returns:
        The results that ``results.json`` holds. Wall-clock times are not among them, so that
        two suites with the same options write the same report: they are printed, and written
        to ``timings.json``.

    Raises:
        ValueError: ``only`` names an unknown variant, or both ``ddp`` and ``fsdp`` are set.
    """
    if ddp and fsdp:
        raise ValueError("ddp and fsdp are two strategies: choose one")
    start = time.perf_counter()
    _quiet()
    chosen = select(discover() if variants is None else variants, only)
    output = output.resolve()
    runs = output / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    root, download = resolve_data_root(data_root, download, dataset)
    data = _prepare_data(root, cache_dir, download, dataset)
    print(f"suite: {len(chosen)} runs into {display_path(output)}", flush=True)
    print(f"data: {data['note']}", flush=True)
    chosen_presets = (("quick", quick), ("ddp", ddp), ("fsdp", fsdp))
    builtin = [PRESETS / f"{name}.yaml" for name, on in chosen_presets if on]
    presets = [*builtin, *(Path(c).resolve() for c in configs)]
    strategy = _strategy([BASE_PRESET, *presets], overrides)
    every_run = [*_data_args(data, dataset, cache_dir), *overrides]
    records, skipped, timings = _run_all(
        chosen, runs, strategy, presets, every_run, threads=threads, progress_bar=progress_bar
    )
    results: dict[str, Any] = {
        "setup": {
            "quick": quick,
            "ddp": ddp,
            "fsdp": fsdp,
            "strategy": strategy or "auto",
            "devices": _setting([BASE_PRESET, *presets], overrides, "devices"),
            "presets": [_relative(p) for p in (*builtin, *map(Path, configs))],
            "overrides": list(overrides),
            "threads": threads,
            **_versions(),
            "data": data,
        },
        "variants": {v.name: v.declaration() for v in chosen},
        "runs": records,
        "skipped": skipped,
        "trunk_vs_reference": _compare_trunks(runs, chosen, records),
    }
    results["checks"] = evaluate_checks(results)
    _finish(results, output, time.perf_counter() - start, timings)
    return results


def _quiet() -> None:
    quiet_known_noise()
    # Every run prints "Seed set to 0"; the report states the seed once.
    logging.getLogger("lightning_fabric.utilities.seed").setLevel(logging.WARNING)


def _data_args(data: Mapping[str, Any], dataset: str, cache_dir: str | None) -> list[str]:
    """The data options of every run: the prepared root, no download."""
    # Runs share the suite's working directory (subprocesses too), so a relative root holds.
    args = [
        f"--data.data_root={data['data_root']}",
        "--data.download=false",
        f"--data.dataset={dataset}",
    ]
    if cache_dir is not None:
        args.append(f"--data.cache_dir={display_path(cache_dir)}")
    return args


def _run_all(
    chosen: Sequence[Variant],
    runs: Path,
    strategy: str,
    presets: Sequence[Path],
    overrides: Sequence[str],
    *,
    threads: int | None,
    progress_bar: bool,
) -> tuple[dict[str, dict[str, Any]], dict[str, str], dict[str, dict[str, float | None]]]:
    """Run ``chosen`` in order (skipping what ``strategy`` cannot run); the records, the
    skipped runs with why, and the timings. Torch's threads and ``OMP_NUM_THREADS`` are
    restored afterwards."""
    previous_threads = torch.get_num_threads()
    previous_omp = os.environ.get("OMP_NUM_THREADS")
    records: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    timings: dict[str, dict[str, float | None]] = {}
    try:
        for i, variant in enumerate(chosen, 1):
            print(f"[{i}/{len(chosen)}] {variant.name}: {variant.role}", flush=True)
            reason = _unshardable(variant, strategy)
            if reason is not None:
                skipped[variant.name] = f"not run under {strategy}: {reason}"
                print(f"    skipped: {skipped[variant.name]}", flush=True)
                continue
            run_start = time.perf_counter()
            record = run_variant(
                variant,
                runs / variant.name,
                presets=presets,
                overrides=overrides,
                reference=_reference(runs, variant),
                save_grads=variant.reference,
                progress_bar=progress_bar,
                threads=threads,
            )
            timings[variant.name] = {
                "fit": record.get("seconds"),  # measured by the Recorder, from fit start to end
                "run": time.perf_counter() - run_start,  # with building, testing, writing
            }
            print(f"    {summary_line(record)}{_expected(variant, record)}", flush=True)
            record.pop("seconds", None)  # in timings.json, not in the report
            records[variant.name] = record
    finally:
        torch.set_num_threads(previous_threads)
        if previous_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous_omp
    return records, skipped, timings


def _reference(runs: Path, variant: Variant) -> Path | None:
    """The gradients file of the run ``variant`` is compared with, once that has run."""
    if variant.compare_with is None:
        return None
    candidate = runs / variant.compare_with / GRADS_FILE
    return candidate if candidate.exists() else None


def _expected(variant: Variant, record: Mapping[str, Any]) -> str:
    """What the summary line adds for a variant that expects an error."""
    if variant.expect_error is None:
        return ""
    hit = record.get("error", {}).get("type") == variant.expect_error
    return " (expected)" if hit else f" (expected {variant.expect_error})"


def _finish(
    results: dict[str, Any],
    output: Path,
    seconds: float,
    timings: Mapping[str, Mapping[str, float | None]],
) -> None:
    """Write the report and the timings into ``output``; print the outcome."""
    from experiments import report

    written = report.write_report(results, output)[0]
    (output / TIMINGS_FILE).write_text(
        json.dumps({"seconds": seconds, "runs": timings}, indent=1) + "\n"
    )
    failed = [c for c in results["checks"] if not c["ok"]]
    print(
        f"suite: {len(results['checks']) - len(failed)}/{len(results['checks'])} checks "
        f"passed in {seconds:.0f} s; report: {display_path(written)}",
        flush=True,
    )
    for check in failed:
        print(f"  FAILED {check['variant']}: {check['check']}: {check['observed']}", flush=True)
    for name, reason in results["skipped"].items():
        print(f"  SKIPPED {name}: {reason}", flush=True)


def _relative(path: Path) -> str:
    """A config file relative to the repository, else as :func:`display_path` shows it."""
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return display_path(path)


def _versions() -> dict[str, str]:
    import pytorch_lightning as pl

    return {"torch": torch.__version__, "lightning": pl.__version__}


def _compare_trunks(
    runs: Path, variants: Sequence[Variant], records: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Each run's final trunk (weights and BatchNorm buffers) against its compared run's."""
    out: dict[str, Any] = {}
    for variant in variants:
        other = variant.compare_with
        path, reference_path = runs / variant.name / TRUNK_FILE, runs / str(other) / TRUNK_FILE
        if other is None or variant.name not in records or not path.exists():
            continue
        if not reference_path.exists():
            continue
        reference, state = torch.load(reference_path), torch.load(path)
        deltas = {
            key: (
                0.0
                if torch.equal(value, state[key])
                else float((value.double() - state[key].double()).abs().max())
            )
            for key, value in reference.items()
            if key in state
        }
        # A batch counter (num_batches_tracked) is no weight: its difference stays apart.
        counter = {k for k in deltas if not reference[k].is_floating_point()}
        out[variant.name] = {
            "compared_with": other,
            "bitwise_equal": set(state) == set(reference)
            and all(d == 0.0 for d in deltas.values()),
            "max_delta": max((d for k, d in deltas.items() if k not in counter), default=0.0),
            "counters_delta": max((d for k, d in deltas.items() if k in counter), default=0.0),
            "tensors": len(deltas),
        }
    return out


# --------------------------------------------------------------------------------------------
# Command line

# Options of the suite itself; any other --trainer.*, --model.*, --data.*, --record.* option
# (as for fit) goes to every run.
_RUN_PREFIXES = (
    "--trainer.",
    "--model.",
    "--model=",
    "--data.",
    "--record.",
    "--seed_everything",
    "--optimizer",
    "--lr_scheduler",
)
# The spellings of earlier versions, still accepted.
_DEPRECATED = {
    "--data-root": "--data.data_root",
    "--cache-dir": "--data.cache_dir",
    "--dataset": "--data.dataset",
    "--download": "--data.download=true",
    "--no-download": "--data.download=false",
    "--progress-bar": "--trainer.enable_progress_bar=true",
    "--no-progress-bar": "--trainer.enable_progress_bar=false",
}


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The suite's own arguments, and the run options passed on to every run."""
    own = {a.dest for a in suite_parser()._actions}
    mine: list[str] = []
    runs: list[str] = []
    items = list(argv)
    while items:
        arg = items.pop(0)
        name, eq, _ = arg.partition("=")
        if name == "--keep-grads":
            sys.stderr.write(f"{PROG} suite: --keep-grads is deprecated; grads.pt is always kept\n")
            continue
        if name in _DEPRECATED:
            new = _DEPRECATED[name]
            sys.stderr.write(f"{PROG} suite: {name} is deprecated; use {new.partition('=')[0]}\n")
            arg = new + (arg[len(name) :] if "=" not in new else "")
            name, eq, _ = arg.partition("=")
        if name.startswith(_RUN_PREFIXES) and name[2:] not in own:
            if not eq and items and not items[0].startswith("--"):
                arg = f"{arg}={items.pop(0)}"
            runs.append(arg)
        else:
            mine.append(arg)
    return mine, runs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments suite``; returns 1 if a check failed."""
    mine, overrides = _split(sys.argv[1:] if argv is None else argv)
    options = suite_parser().parse_args(mine)
    progress_bar = sys.stderr.isatty()
    for arg in overrides:
        if arg.startswith("--trainer.enable_progress_bar="):
            progress_bar = arg.partition("=")[2].lower() == "true"
    overrides = [a for a in overrides if not a.startswith("--trainer.enable_progress_bar=")]
    try:
        results = run_suite(
            Path(options.output),
            quick=options.quick,
            ddp=options.ddp,
            fsdp=options.fsdp,
            configs=[Path(c) for c in options.config],
            overrides=overrides,
            only=options.only.split(",") if options.only else None,
            data_root=options.data.data_root,
            cache_dir=options.data.cache_dir,
            download=options.data.download,
            threads=options.threads,
            progress_bar=progress_bar,
            dataset=options.data.dataset,
        )
    except ValueError as error:
        if "unknown variants" not in str(error) and "choose one" not in str(error):
            raise
        suite_parser().error(str(error))
    return 0 if all(check["ok"] for check in results["checks"]) else 1
