"""isolate.figures: the report matrix renders, and every cell says what the report says."""

from __future__ import annotations

import io
import re
import sys

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from torch import nn

from isolate import gradient_report
from isolate.cutoff import cut_off_parameters
from isolate.errors import IsolationTypeError
from isolate.figures import cell_text, plot_report

matplotlib.use("Agg")


def scene() -> tuple[nn.ModuleDict, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "trunk": nn.Linear(4, 4),
            "head": nn.Linear(4, 2),
            "probe": nn.Linear(4, 2),
            "idle": nn.Linear(4, 4),
            "stem": nn.Linear(4, 4),
        }
    )
    model["stem"].requires_grad_(False)  # a frozen group
    h = model["trunk"](model["stem"](torch.randn(6, 4)))
    losses = {
        "main": model["head"](h).pow(2).mean(),
        "probe": model["probe"](h.detach()).pow(2).mean(),
        "zero": 0 * model["head"](h).sum(),  # a live path with an exactly zero gradient
    }
    return model, losses


def texts(fig: Figure) -> dict[tuple[int, int], str]:
    ax = fig.axes[0]
    return {
        (round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts
    }


def test_cells_match_the_report_and_the_figure_renders() -> None:
    model, losses = scene()
    report = gradient_report(losses, model)
    cut = cut_off_parameters(losses, model)
    fig = plot_report(report, cut_off=cut)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    groups = list(report.groups)
    assert groups == ["trunk", "head", "probe", "idle", "stem"]
    assert [t.get_text() for t in ax.get_xticklabels()] == groups
    assert [t.get_text() for t in ax.get_yticklabels()] == ["main", "probe", "zero", "cut off"]
    # The colours are the shares; unreached cells are masked (grey).
    shown = ax.images[0].get_array()
    for i, loss in enumerate(report.losses):
        for j, group in enumerate(groups):
            stats = report[group]
            if stats.norms[loss] is None:  # no path: grey
                assert shown.mask[i, j]
            else:
                assert not shown.mask[i, j]
                assert shown[i, j] == pytest.approx(stats.shares[loss] or 0.0)
    assert shown[2, 1] == 0.0 and report["head"].norms["zero"] == 0.0
    cells = texts(fig)
    main_trunk = report["trunk"]
    assert cells[(0, 0)] == (
        f"{100 * main_trunk.shares['main']:.1f}%\n|g| {main_trunk.norms['main']:.2e}"
    )
    assert cells[(1, 0)] == "no path"  # the probe is detached from the trunk
    assert cells[(1, 2)].startswith("100.0%")
    assert cells[(2, 1)] == "0"  # reached, zero gradient: not "no path"
    assert cells[(0, 3)] == "no path" and cells[(0, 4)] == "frozen"
    assert [cells[(3, j)] for j in range(5)] == ["none", "none", "none", "2", "none"]
    assert {(t.get_horizontalalignment(), t.get_verticalalignment()) for t in ax.texts} == {
        ("center", "center")
    }  # every number centred in its cell
    png = io.BytesIO()
    fig.savefig(png, format="png")
    assert png.getvalue()[:8] == b"\x89PNG\r\n\x1a\n" and len(png.getvalue()) > 5000


def test_cell_text_for_every_case() -> None:
    model, losses = scene()
    report = gradient_report(losses, model)
    assert cell_text(report["stem"], "main") == "frozen"
    assert cell_text(report["idle"], "main") == "no path"
    assert cell_text(report["head"], "zero") == "0"
    share = report["head"].shares["main"]
    assert share is not None
    assert cell_text(report["head"], "main").startswith(f"{100 * share:.1f}%\n|g| ")


def test_without_cut_off_there_is_no_last_row() -> None:
    model, losses = scene()
    fig = plot_report(gradient_report(losses, model))
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["main", "probe", "zero"]
    assert np.asarray(fig.axes[0].images[0].get_array()).shape == (3, 5)


def test_wrong_types() -> None:
    with pytest.raises(IsolationTypeError, match=r"^plot_report\(\): report must be"):
        plot_report({"main": 1.0})  # type: ignore[arg-type]
    model, losses = scene()
    report = gradient_report(losses, model)
    with pytest.raises(IsolationTypeError, match=r"^plot_report\(\): cut_off must be"):
        plot_report(report, cut_off={"a": "b"})  # type: ignore[arg-type]


def test_a_cell_turns_white_only_above_a_share_of_sixty_percent() -> None:
    model = nn.ModuleDict({"a": nn.Linear(3, 1, bias=False), "b": nn.Linear(2, 1, bias=False)})
    loss = model["a"].weight.sum() + model["b"].weight.sum()  # squared norms 3 and 2
    fig = plot_report(gradient_report({"main": loss}, model))
    assert [(t.get_text().split()[0], t.get_color()) for t in fig.axes[0].texts] == [
        ("60.0%", "black"),
        ("40.0%", "black"),
    ]
    wide = nn.ModuleDict({"a": nn.Linear(4, 1, bias=False), "b": nn.Linear(1, 1, bias=False)})
    loss = wide["a"].weight.sum() + wide["b"].weight.sum()  # 80% in a
    fig = plot_report(gradient_report({"main": loss}, wide))
    assert [t.get_color() for t in fig.axes[0].texts] == ["white", "black"]


def test_wrong_types_are_named() -> None:
    with pytest.raises(IsolationTypeError, match=r"report must be a GradientReport .*, got dict$"):
        plot_report({"main": 1.0})  # type: ignore[arg-type]
    model, losses = scene()
    with pytest.raises(IsolationTypeError, match=r"cut_off_parameters, got list$"):
        plot_report(gradient_report(losses, model), cut_off=["trunk"])  # type: ignore[arg-type]


def test_without_matplotlib_a_figure_asks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    model, losses = scene()
    report = gradient_report(losses, model)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    message = "isolate.figures needs matplotlib, an optional dependency: pip install matplotlib"
    with pytest.raises(ImportError, match=f"^{re.escape(message)}$"):
        plot_report(report)


def test_the_matrix_is_sized_by_its_cells_on_a_fixed_blue_scale_with_grey_for_no_path() -> None:
    model = nn.ModuleDict({"a": nn.Linear(3, 1, bias=False), "b": nn.Linear(2, 1, bias=False)})
    loss = model["a"].weight.sum() + model["b"].weight.sum()  # shares 0.6 and 0.4
    fig = plot_report(
        gradient_report({"main": loss}, model), cut_off=cut_off_parameters(loss, model)
    )
    assert tuple(fig.get_size_inches()) == pytest.approx((1.6 + 1.3 * 2, 0.9 + 0.6 * 2))
    assert isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine)
    image = fig.axes[0].images[0]
    assert image.get_clim() == (0.0, 1.0)  # not the shares' own range, 0.4 to 0.6
    assert image.get_cmap().name == "Blues"
    assert image.get_cmap().get_bad() == pytest.approx(to_rgba("#d9d9d9"))
    assert fig.axes[0].get_aspect() == "auto"


def test_every_cell_is_in_small_print_and_a_cut_off_count_in_bold_red() -> None:
    model, losses = scene()
    fig = plot_report(gradient_report(losses, model), cut_off=cut_off_parameters(losses, model))
    assert {t.get_fontsize() for t in fig.axes[0].texts} == {8}
    last = {round(t.get_position()[0]): t for t in fig.axes[0].texts if t.get_position()[1] == 3}
    assert [last[j].get_text() for j in range(5)] == ["none", "none", "none", "2", "none"]
    styles = [(to_rgba(last[j].get_color()), last[j].get_fontweight()) for j in range(5)]
    plain, alarm = (to_rgba("black"), "normal"), (to_rgba("#b30000"), "bold")
    assert styles == [plain, plain, plain, alarm, plain]


def test_the_axes_the_title_and_the_colour_bar_say_what_is_shown() -> None:
    model, losses = scene()
    fig = plot_report(gradient_report(losses, model))
    ax, bar = fig.axes
    assert ax.get_xlabel() == "parameter group"
    assert ax.get_title() == "gradient share per group (grey: no path)"
    assert ax.title.get_fontsize() == 10
    assert bar.get_ylabel() == "share of |g|²"
    assert ax.images[0].colorbar is not None and ax.images[0].colorbar.ax is bar
    with matplotlib.rc_context({"font.size": 14}):  # a user's style: the sizes stay
        ax = plot_report(gradient_report(losses, model)).axes[0]
    assert ax.title.get_fontsize() == 10 and {t.get_fontsize() for t in ax.texts} == {8}


def test_a_zero_share_reads_zero_and_a_partly_frozen_group_out_of_reach_reads_no_path() -> None:
    model = nn.ModuleDict({"a": nn.Linear(1, 1), "b": nn.Linear(1, 1), "c": nn.Linear(1, 1)})
    model["c"].bias.requires_grad_(False)
    loss = model["a"].weight.sum() + 0 * model["b"].weight.sum()
    report = gradient_report({"main": loss}, model)
    assert report["b"].norms["main"] == 0.0 and report["b"].shares["main"] == 0.0
    assert cell_text(report["b"], "main") == "0"  # reached with a zero gradient
    assert cell_text(report["a"], "main") == "100.0%\n|g| 1.00e+00"
    assert report["c"].size == "1 (+1 frozen)" and cell_text(report["c"], "main") == "no path"
