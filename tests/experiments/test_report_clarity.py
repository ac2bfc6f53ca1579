"""The report says what its numbers mean: the figures and sentences a reader could misread.

Each test feeds :func:`experiments.report.write_report` a small, hand-made set of results and
checks the figure (captured before it is saved) or the text it produces.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import experiments.report as report
import experiments.sections as sections

STEPS = 20
VAL = {"step": [10, 20]}


def _run(**fields: Any) -> dict[str, Any]:
    return {
        "status": "ok",
        "steps": STEPS,
        "strategy": "SingleDeviceStrategy",
        "world_size": 1,
        **fields,
    }


def _drift(buffers: float, counters: float) -> dict[str, Any]:
    return {
        "drift": {
            "parameters": [0.0] * STEPS,
            "buffers": [buffers] * STEPS,
            "counters": [counters] * STEPS,
        },
        "drift_final": {
            "parameters": 0.0,
            "buffers": buffers,
            "counters": counters,
            "moved": {"1.running_mean": buffers} if buffers else {},
            "checked": ["0.weight", "1.running_mean"],
        },
    }


def results(*, probe_acc: float = 0.502) -> dict[str, Any]:
    """A baseline, a detached run, a reversal, two frozen trunks and the SimSiam pair."""
    chance = {"acc/main": 0.116}
    runs = {
        "baseline": _run(
            val={**VAL, "acc/main": [0.74, 0.82]},
            test={"acc/main": 0.84},
            chance=chance,
            grad_delta=[0.0] * STEPS,
        ),
        "detached": _run(
            val={
                **VAL,
                "acc/main": [0.74, 0.82],
                "acc/probe": [0.2, 0.3],
                "acc/ink_probe": [0.5, 0.63],
            },
            test={"acc/main": 0.84, "acc/probe": 0.38, "acc/ink_probe": 0.66},
            chance={**chance, "acc/probe": 0.116, "acc/ink_probe": 0.502},
            grad_delta=[0.0] * STEPS,
        ),
        "reversal": _run(
            val={
                **VAL,
                "acc/main": [0.7, 0.73],
                "acc/adversary": [0.5, 0.5],
                "acc/ink_probe": [0.5, probe_acc],
            },
            test={"acc/main": 0.75, "acc/adversary": 0.502, "acc/ink_probe": probe_acc},
            chance={**chance, "acc/adversary": 0.502, "acc/ink_probe": 0.502},
            grad_delta=[0.05 + i / 100 for i in range(STEPS)],
            hparams={"branches": [{"name": "adversary", "alpha": -0.1}]},
        ),
        "frozen": _run(
            val={**VAL, "acc/main": [0.45, 0.62]},
            test={"acc/main": 0.644},
            chance=chance,
            grad_delta=[None, None] + [0.1] * (STEPS - 2),
            **_drift(0.0, 0.0),
        ),
        "naive": _run(
            val={**VAL, "acc/main": [0.55, 0.73]},
            test={"acc/main": 0.722},
            chance=chance,
            **_drift(0.846, 20.0),
        ),
        "siam": _run(
            train={
                "step": list(range(1, STEPS + 1)),
                "z_std": [0.1] * STEPS,
                "z_std_ref": [0.125] * STEPS,
                "loss": [-0.5] * STEPS,
            },
            val={"step": [10, 20], "knn_acc": [0.87, 0.85]},
            test={"knn_acc": 0.876},
        ),
    }
    variants = {
        "baseline": {"role": "the reference", "reference": True},
        "detached": {"role": "probe", "compare_with": "baseline"},
        "reversal": {
            "role": "reversal",
            "compare_with": "baseline",
            "report": [
                {
                    "section": "adversary",
                    "adversary": "adversary",
                    "probe": "ink_probe",
                    "without": "detached",
                }
            ],
        },
        "frozen": {"role": "frozen", "compare_with": "baseline", "report": [{"section": "drift"}]},
        "naive": {"role": "naive", "compare_with": "baseline", "report": [{"section": "drift"}]},
        "siam": {"role": "simsiam", "report": [{"section": "collapse"}]},
    }
    return {
        "setup": {
            "quick": True,
            "ddp": False,
            "threads": 1,
            "torch": "x",
            "lightning": "y",
            "presets": [],
            "data": {"note": "fake", "split": {"dataset": "mnist"}},
        },
        "variants": variants,
        "runs": runs,
        "checks": [],
        "skipped": {},
        "trunk_vs_reference": {
            "detached": {"bitwise_equal": True, "max_delta": 0.0, "counters_delta": 0.0},
            "reversal": {"bitwise_equal": False, "max_delta": 0.33, "counters_delta": 0.0},
            "frozen": {"bitwise_equal": False, "max_delta": 0.41, "counters_delta": 20.0},
        },
    }


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``write_report`` with each figure kept (by file name) instead of only saved."""
    figures: dict[str, Any] = {}

    def keep(fig: Any, path: Path) -> None:
        fig.canvas.draw()  # lay out ticks and legends as the saved file has them
        figures[path.name] = fig
        fig.savefig(path)

    monkeypatch.setattr(sections, "save", keep)
    monkeypatch.setattr(report, "save", keep)

    def write(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        report.write_report(data, tmp_path)
        return (tmp_path / "report.md").read_text(), figures

    yield write
    plt = sections.pyplot()
    for fig in figures.values():
        plt.close(fig)


def cells(line: str) -> list[str]:
    """A Markdown table row's cells (``\\|`` inside a cell is not a border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _visible_ticks(ax: Any) -> list[float]:
    low, high = sorted(ax.get_xlim())
    return [t for t in ax.get_xticks() if low <= t <= high]


@pytest.mark.parametrize(
    "name", ["gradient_delta.png", "collapse.png", "drift.png", "accuracy.png"]
)
def test_step_axes_tick_whole_steps(drawn: Any, name: str) -> None:
    _, figures = drawn(results())
    for ax in figures[name].axes:
        ticks = _visible_ticks(ax)
        assert ticks, name
        assert all(float(t).is_integer() for t in ticks), (name, ticks)


def test_the_accuracy_legends_cover_no_curve_and_chance_lines_differ(drawn: Any) -> None:
    _, figures = drawn(results())
    fig = figures["accuracy.png"]
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        plot_area = ax.get_window_extent(renderer)
        assert legend.y1 <= plot_area.y0  # below the axes: no curve under it
    side = fig.axes[1]
    chance = [line for line in side.get_lines() if line.get_label().startswith("chance")]
    assert len(chance) == 2  # 10 classes (0.116) and the binary attribute (0.502)
    styles = {(line.get_linestyle(), line.get_color()) for line in chance}
    assert len(styles) == 2
    assert {t.get_text() for t in side.texts} == {"chance 0.116", "chance 0.502"}


def test_the_final_trunk_keeps_the_batch_counter_apart_from_the_weights(drawn: Any) -> None:
    text, _ = drawn(results())
    header = next(line for line in text.splitlines() if line.startswith("| run | compared with"))
    columns = cells(header)
    assert columns[-2:] == [
        "final trunk max\\|Δ\\| (weights, running statistics)",
        "final num_batches_tracked Δ",
    ]
    rows = text.split(header, 1)[1].split("\n\n", 1)[0]
    row = next(line for line in rows.splitlines() if line.startswith("| frozen |"))
    assert cells(row)[-2:] == ["0.41", "20"]


def test_the_report_says_the_trunk_is_randomly_initialised(drawn: Any) -> None:
    text, _ = drawn(results())
    assert "a randomly initialised network (no pretrained weights)" in text
    drift = text.split("## Frozen trunk", 1)[1].split("\n## ", 1)[0]
    assert "The trunk is randomly initialised (seed 0), not pretrained" in drift
    assert "In naive the BatchNorm running statistics moved anyway" in drift
    assert "0.722 against frozen's 0.644" in drift


@pytest.mark.parametrize(
    ("probe_acc", "says", "never"),
    [
        (0.502, "The probe does no better than chance either", "still linearly readable"),
        (0.731, "The attribute is still linearly readable", "no better than chance"),
    ],
)
def test_the_reversal_paragraph_reads_the_probe_against_chance(
    drawn: Any, probe_acc: float, says: str, never: str
) -> None:
    text, _ = drawn(results(probe_acc=probe_acc))
    paragraph = text.split("## Gradient reversal: reversal", 1)[1].split("\n## ", 1)[0]
    assert says in paragraph and never not in paragraph
    assert "still reads the attribute" not in paragraph
    if probe_acc <= 0.502:
        assert (
            f"reaches {probe_acc:.3f} (chance: the majority class alone gives 0.502)" in paragraph
        )
    else:
        assert f"reaches {probe_acc:.3f} (above chance, the majority class's 0.502)" in paragraph


def test_the_suite_compares_final_trunks_with_the_batch_counter_apart(tmp_path: Path) -> None:
    import torch

    from experiments.recording import TRUNK_FILE
    from experiments.suite import _compare_trunks
    from experiments.variants import Variant

    def trunk(weight: float, counter: int) -> dict[str, torch.Tensor]:
        return {
            "0.weight": torch.full((2,), weight),
            "1.running_mean": torch.zeros(2),
            "1.num_batches_tracked": torch.tensor(counter),
        }

    for name, state in (("base", trunk(1.0, 20)), ("frozen", trunk(1.25, 0))):
        (tmp_path / name).mkdir()
        torch.save(state, tmp_path / name / TRUNK_FILE)
    variants = [Variant("frozen", tmp_path / "frozen.yaml", compare_with="base")]
    compared = _compare_trunks(tmp_path, variants, {"frozen": {}})["frozen"]
    assert compared["max_delta"] == 0.25  # the weight, not the 20 batches counted
    assert compared["counters_delta"] == 20.0
    assert compared["bitwise_equal"] is False


def test_suite_help_names_each_option_type_without_a_lambda() -> None:
    from experiments.parsing import suite_parser

    text = suite_parser().format_help()
    assert "lambda" not in text and "<function" not in text
    assert "--data.dataset {mnist,fashion_mnist}" in text
