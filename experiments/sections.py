"""The report sections a variant can declare (``variant: report:`` in its config).

A section kind is a function that takes the runs that declared it (with each declaration's
parameters) and the whole results, and returns the section's Markdown lines; it may write a
plot into the report's folder. Runs that declare the same kind share one section, placed
where the first of them declares it.

==============  ==============================================================================
kind            what it shows (parameters)
==============  ==============================================================================
``drift``       how far the trunk's parameters, BatchNorm statistics and counters moved from
                the start, per step (``drift.png``) and at the end
``error``       the exception that stopped the run, in full (``note``: a sentence after it)
``adversary``   what a gradient reversal did to an attribute: the ``adversary``'s accuracy,
                a detached ``probe``'s on the same features, and the probe's in the run
                ``without`` reversal
``collapse``    the spread of SimSiam's output and the kNN accuracy (``collapse.png``)
``cut_off``     the trainable parameters that the loss backpropagated cannot reach at the
                first step, each with the reason the forward's trace gives, whether they
                still hold their first-step values at the end, and the main test accuracy
``gradient_shares``  where each named loss sends its gradient at the first step: the share of
                its squared norm per parameter group, the trunk (``part``, default
                ``trunk``) split into its layers, with the cut-off parameters counted per
                group (``GradientReport.figure``, ``gradient_shares_<run>.png``)
``thaw``        when the trunk's frozen layers were thawed, how far each trunk layer's
                parameters moved before and after, and whether every process held the same
                full parameters at every step after the thaw
==============  ==============================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from experiments.formats import fmt, largest, table

__all__ = [
    "SECTIONS",
    "ZERO_STYLES",
    "Entry",
    "legend_outside",
    "pyplot",
    "render_declared",
    "save",
    "step_axis",
    "steps_of",
]

# One run that declared the section, and the declaration's parameters.
Entry = tuple[str, dict[str, Any]]
Section = Callable[[Sequence[Entry], dict[str, Any], Path], list[str]]

# Several series that are 0.0 at every step would hide each other: other dashes and widths.
ZERO_STYLES = (("--", 3.0), (":", 2.2), ("-.", 1.6), ((0, (1, 3)), 1.2))


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (imported only to draw)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` as PNG and close it (legends placed outside the axes included)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)


def steps_of(values: Sequence[Any]) -> list[int]:
    return list(range(1, len(values) + 1))


def step_axis(ax: Any) -> None:
    """An x axis of optimizer steps: whole numbers only (no tick at step 2.5)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("training step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def legend_outside(ax: Any, *, fontsize: int = 7) -> None:
    """The legend below the axes, where it cannot cover a curve."""
    ax.legend(
        fontsize=fontsize,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=2,
        frameon=False,
    )


# --------------------------------------------------------------------------------------------
# drift

_DRIFT_KINDS = (
    ("parameters", "parameters", "max |Δ| of the weights"),
    ("buffers", "BatchNorm running statistics", "max |Δ| of running_mean, running_var"),
    ("counters", "num_batches_tracked", "increase of the counter"),
)


def _drift(entries: Sequence[Entry], results: dict[str, Any], output: Path) -> list[str]:
    runs = results["runs"]
    frozen = {name: runs[name] for name, _ in entries if runs.get(name, {}).get("drift_final")}
    if not frozen:
        return []
    lines = [
        "## Frozen trunk",
        "",
        "`isolate.snapshot(trunk)` at the start of `fit`, compared after every step: "
        "parameters, BatchNorm running statistics (`running_mean`, `running_var`) and "
        "counters (`num_batches_tracked`). *Max over steps* is the largest difference from the "
        "start seen after any step; *at the end* is the difference after the last step.",
        "",
    ]
    rows = []
    for name, record in frozen.items():
        final, series = record["drift_final"], record.get("drift") or {}
        rows.append(
            [
                name,
                len(final.get("checked", [])),
                largest(series.get("parameters") or []),
                largest(series.get("buffers") or []),
                fmt(final.get("buffers"), ".3g"),
                fmt(final.get("counters"), ".3g"),
                ", ".join(sorted(final.get("moved", {}))) or "none",
                fmt((record.get("test") or {}).get("acc/main"), ".3f"),
            ]
        )
    lines += [
        table(
            [
                "run",
                "tensors checked",
                "parameters, max over steps",
                "running statistics, max over steps",
                "running statistics, at the end",
                "num_batches_tracked, at the end",
                "moved at the end",
                "main test acc",
            ],
            rows,
        ),
        "",
        *_random_trunk(frozen),
    ]
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (kind, title, ylabel) in zip(axes, _DRIFT_KINDS, strict=True):
        zero = iter(ZERO_STYLES * 4)
        for name, record in frozen.items():
            values = (record.get("drift") or {}).get(kind) or []
            if not values:
                continue
            if any(v != 0.0 for v in values):
                ax.plot(steps_of(values), values, "-", linewidth=1.6, label=name)
            else:
                style, width = next(zero)
                ax.plot(
                    steps_of(values),
                    values,
                    linestyle=style,
                    linewidth=width,
                    label=f"{name} (0.0 at every step)",
                )
        ax.set_title(title)
        step_axis(ax)
        ax.set_ylabel(ylabel)
        if kind != "counters":  # the counter counts batches: a linear axis shows it as it is
            ax.set_yscale("symlog", linthresh=1e-8)
        ax.legend(fontsize=7)
    fig.suptitle("Trunk drift since the start of fit, per step")
    save(fig, output / "drift.png")
    return [*lines, "![drift](drift.png)", ""]


def _random_trunk(frozen: dict[str, dict[str, Any]]) -> list[str]:
    """Why a correctly frozen trunk can score below a naive one here: it is not pretrained."""
    acc = {n: (r.get("test") or {}).get("acc/main") for n, r in frozen.items()}
    held = [n for n, r in frozen.items() if not r["drift_final"].get("buffers") and acc[n]]
    drifted = [n for n, r in frozen.items() if r["drift_final"].get("buffers") and acc[n]]
    lines = [
        "The trunk is randomly initialised (seed 0), not pretrained: frozen, it hands the head "
        "fixed random features, so these accuracies measure a head on random features, not "
        "the cost of freezing correctly."
    ]
    if held and drifted:
        a, b = drifted[0], held[0]
        lines[0] += (
            f" In {a} the BatchNorm running statistics moved anyway and adapted those random "
            f"features to the data, which is likely why it reaches {acc[a]:.3f} against {b}'s "
            f"{acc[b]:.3f}; on a pretrained backbone, that same movement is the silent drift "
            "that freezing is meant to prevent."
        )
    return [*lines, ""]


# --------------------------------------------------------------------------------------------
# error


def _error(entries: Sequence[Entry], results: dict[str, Any], output: Path) -> list[str]:
    runs, variants = results["runs"], results["variants"]
    lines = ["## Runs stopped by an error", ""]
    for name, params in entries:
        record = runs.get(name)
        if record is None:
            continue
        error = record.get("error", {})
        expected = variants.get(name, {}).get("expect_error")
        outcome = (
            "the expected outcome" if error.get("type") == expected else (f"expected {expected}")
        )
        lines += [
            f"`{name}` stopped after {record.get('steps')} steps with "
            f"`{error.get('type')}` ({outcome}):",
            "",
            "```",
            str(error.get("message", "")),
            "```",
            "",
        ]
        if params.get("note"):
            lines += [str(params["note"]), ""]
    return lines


# --------------------------------------------------------------------------------------------
# adversary


def _adversary(entries: Sequence[Entry], results: dict[str, Any], output: Path) -> list[str]:
    runs, variants = results["runs"], results["variants"]
    lines: list[str] = []
    for name, params in entries:
        record = runs.get(name) or {}
        if record.get("status") != "ok":
            continue
        test, chance = record.get("test") or {}, record.get("chance") or {}
        adversary, probe = params["adversary"], params["probe"]
        adv_acc, probe_acc = test.get(f"acc/{adversary}"), test.get(f"acc/{probe}")
        if adv_acc is None or probe_acc is None:
            continue
        without = params.get("without")
        before = (runs.get(without) or {}).get("test", {}).get(f"acc/{probe}") if without else None
        specs = (record.get("hparams") or {}).get("branches") or []
        alpha = next((b.get("alpha") for b in specs if b.get("name") == adversary), None)
        compared = variants.get(name, {}).get("compare_with")
        base_main = (runs.get(compared) or {}).get("test", {}).get("acc/main")
        lines += [
            f"## Gradient reversal: {name}",
            "",
            f"Behind `GradientScale({alpha})`, the {adversary} ends at {adv_acc:.3f} test "
            f"accuracy ({_against_chance(adv_acc, chance.get(f'acc/{adversary}'))}). A "
            f"detached linear probe ({probe}) trained next to it on the same features reaches "
            f"{probe_acc:.3f} ({_against_chance(probe_acc, chance.get(f'acc/{probe}'))})"
            + (f"; {before:.3f} in the {without} run, without reversal" if before else "")
            + ". "
            + _probe_verdict(probe_acc, chance.get(f"acc/{probe}"))
            + f" The main head reaches {fmt(test.get('acc/main'), '.3f')}"
            + (f" ({compared}: {fmt(base_main, '.3f')})" if compared else "")
            + ". The reversed gradient reaches the trunk (see the audit and the gradient plot).",
            "",
        ]
    return lines


def _against_chance(acc: float, chance: float | None) -> str:
    if chance is None:
        return "chance unknown"
    if acc > chance:
        return f"above chance, the majority class's {chance:.3f}"
    return f"chance: the majority class alone gives {chance:.3f}"


def _probe_verdict(acc: float, chance: float | None) -> str:
    """What the probe says about the attribute, from its accuracy against chance."""
    if chance is None:
        return ""
    if acc > chance:
        return (
            "The attribute is still linearly readable from the features: the reversal "
            "defeated this one adversary without removing it."
        )
    return (
        "The probe does no better than chance either: no linear read-out finds the attribute "
        "in the features (a stronger probe might)."
    )


# --------------------------------------------------------------------------------------------
# collapse


def _collapse(entries: Sequence[Entry], results: dict[str, Any], output: Path) -> list[str]:
    runs = results["runs"]
    siam = {name: runs[name] for name, _ in entries if (runs.get(name) or {}).get("train")}
    if not siam:
        return []
    lines = [
        "## SimSiam: the stop-gradient prevents collapse",
        "",
        "Chen & He (2021) report that without the stop-gradient SimSiam's output collapses "
        "to a constant: the per-channel std of the l2-normalised output falls to 0, "
        "while with it the std stays near 1/sqrt(dim).",
        "",
    ]
    rows = []
    for name, record in siam.items():
        train = record["train"]
        rows.append(
            [
                name,
                fmt((train.get("z_std") or [None])[-1]),
                fmt((train.get("z_std_ref") or [None])[-1]),
                fmt((train.get("loss") or [None])[-1], ".3f"),
                fmt((record.get("test") or {}).get("knn_acc"), ".3f"),
            ]
        )
    lines += [
        table(["run", "final std of z/|z|", "1/sqrt(dim)", "final loss", "kNN test acc"], rows),
        "",
    ]
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, record in siam.items():
        if record["train"].get("z_std"):
            left.plot(record["train"]["step"], record["train"]["z_std"], label=name)
        if record["val"].get("knn_acc"):
            right.plot(record["val"]["step"], record["val"]["knn_acc"], marker="o", label=name)
    reference = next(iter(siam.values()))["train"].get("z_std_ref")
    if reference:
        left.axhline(reference[-1], color="gray", linestyle=":", label="1/sqrt(dim)")
    right.axhline(0.1, color="gray", linestyle=":", label="chance (10 classes)")
    left.set_ylim(bottom=0)
    # The whole range: a zoomed axis makes a gap of 2 points on one seed look large.
    right.set_ylim(0.0, 1.0)
    left.set_title("SimSiam: per-channel std of z/|z|")
    right.set_title("SimSiam: kNN accuracy of the encoder's features (one seed)")
    left.set_ylabel("std")
    right.set_ylabel("validation accuracy")
    for ax in (left, right):
        step_axis(ax)
        ax.legend(fontsize=8)
    save(fig, output / "collapse.png")
    return [*lines, "![collapse](collapse.png)", ""]


# --------------------------------------------------------------------------------------------
# cut_off


def _cut_off(entries: Sequence[Entry], results: dict[str, Any], output: Path) -> list[str]:
    runs = results["runs"]
    audited = {name: runs[name] for name, _ in entries if (runs.get(name) or {}).get("cut_off")}
    if not audited:
        return []
    rows, reasons = [], []
    for name, record in audited.items():
        cut = record["cut_off"]
        found, changed = list(cut["parameters"]), cut.get("changed")
        unchanged = "n/a" if changed is None else f"{len(found) - len(changed)} of {len(found)}"
        rows.append(
            [
                name,
                cut["trainable"],
                ", ".join(found) or "none",
                unchanged if found else "",
                fmt((record.get("test") or {}).get("acc/main"), ".3f"),
            ]
        )
        by_reason: dict[str, list[str]] = {}
        for parameter, reason in cut["parameters"].items():
            by_reason.setdefault(reason, []).append(parameter)
        reasons += [[name, ", ".join(names), why] for why, names in by_reason.items()]
    header = [
        "run",
        "trainable parameters",
        "cut off at step 0",
        "of those, bitwise unchanged at the end",
        "main test acc",
    ]
    lines = [
        "## Parameters cut off from the loss (first step)",
        "",
        "`isolate.cutoff.cut_off_parameters(loss, model, trace=trace)` walks the graph of the loss "
        "the first step backpropagates (the main loss plus every branch's), its forward run "
        "inside `isolate.cutoff.trace_forward(model)`. A trainable parameter it cannot reach "
        "gets no "
        "gradient at all and keeps its value, however normal the run looks; the trace tells "
        "why. The suite compares each one at the end with its value at the first step, bit "
        "for bit.",
        "",
        table(header, rows),
        "",
    ]
    if reasons:
        lines += [table(["run", "parameters", "why (isolate's words)"], reasons), ""]
    return lines


# --------------------------------------------------------------------------------------------
# gradient_shares


def gradient_report_of(data: dict[str, Any]) -> Any:
    """The :class:`isolate.gradients.GradientReport` whose ``to_dict()`` is ``data`` (from
    run.json)."""
    from isolate.gradients import GradientReport, GroupStats

    def stats(name: str, d: dict[str, Any]) -> GroupStats:
        return GroupStats(
            name=name,
            parameters=tuple(d["parameters"]),
            numel=d["numel"],
            norms=d["norm"],
            shares=d["share"],
            cosines={tuple(k.split("|", 1)): v for k, v in d["cosine"].items()},
            frozen=tuple(d["frozen"]),
            frozen_numel=d["frozen_numel"],
        )

    return GradientReport(
        losses=tuple(data["losses"]),
        groups={name: stats(name, d) for name, d in data["groups"].items()},
        total=stats("total", data["total"]),
    )


def _cut_off_of(record: dict[str, Any]) -> Any:
    from isolate.cutoff import CutOff

    cut = record.get("cut_off")
    if cut is None:
        return None
    return CutOff(
        parameters=dict(cut["parameters"]),
        trainable=int(cut["trainable"]),
    )


def _gradient_shares(entries: Sequence[Entry], results: dict[str, Any], output: Path) -> list[str]:
    from isolate.figures import plot_report

    runs = results["runs"]
    drawn = {name: runs[name] for name, _ in entries if (runs.get(name) or {}).get("gradients")}
    if not drawn:
        return []
    lines = [
        "## Where each loss sends its gradient (first step)",
        "",
        "`isolate.gradient_report(losses, model, groups=...)` at the first step, drawn by "
        "`isolate.figures.plot_report(report, cut_off=...)`: each cell is the share of the "
        "loss's squared gradient norm that falls in the group (grey: no path from the loss), "
        "the trunk split into its layers; the last row counts the group's parameters that no "
        "loss reaches. The table sums each loss's share over the trunk's layers.",
        "",
    ]
    rows: list[list[Any]] = []
    images: list[str] = []
    for name, params in entries:
        record = drawn.get(name)
        if record is None:
            continue
        part = str(params.get("part", "trunk"))
        report = gradient_report_of(record["gradients"])
        layers = [s for g, s in report.groups.items() if g.split(".")[0] == part]
        for loss in report.losses:
            reached = [s.name for s in report.groups.values() if s.norms[loss] is not None]
            hit = sum(s.norms[loss] is not None for s in layers)
            share = sum(s.shares[loss] or 0.0 for s in layers)
            rows.append(
                [
                    name,
                    loss,
                    f"{100 * share:.1f}%" if hit else "no path",
                    f"{hit} of {len(layers)}",
                    ", ".join(reached) or "none",
                ]
            )
        fig = plot_report(report, cut_off=_cut_off_of(record))
        fig.suptitle(f"{name}: gradient share per loss and group, first step", fontsize=10)
        for label in fig.axes[0].get_xticklabels():  # long branch names would overlap
            label.set(rotation=20, horizontalalignment="right")
        file = f"gradient_shares_{name}.png"
        fig.savefig(output / file, dpi=110)
        images += [f"![{name}: gradient share per group]({file})", ""]
    header = ["run", "loss", "share in the trunk", "trunk layers reached", "groups reached"]
    return [*lines, table(header, rows), "", *images]


# --------------------------------------------------------------------------------------------
# thaw


def _thaw(entries: Sequence[Entry], results: dict[str, Any], output: Path) -> list[str]:
    runs = results["runs"]
    thawed = {name: runs[name] for name, _ in entries if (runs.get(name) or {}).get("thaw")}
    if not thawed:
        return []
    rows = []
    for name, record in thawed.items():
        thaw = record["thaw"]
        at = thaw.get("step")
        for layer, series in (record.get("drift_layers") or {}).items():
            cut = len(series) if at is None else at
            rows.append(
                [
                    name,
                    f"trunk.{layer}",
                    "never" if at is None else at,
                    largest(series[:cut]),
                    largest(series[cut:]) if series[cut:] else "",
                ]
            )
        steps, differing = thaw.get("checked_steps") or [], thaw.get("differing") or []
        world = thaw.get("world_size")
        same = sum(d == 0 for d in differing)
        rows.append(
            [
                name,
                f"all {thaw.get('parameters')} parameters, on every process",
                "",
                "",
                "1 process: trivially identical"
                if world == 1
                else f"bitwise equal at {same} of {len(steps)} steps on {world} processes",
            ]
        )
    header = ["run", "parameters", "thawed before step", "max|Δ| before", "max|Δ| from then on"]
    return [
        "## Thawing a frozen layer",
        "",
        "The trunk starts frozen; `IsolationCallback(thaw=[...])` makes a layer trainable "
        "before the given optimizer step. Each layer's parameters are compared with their "
        "start after every step (the largest difference over the processes), and from the "
        "thaw on each process's fingerprint of every full parameter "
        "(`isolate.fingerprints.fingerprint`, a DTensor's `full_tensor()`) is compared with "
        "rank 0's.",
        "",
        table(header, rows),
        "",
    ]


SECTIONS: dict[str, Section] = {
    "drift": _drift,
    "error": _error,
    "adversary": _adversary,
    "collapse": _collapse,
    "cut_off": _cut_off,
    "gradient_shares": _gradient_shares,
    "thaw": _thaw,
}


def render_declared(results: dict[str, Any], output: Path) -> list[str]:
    """The declared sections, in the order they are first declared, as Markdown lines.

    Raises:
        ValueError: a declaration names an unknown section kind.
    """
    grouped: dict[str, list[Entry]] = {}
    for name in results["runs"]:
        for section in results["variants"].get(name, {}).get("report", []):
            kind = section["section"]
            if kind not in SECTIONS:
                raise ValueError(
                    f"{name}: unknown report section {kind!r}; known: {sorted(SECTIONS)}"
                )
            params = {k: v for k, v in section.items() if k != "section"}
            grouped.setdefault(kind, []).append((name, params))
    lines: list[str] = []
    for kind, entries in grouped.items():
        lines += SECTIONS[kind](entries, results, output)
    return lines
