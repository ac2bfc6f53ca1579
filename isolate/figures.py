"""Pictures of the audits: which loss reaches which parameter group, and how much.

matplotlib is optional: this module imports it when a figure is drawn, and ``import
isolate`` never imports this module. The figures are plain ``matplotlib.figure.Figure``
objects, made without ``pyplot``, so they need no display and leave no global state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from isolate.cutoff import CutOff
from isolate.errors import IsolationTypeError
from isolate.gradients import GradientReport, GroupStats

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["cell_text", "plot_report"]


def _matplotlib() -> Any:
    try:
        import matplotlib.figure
    except ImportError as error:
        raise ImportError(
            "isolate.figures needs matplotlib, an optional dependency: pip install matplotlib"
        ) from error
    return matplotlib.figure


def cell_text(stats: GroupStats, loss: str) -> str:
    """What a cell of :func:`plot_report` shows for ``loss`` on one group.

    ``"no path"`` when the loss does not reach the group, ``"frozen"`` when nothing in the
    group trains, ``"0"`` for a path that carries an exactly zero gradient, else the share
    of the loss's squared gradient norm in percent and the norm.
    """
    norm = stats.norms[loss]
    if norm is None:
        return "frozen" if not stats.numel and stats.frozen_numel else "no path"
    share = stats.shares[loss]
    if norm == 0.0 or share is None:
        return "0"
    return f"{100 * share:.1f}%\n|g| {norm:.2e}"


def _check_inputs(report: object, cut_off: object, caller: str) -> None:
    if not isinstance(report, GradientReport):
        raise IsolationTypeError(
            f"{caller}: report must be a GradientReport (from isolate.gradient_report), got "
            f"{type(report).__name__}"
        )
    if cut_off is not None and not isinstance(cut_off, CutOff):
        raise IsolationTypeError(
            f"{caller}: cut_off must be the CutOff of isolate.cutoff.cut_off_parameters, got "
            f"{type(cut_off).__name__}"
        )


def plot_report(report: GradientReport, *, cut_off: CutOff | None = None) -> Figure:
    """A losses x parameter groups matrix: reach, and each loss's gradient share per group.

    Cell colour is the share of the loss's squared gradient norm that falls in the group (0
    to 1, white for a path with a zero gradient); unreached cells are grey and say ``no
    path``; frozen groups say ``frozen``. With
    ``cut_off=`` a last row counts the group's trainable parameters that no loss reaches.

    Args:
        report: a :class:`~isolate.gradients.GradientReport`.
        cut_off: the :class:`~isolate.cutoff.CutOff` of the same step, for the last row.

    Returns:
        A ``matplotlib.figure.Figure`` (not registered with ``pyplot``): save it with
        ``fig.savefig(path)`` or log it with a logger's ``add_figure``.

    Raises:
        IsolationTypeError: ``report`` or ``cut_off`` has the wrong type.
        ImportError: matplotlib is not installed.

    >>> import torch
    >>> from torch import nn
    >>> from isolate import gradient_report
    >>> model = nn.ModuleDict({"encoder": nn.Linear(3, 3), "head": nn.Linear(3, 1)})
    >>> h = model["encoder"](torch.randn(4, 3))
    >>> losses = {"main": model["head"](h).pow(2).mean(), "l2": h.pow(2).mean()}
    >>> fig = plot_report(gradient_report(losses, model))
    >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
    ['encoder', 'head']
    """
    _check_inputs(report, cut_off, "plot_report()")
    figure_module = _matplotlib()
    import numpy as np
    from matplotlib import colormaps

    groups = list(report.groups.values())
    rows = list(report.losses) + (["cut off"] if cut_off is not None else [])
    shares = np.full((len(rows), len(groups)), np.nan)
    for i, loss in enumerate(report.losses):
        for j, stats in enumerate(groups):
            if stats.norms[loss] is not None:  # reached: a share, 0 for a zero gradient
                shares[i, j] = stats.shares[loss] or 0.0
    fig: Figure = figure_module.Figure(
        figsize=(1.6 + 1.3 * len(groups), 0.9 + 0.6 * len(rows)), layout="constrained"
    )
    ax = fig.add_subplot()
    cmap = colormaps["Blues"].with_extremes(bad="#d9d9d9")
    image = ax.imshow(np.ma.masked_invalid(shares), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for i, loss in enumerate(report.losses):
        for j, stats in enumerate(groups):
            value = shares[i, j]
            dark = not np.isnan(value) and value > 0.6
            ax.text(
                j,
                i,
                cell_text(stats, loss),
                ha="center",
                va="center",
                fontsize=8,
                color="white" if dark else "black",
            )
    if cut_off is not None:
        row = len(report.losses)
        for j, stats in enumerate(groups):
            count = sum(name in cut_off.parameters for name in stats.parameters)
            ax.text(
                j,
                row,
                str(count) if count else "none",
                ha="center",
                va="center",
                fontsize=8,
                color="#b30000" if count else "black",
                fontweight="bold" if count else "normal",
            )
    ax.set_xticks(range(len(groups)), [stats.name for stats in groups])
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("parameter group")
    ax.set_title("gradient share per group (grey: no path)", fontsize=10)
    fig.colorbar(image, ax=ax, label="share of |g|²")
    return fig
