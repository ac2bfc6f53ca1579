"""The suite's report: ``report.md``, ``results.json`` and PNG plots in one folder.

:func:`write_report` takes the results :func:`experiments.suite.run_suite` gathers (one
``run.json`` record per run, the trunk comparisons and the checks) and writes

* ``results.json``: all of it, per-step series included;
* ``gradient_delta.png``: per step, max |Δ| between each run's trunk gradient and the baseline's;
* ``accuracy.png``: validation accuracy of the main head and of the branches;
* ``drift.png``: per step, how far the trunk moved in the frozen-trunk runs;
* ``simsiam.png``: the std of SimSiam's normalised output with and without stop-gradient;
* ``report.md``: the checks, tables of the key numbers and the plots.

Nothing in them depends on the clock or on where the files are (the suite passes no wall-clock
times and shows paths relative to the working directory), so two suites with the same options
write the same bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["write_report"]

_PLOTS = ("gradient_delta.png", "accuracy.png", "drift.png", "simsiam.png")


def write_report(results: dict[str, Any], output: Path) -> list[Path]:
    """Write the report files into ``output``; returns their paths, ``report.md`` first."""
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(_jsonable(results), indent=1))
    plots = _plot(results, output)
    markdown = output / "report.md"
    markdown.write_text(_markdown(results, plots))
    return [markdown, output / "results.json", *plots]


# --------------------------------------------------------------------------------------------
# Plots


def _steps(values: Sequence[Any]) -> list[int]:
    return list(range(1, len(values) + 1))


def _plot(results: dict[str, Any], output: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    runs: dict[str, dict[str, Any]] = results["runs"]
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(output / name, dpi=110)
        plt.close(fig)
        written.append(output / name)

    with_deltas = {
        name: [math.nan if d is None else d for d in record["grad_delta"]]
        for name, record in runs.items()
        if any(d is not None for d in record.get("grad_delta") or [])
    }
    if with_deltas:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        zero_styles = iter([("--", 3.0), (":", 2.0), ("-.", 1.5)] * 4)
        for name, deltas in with_deltas.items():
            if any(d > 0 for d in deltas if not math.isnan(d)):
                label, (style, width) = name, ("-", 1.6)
            else:
                label, (style, width) = f"{name} (0.0 at every step)", next(zero_styles)
            ax.plot(_steps(deltas), deltas, style, label=label, linewidth=width)
        ax.set_yscale("symlog", linthresh=1e-8)
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_xlabel("training step")
        ax.set_ylabel("max |Δ| vs baseline (symlog)")
        ax.set_title("Trunk gradient after backward, compared with the baseline's, per step")
        ax.legend(fontsize=8)
        save(fig, "gradient_delta.png")

    nets = {n: r for n, r in runs.items() if r.get("model") == "IsolationNet" and r["val"]["step"]}
    if nets:
        fig, (main, side) = plt.subplots(1, 2, figsize=(11, 4.2))
        # Runs whose main network is identical draw the same curve: thinner lines and other
        # dashes on top keep each visible.
        drawn: list[list[float]] = []
        for name, record in nets.items():
            val = record["val"]
            if "acc/main" in val:
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
            for key, values in val.items():
                if key.startswith("acc/") and key != "acc/main":
                    side.plot(
                        val["step"], values, marker="o", markersize=3, label=f"{name}: {key[4:]}"
                    )
        main.set_title("Main head: validation accuracy")
        side.set_title("Auxiliary branches: validation accuracy")
        for ax in (main, side):
            ax.set_xlabel("training step")
            ax.set_ylabel("accuracy")
            ax.legend(fontsize=8)
        save(fig, "accuracy.png")

    frozen = {n: r for n, r in runs.items() if n.startswith("frozen") and r.get("drift")}
    if frozen:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        for name, record in frozen.items():
            kinds = (("parameters", "-"), ("buffers", "--"), ("counters", ":"))
            for kind, style in kinds:
                values = record["drift"].get(kind, [])
                if values:
                    ax.plot(_steps(values), values, style, label=f"{name}: {kind}", linewidth=1.6)
        ax.set_yscale("symlog", linthresh=1e-8)
        ax.set_xlabel("training step")
        ax.set_ylabel("max |Δ| since the start (symlog)")
        ax.set_title("Frozen trunk: drift of parameters, BatchNorm statistics and counters")
        ax.legend(fontsize=8)
        save(fig, "drift.png")

    siam = {
        n: r for n, r in runs.items() if r.get("model") == "SimSiam" and r["train"].get("z_std")
    }
    if siam:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        for name, record in siam.items():
            left.plot(record["train"]["step"], record["train"]["z_std"], label=name)
            if record["val"].get("knn_acc"):
                right.plot(record["val"]["step"], record["val"]["knn_acc"], marker="o", label=name)
        reference = next(iter(siam.values()))["train"].get("z_std_ref")
        if reference:
            left.axhline(reference[-1], color="gray", linestyle=":", label="1/sqrt(dim)")
        left.set_ylim(bottom=0)
        left.set_title("SimSiam: per-channel std of z/|z|")
        right.set_title("SimSiam: kNN accuracy of the encoder's features")
        for ax in (left, right):
            ax.set_xlabel("training step")
            ax.legend(fontsize=8)
        save(fig, "simsiam.png")
    return written


# --------------------------------------------------------------------------------------------
# Markdown


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value == 0.0:
            return "0.0"
        return format(value, spec)
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def _markdown(results: dict[str, Any], plots: list[Path]) -> str:
    setup = results["setup"]
    runs: dict[str, dict[str, Any]] = results["runs"]
    checks: list[dict[str, Any]] = results["checks"]
    passed = sum(c["ok"] for c in checks)
    plot_names = {p.name for p in plots}
    dataset = setup["data"].get("split", {}).get("dataset", "mnist")
    title = "Fashion-MNIST" if dataset == "fashion_mnist" else "MNIST"
    out: list[str] = [f"# Gradient isolation on {title}: suite report", ""]

    threads = setup["threads"]
    threads = "torch's default threads" if threads is None else f"{threads} thread(s)"
    mode = f"DDP, 2 CPU processes, {threads} each" if setup["ddp"] else f"1 process, {threads}"
    steps = runs.get("baseline", {}).get("steps")
    out += [
        f"**{passed}/{len(checks)} checks passed** "
        f"({mode}; {'quick' if setup['quick'] else 'full'} runs; torch {setup['torch']}, "
        f"Lightning {setup['lightning']}). Wall-clock times are in `timings.json`.",
        "",
        f"Data: {setup['data']['note']}",
        "",
        "Every run starts from the same seed (`seed_everything: 0`), sees the batches in the "
        "same order (the datamodule's seeded generator) and uses deterministic ops; presets: "
        f"{', '.join(setup['presets']) or 'none'} on top of `configs/presets/base.yaml`."
        + (f" The baseline took {steps} optimizer steps." if steps else ""),
        "",
        "Reproduce: `python -m experiments suite"
        + (" --quick" if setup["quick"] else "")
        + (" --ddp" if setup["ddp"] else "")
        + (f" --dataset {dataset}" if dataset != "mnist" else "")
        + "`; one run: the `command.txt` in `runs/<name>/`, e.g. "
        "`python -m experiments fit --config configs/detached.yaml`.",
        "",
        "## Checks",
        "",
        _table(
            ["variant", "check", "expected", "observed", ""],
            [
                [
                    c["variant"],
                    c["check"],
                    c["expected"],
                    c["observed"],
                    "ok" if c["ok"] else "FAIL",
                ]
                for c in checks
            ],
        ),
        "",
        "## Runs",
        "",
        _table(
            ["run", "what it shows", "status", "steps", "main test acc", "branch test acc"],
            [
                [
                    name,
                    results["variants"].get(name, {}).get("role", ""),
                    _status(record),
                    record.get("steps", "n/a"),
                    _fmt((record.get("test") or {}).get("acc/main"), ".3f"),
                    _branch_acc(record),
                ]
                for name, record in runs.items()
            ],
        ),
        "",
        "## The trunk's gradient, step by step, against the baseline",
        "",
        "After every backward pass the suite reads the trunk's gradient (the one the optimizer "
        "applies: main loss plus every branch's loss, averaged over processes under DDP) and "
        "compares it with the baseline's gradient at the same step. A branch that is cut off "
        "leaves it identical to the last bit, at every step, because the whole trajectory is "
        "identical; a branch whose loss reaches the trunk changes it from the first step on.",
        "",
    ]
    rows = []
    trunks = results.get("trunk_vs_baseline", {})
    for name, record in runs.items():
        deltas = [d for d in record.get("grad_delta") or [] if d is not None]
        if not deltas:
            continue
        trunk = trunks.get(name, {})
        rows.append(
            [
                name,
                len(deltas),
                sum(d == 0.0 for d in deltas),
                _fmt(min(deltas), ".3g"),
                _fmt(max(deltas), ".3g"),
                trunk.get("bitwise_equal", "n/a"),
                _fmt(trunk.get("max_delta"), ".3g"),
            ]
        )
    out += [
        _table(
            [
                "run",
                "steps",
                "steps with max|Δ| == 0.0",
                "min over steps",
                "max over steps",
                "final trunk bitwise equal",
                "final trunk max|Δ|",
            ],
            rows,
        ),
        "",
    ]
    if "gradient_delta.png" in plot_names:
        out += ["![trunk gradient vs baseline](gradient_delta.png)", ""]

    out += [
        "## Reachability audit (first step)",
        "",
        "`isolate.reachable_parameters(loss, model)` walks each loss's autograd graph "
        "before backward; the table counts the parameters of each part it can reach.",
        "",
    ]
    audit_rows = []
    for name, record in runs.items():
        for loss, groups in (record.get("audit") or {}).items():
            cells = ", ".join(f"{group} {hit}/{total}" for group, (hit, total) in groups.items())
            audit_rows.append([name, loss, cells])
    out += [_table(["run", "loss", "parameters reached"], audit_rows), ""]

    out += ["## Accuracy", ""]
    acc_rows = []
    for name, record in runs.items():
        test, chance = record.get("test") or {}, record.get("chance") or {}
        for key, value in test.items():
            if key.startswith("acc/"):
                final_val = (record.get("val") or {}).get(key) or [None]
                acc_rows.append(
                    [
                        name,
                        key[4:],
                        _fmt(final_val[-1], ".3f"),
                        _fmt(value, ".3f"),
                        _fmt(chance.get(key), ".3f"),
                    ]
                )
    out += [
        _table(["run", "output", "final val acc", "test acc", "chance (majority class)"], acc_rows),
        "",
    ]
    same = [
        name
        for name, record in runs.items()
        if name != "baseline"
        and (record.get("test") or {}).get("acc/main") is not None
        and record.get("val", {}).get("acc/main")
        == runs.get("baseline", {}).get("val", {}).get("acc/main")
    ]
    if same:
        out += [
            f"The main head's validation curve of {', '.join(same)} is the baseline's, value for "
            "value: the branches they add are cut off from the main network.",
            "",
        ]
    if "accuracy.png" in plot_names:
        out += ["![accuracy](accuracy.png)", ""]
    out += _reversal(runs)

    frozen = {n: r for n, r in runs.items() if n.startswith("frozen") and r.get("drift_final")}
    if frozen:
        out += [
            "## Frozen trunk",
            "",
            "`isolate.snapshot(trunk)` at the start of `fit`, compared after every step: "
            "parameters, buffers (BatchNorm `running_mean`, `running_var`) and counters "
            "(`num_batches_tracked`).",
            "",
        ]
        drift_rows = []
        for name, record in frozen.items():
            final = record["drift_final"]
            moved = ", ".join(sorted(final.get("moved", {}))) or "none"
            drift_rows.append(
                [
                    name,
                    len(final.get("checked", [])),
                    _fmt(final.get("parameters"), ".3g"),
                    _fmt(final.get("buffers"), ".3g"),
                    _fmt(final.get("counters"), ".3g"),
                    moved,
                ]
            )
        out += [
            _table(
                [
                    "run",
                    "tensors checked",
                    "parameters max|Δ|",
                    "running statistics max|Δ|",
                    "num_batches_tracked Δ",
                    "moved",
                ],
                drift_rows,
            ),
            "",
        ]
        if "drift.png" in plot_names:
            out += ["![drift](drift.png)", ""]

    guarded = runs.get("inplace_guarded")
    if guarded is not None:
        error = guarded.get("error", {})
        out += [
            "## In-place edits",
            "",
            f"`inplace_guarded` stopped after {guarded.get('steps')} steps with "
            f"`{error.get('type')}` (the expected outcome):",
            "",
            "```",
            str(error.get("message", "")),
            "```",
            "",
            "`inplace_cloned` feeds the same branch a private copy "
            "(`Detached(branch, inplace='copy')`): see its rows above.",
            "",
        ]

    siam = {n: r for n, r in runs.items() if r.get("model") == "SimSiam"}
    if siam:
        out += [
            "## SimSiam: the stop-gradient prevents collapse",
            "",
            "Chen & He (2021) report that without the stop-gradient SimSiam's output collapses "
            "to a constant: the per-channel std of the l2-normalised output falls to 0, "
            "while with it the std stays near 1/sqrt(dim).",
            "",
        ]
        siam_rows = []
        for name, record in siam.items():
            train = record.get("train", {})
            std = train.get("z_std") or [None]
            loss = train.get("loss") or [None]
            knn = (record.get("test") or {}).get("knn_acc")
            siam_rows.append(
                [
                    name,
                    _fmt(std[-1]),
                    _fmt((train.get("z_std_ref") or [None])[-1]),
                    _fmt(loss[-1], ".3f"),
                    _fmt(knn, ".3f"),
                ]
            )
        out += [
            _table(
                ["run", "final std of z/|z|", "1/sqrt(dim)", "final loss", "kNN test acc"],
                siam_rows,
            ),
            "",
        ]
        if "simsiam.png" in plot_names:
            out += ["![simsiam](simsiam.png)", ""]
    return "\n".join(out)


def _reversal(runs: dict[str, dict[str, Any]]) -> list[str]:
    """What the gradient reversal did to the ink attribute, in numbers from the runs."""
    reversal, detached = runs.get("reversal"), runs.get("detached")
    if reversal is None or reversal.get("status") != "ok":
        return []
    test, chance = reversal.get("test") or {}, reversal.get("chance") or {}
    adversary, probe = test.get("acc/adversary"), test.get("acc/ink_probe")
    if adversary is None or probe is None:
        return []
    before = (detached or {}).get("test", {}).get("acc/ink_probe")
    main = test.get("acc/main")
    specs = (reversal.get("hparams") or {}).get("branches") or []
    alpha = next((b.get("alpha") for b in specs if b.get("name") == "adversary"), None)
    base_main = runs.get("baseline", {}).get("test", {}).get("acc/main")
    lines = [
        "### Gradient reversal",
        "",
        f"Behind `GradientScale({alpha})`, the ink adversary ends at {adversary:.3f} test accuracy "
        f"(majority class: {_fmt(chance.get('acc/adversary'), '.3f')}), while a detached linear "
        f"probe trained next to it still reads ink from the same features at {probe:.3f}"
        + (f" ({before:.3f} in the detached run, without reversal)" if before else "")
        + f". The main head reaches {_fmt(main, '.3f')} (baseline {_fmt(base_main, '.3f')}). "
        "The reversed gradient reaches the trunk (see the audit and the gradient plot); "
        "whether it removes the attribute or only defeats this one adversary is what the "
        "probe tells.",
        "",
    ]
    return lines


def _status(record: dict[str, Any]) -> str:
    if record.get("status") == "ok":
        return "ok"
    error = record.get("error", {})
    return f"stopped: {error.get('type')}"


def _branch_acc(record: dict[str, Any]) -> str:
    test = record.get("test") or {}
    parts = [
        f"{k[4:]} {v:.3f}" for k, v in test.items() if k.startswith("acc/") and k != "acc/main"
    ]
    if "knn_acc" in test:
        parts.append(f"kNN {test['knn_acc']:.3f}")
    return ", ".join(parts) or "n/a"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Path):
        return str(value)
    return value
