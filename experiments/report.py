"""The suite's report: ``report.md``, ``results.json`` and PNG plots in one folder.

:func:`write_report` takes the results :func:`experiments.suite.run_suite` gathers (one
``run.json`` record per run, each variant's declaration, the trunk comparisons and the checks)
and writes

* ``results.json``: all of it, per-step series included;
* ``gradient_delta.png``: per step, max |Δ| between each run's trunk gradient and the
  gradient of the run it is compared with;
* ``accuracy.png``: validation accuracy of the main head and of the branches, with chance;
* ``report.md``: the checks, tables of the key numbers and the plots;
* and what the sections the variants declare write (:mod:`experiments.sections`).

Nothing in them depends on the clock or on where the files are (the suite passes no wall-clock
times and shows paths relative to the working directory), so two suites with the same options
write the same bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from experiments.formats import fmt, jsonable, table
from experiments.sections import (
    ZERO_STYLES,
    legend_outside,
    pyplot,
    render_declared,
    save,
    step_axis,
    steps_of,
)

__all__ = ["write_report"]

_TITLES = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST"}
# What the report calls the Lightning strategies the runs record (``type(strategy).__name__``).
_ENGINES = {"DDPStrategy": "DDP", "ModelParallelStrategy": "FSDP2"}


def write_report(results: dict[str, Any], output: Path) -> list[Path]:
    """Write the report files into ``output``; returns their paths, ``report.md`` first."""
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(jsonable(results), indent=1))
    lines = [*_header(results), *_checks(results), *_runs(results), *_skipped(results)]
    lines += _gradients(results, output)
    lines += _audit(results)
    lines += _contracts(results)
    lines += _certificates(results)
    lines += _accuracy(results, output)
    lines += render_declared(results, output)
    markdown = output / "report.md"
    markdown.write_text("\n".join(lines))
    plots = sorted(output.glob("*.png"))
    return [markdown, output / "results.json", *plots]


def _compared(results: dict[str, Any], name: str) -> str | None:
    return results["variants"].get(name, {}).get("compare_with")


# --------------------------------------------------------------------------------------------
# The generic sections: every run appears in them as far as it has the numbers


def _header(results: dict[str, Any]) -> list[str]:
    setup, runs, checks = results["setup"], results["runs"], results["checks"]
    passed = sum(c["ok"] for c in checks)
    dataset = setup["data"].get("split", {}).get("dataset", "mnist")
    threads = setup["threads"]
    threads_text = "torch's default threads" if threads is None else f"{threads} thread(s)"
    mode = _mode(runs, threads_text)
    references = [n for n, v in results["variants"].items() if v.get("reference") and n in runs]
    steps = ", ".join(f"{n} took {runs[n].get('steps')} optimizer steps" for n in references)
    command = (
        "python -m experiments suite"
        + " --quick" * setup["quick"]
        + " --ddp" * setup["ddp"]
        + " --fsdp" * bool(setup.get("fsdp"))
        + (f" --data.dataset={dataset}" if dataset != "mnist" else "")
    )
    return [
        f"# Gradient isolation on {_TITLES.get(dataset, dataset)}: suite report",
        "",
        f"**{passed}/{len(checks)} checks passed** "
        f"({mode}; {'quick' if setup['quick'] else 'full'} runs; torch {setup['torch']}, "
        f"Lightning {setup['lightning']}). Wall-clock times are in `timings.json`.",
        "",
        f"Data: {setup['data']['note']}",
        "",
        "Every run starts from the same seed (`seed_everything: 0`) and a randomly initialised "
        "network (no pretrained weights), sees the batches in the "
        "same order (the datamodule's seeded generator) and uses deterministic ops; presets: "
        f"{', '.join(setup['presets']) or 'none'} on top of `configs/presets/base.yaml`."
        + (f" The {steps}." if steps else ""),
        "",
        f"Reproduce: `{command}`; one run: the `command.txt` in `runs/<name>/`, run from the "
        "same folder (a run compared with another reads that run's `grads.pt`, which the suite "
        "keeps). The same machine, thread count and versions give the same numbers, bit for "
        "bit; another machine, thread count or torch build may change the last bits, and "
        "then the curves drift apart over the steps.",
        "",
    ]


def _mode(runs: dict[str, Any], threads_text: str) -> str:
    """How the runs ran, from what each recorded: its Lightning strategy and process count."""
    ran = sorted(
        {(str(r["strategy"]), int(r["world_size"])) for r in runs.values() if "strategy" in r}
    )
    if not ran:
        return f"1 process, {threads_text}"
    parts = []
    for strategy, processes in ran:
        if processes == 1:
            parts.append(f"1 process, {threads_text}")
            continue
        engine = _ENGINES.get(strategy)
        name = f"{engine} (Lightning's {strategy})" if engine else strategy
        parts.append(f"{name}, {processes} CPU processes, {threads_text} each")
    return "; ".join(parts)


def _skipped(results: dict[str, Any]) -> list[str]:
    skipped = results.get("skipped") or {}
    if not skipped:
        return []
    rows = [
        [name, results["variants"].get(name, {}).get("role", ""), why]
        for name, why in skipped.items()
    ]
    return [
        "## Not run",
        "",
        "These variants were chosen but not run, so none of their claims is checked above.",
        "",
        table(["variant", "what it shows", "why not"], rows),
        "",
    ]


def _checks(results: dict[str, Any]) -> list[str]:
    rows = [
        [c["variant"], c["check"], c["expected"], c["observed"], "ok" if c["ok"] else "FAIL"]
        for c in results["checks"]
    ]
    return ["## Checks", "", table(["variant", "check", "expected", "observed", ""], rows), ""]


def _status(record: dict[str, Any]) -> str:
    if record.get("status") == "ok":
        return "ok"
    return f"stopped: {record.get('error', {}).get('type')}"


def _branch_acc(record: dict[str, Any]) -> str:
    test = record.get("test") or {}
    parts = [
        f"{k[4:]} {v:.3f}" for k, v in test.items() if k.startswith("acc/") and k != "acc/main"
    ]
    if "knn_acc" in test:
        parts.append(f"kNN {test['knn_acc']:.3f}")
    return ", ".join(parts) or "n/a"


def _runs(results: dict[str, Any]) -> list[str]:
    rows = [
        [
            name,
            results["variants"].get(name, {}).get("role", ""),
            _status(record),
            record.get("steps", "n/a"),
            fmt((record.get("test") or {}).get("acc/main"), ".3f"),
            _branch_acc(record),
        ]
        for name, record in results["runs"].items()
    ]
    header = ["run", "what it shows", "status", "steps", "main test acc", "branch test acc"]
    return ["## Runs", "", table(header, rows), ""]


def _gradients(results: dict[str, Any], output: Path) -> list[str]:
    runs, trunks = results["runs"], results.get("trunk_vs_reference", {})
    compared = {
        name: [math.nan if d is None else d for d in record["grad_delta"]]
        for name, record in runs.items()
        if any(d is not None for d in record.get("grad_delta") or [])
    }
    if not compared:
        return []
    rows = []
    for name, series in compared.items():
        deltas = [d for d in series if not math.isnan(d)]
        trunk = trunks.get(name, {})
        rows.append(
            [
                name,
                _compared(results, name),
                len(deltas),
                sum(d == 0.0 for d in deltas),
                fmt(min(deltas), ".3g"),
                fmt(max(deltas), ".3g"),
                trunk.get("bitwise_equal", "n/a"),
                fmt(trunk.get("max_delta"), ".3g"),
                fmt(trunk.get("counters_delta"), ".3g"),
            ]
        )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    zero = iter(ZERO_STYLES * 4)
    for name, deltas in compared.items():
        if any(d > 0 for d in deltas if not math.isnan(d)):
            label, (style, width) = name, ("-", 1.6)
        else:
            label, (style, width) = f"{name} (0.0 at every step)", next(zero)
        ax.plot(steps_of(deltas), deltas, linestyle=style, label=label, linewidth=width)
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.axhline(0.0, color="black", linewidth=0.6)
    step_axis(ax)
    ax.set_ylabel("max |Δ| vs the compared run (symlog)")
    ax.set_title("Trunk gradient after backward, compared with the reference run's, per step")
    ax.legend(fontsize=8)
    save(fig, output / "gradient_delta.png")
    header = [
        "run",
        "compared with",
        "steps",
        "steps with max|Δ| == 0.0",
        "min over steps",
        "max over steps",
        "final trunk bitwise equal",
        "final trunk max|Δ| (weights, running statistics)",
        "final num_batches_tracked Δ",
    ]
    return [
        "## The trunk's gradient, step by step, against the reference run",
        "",
        "After every backward pass the suite reads the trunk's gradient (the one the optimizer "
        "applies: main loss plus every branch's loss, averaged over processes under DDP) and "
        "compares it with the gradient of the run it is compared with at the same step. A "
        "branch that is cut off leaves it identical to the last bit, at every step, because "
        "the whole trajectory is identical; a branch whose loss reaches the trunk changes it "
        "from the first step on. The final trunk is compared tensor by tensor: weights and "
        "BatchNorm running statistics by their largest difference, the `num_batches_tracked` "
        "counters apart (a count of batches, not a weight: a trunk frozen with `bn='eval'` "
        "counts none).",
        "",
        table(header, rows),
        "",
        "![trunk gradient vs the reference run](gradient_delta.png)",
        "",
    ]


def _audit(results: dict[str, Any]) -> list[str]:
    rows = []
    for name, record in results["runs"].items():
        for loss, groups in (record.get("audit") or {}).items():
            cells = ", ".join(f"{group} {hit}/{total}" for group, (hit, total) in groups.items())
            rows.append([name, loss, cells])
    return [
        "## Reachability audit (first step)",
        "",
        "`isolate.reachability.reachable_parameters(loss, model)` walks each loss's autograd graph "
        "before backward; the table counts the parameters of each part it can reach.",
        "",
        table(["run", "loss", "parameters reached"], rows),
        "",
    ]


def _contracts(results: dict[str, Any]) -> list[str]:
    rows = []
    for name, record in results["runs"].items():
        for contract, verdict in (record.get("contracts") or {}).items():
            clauses = verdict["clauses"]
            broken = [c for c, v in clauses.items() if v["violated"]]
            checks = sum(v["checked"] for v in clauses.values())
            said = "holds" if not broken else "broken: " + ", ".join(f"'{c}'" for c in broken)
            first = next((clauses[c]["first"] for c in broken), None)
            detail = "" if first is None else str(first).split(" breaks its clause ", 1)[-1]
            rows.append([name, contract, verdict["kind"], checks, said, detail[:160]])
    if not rows:
        return []
    return [
        "## Contracts",
        "",
        "What each run's `IsolationCallback` declares its method promises (`contracts:` in its "
        "config), checked at step 0 and every `verify_every_n_steps` steps; a negative control "
        "declares the contract of the method it gets wrong and warns instead of stopping.",
        "",
        table(["run", "contract", "kind", "clause checks", "verdict", "first violation"], rows),
        "",
    ]


def _certificates(results: dict[str, Any]) -> list[str]:
    rows = []
    for name, record in results["runs"].items():
        cert = record.get("certificate")
        if not cert:
            continue
        if "skipped" in cert:
            rows.append([name, "none", cert["skipped"], ""])
            continue
        link = f"[{cert['file']}](runs/{name}/{cert['file']})"
        verdict = "clean" if cert["clean"] else "FAILED"
        rows.append([name, verdict, "; ".join(cert["summary"]), link])
    if not rows:
        return []
    return [
        "## Certificates from the checkpoints alone",
        "",
        "`isolate certify first.pt last.pt` under the run's own spec, from the weights at the "
        "first and the last step and nothing else: every frozen tensor bitwise unchanged, "
        "every trainable one moved. A certificate shows which tensors changed; it cannot show "
        "which loss changed them (the contracts and checks above do).",
        "",
        table(["run", "certificate", "what it proves", "file"], rows),
        "",
    ]


def _accuracy(results: dict[str, Any], output: Path) -> list[str]:
    runs = results["runs"]
    rows = []
    for name, record in runs.items():
        test, chance = record.get("test") or {}, record.get("chance") or {}
        for key, value in test.items():
            if key.startswith("acc/"):
                final_val = (record.get("val") or {}).get(key) or [None]
                rows.append(
                    [
                        name,
                        key[4:],
                        fmt(final_val[-1], ".3f"),
                        fmt(value, ".3f"),
                        fmt(chance.get(key), ".3f"),
                    ]
                )
    if not rows:
        return []
    lines = [
        "## Accuracy",
        "",
        table(["run", "output", "final val acc", "test acc", "chance (majority class)"], rows),
        "",
    ]
    same: dict[str, list[str]] = {}
    for name, record in runs.items():
        other = _compared(results, name)
        curve = (record.get("val") or {}).get("acc/main")
        if (
            other
            and curve
            and record.get("test")
            and curve == ((runs.get(other) or {}).get("val") or {}).get("acc/main")
        ):
            same.setdefault(other, []).append(name)
    for other, names in same.items():
        lines += [
            f"The main head's validation curve of {', '.join(names)} is {other}'s, value for "
            "value: the branches they add are cut off from the main network.",
            "",
        ]
    if _plot_accuracy(runs, output):
        lines += ["![accuracy](accuracy.png)", ""]
    return lines


# One style per chance level (the levels differ per output: 10 classes, a binary attribute).
_CHANCE_STYLES = [(":", "black"), ("--", "tab:red"), ("-.", "tab:purple")]


def _plot_accuracy(runs: dict[str, dict[str, Any]], output: Path) -> bool:
    curves = {n: r for n, r in runs.items() if "acc/main" in (r.get("val") or {})}
    if not curves:
        return False
    plt = pyplot()
    fig, (main, side) = plt.subplots(1, 2, figsize=(11, 4.2))
    # Runs whose main network is identical draw the same curve: thinner lines and other
    # dashes on top keep each visible.
    drawn: list[list[float]] = []
    chances: dict[str, dict[str, float]] = {"main": {}, "side": {}}
    for name, record in curves.items():
        val, chance = record["val"], record.get("chance") or {}
        repeats = drawn.count(val["acc/main"])
        drawn.append(val["acc/main"])
        main.plot(
            val["step"],
            val["acc/main"],
            ("-", "--", ":", "-.")[repeats % 4],
            marker="o",
            markersize=max(4 - repeats, 1),
            linewidth=max(3.0 - repeats, 1.0),
            label=name,
        )
        if "acc/main" in chance:
            chances["main"].setdefault(f"{chance['acc/main']:.3f}", chance["acc/main"])
        for key, values in val.items():
            if key.startswith("acc/") and key != "acc/main":
                side.plot(val["step"], values, marker="o", markersize=3, label=f"{name}: {key[4:]}")
                if key in chance:
                    chances["side"].setdefault(f"{chance[key]:.3f}", chance[key])
    for ax, where in ((main, "main"), (side, "side")):
        for (text, value), (style, color) in zip(
            sorted(chances[where].items()), _CHANCE_STYLES * 4, strict=False
        ):
            ax.axhline(
                value,
                color=color,
                linestyle=style,
                linewidth=1.2,
                label=f"chance: majority class of the test split, {text}",
            )
            ax.annotate(
                f"chance {text}",
                (1.0, value),
                xycoords=("axes fraction", "data"),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
                color=color,
            )
        ax.set_ylim(0.0, 1.0)
        step_axis(ax)
        ax.set_ylabel("validation accuracy")
        legend_outside(ax)
    main.set_title("Main head: validation accuracy")
    side.set_title("Auxiliary branches: validation accuracy")
    save(fig, output / "accuracy.png")
    return True
