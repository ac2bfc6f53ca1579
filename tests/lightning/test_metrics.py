"""What the callback logs: gradient norms per isolation group, each equal to the norm of the
group's gradients computed by brute force, and the gradient figure handed to every logger
that takes figures (and only to those)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

from isolate import IsolationSpec, Thaw
from isolate.lightning.metrics import grad_norms, log_figure


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(2, 2)
        self.head = nn.Linear(2, 2)
        self.aux = nn.Linear(2, 1)
        self.probe = nn.Linear(2, 1)
        self.emb = nn.Embedding(4, 2, sparse=True)


def norm(*params: nn.Parameter) -> float:
    grads = [p.grad.to_dense().double().flatten() for p in params if p.grad is not None]
    return float(torch.cat(grads).norm())


def test_grad_norms_per_group_match_the_norm_of_the_groups_gradients() -> None:
    model = Model()
    spec = IsolationSpec(
        freeze=["trunk", "head.bias"],
        detach=["aux", "probe"],
        thaw=[Thaw("trunk", epoch=1, lr=0.1)],
    )
    handle = spec.apply(model)
    try:
        handle.attach([torch.optim.SGD([p for p in model.parameters() if p.requires_grad], 0.1)])
        handle.thaw("trunk")
        torch.manual_seed(1)
        for p in [*model.trunk.parameters(), model.head.weight, *model.aux.parameters()]:
            p.grad = torch.randn_like(p)
        # A sparse gradient with a repeated row, as an Embedding(sparse=True) leaves it: its
        # rows are summed before the norm is taken.
        model.emb(torch.tensor([1, 1, 2])).sum().backward()
        assert model.emb.weight.grad is not None and not model.emb.weight.grad.is_coalesced()
        # A gradient written onto a frozen parameter (by a hook, by hand) trains nothing.
        model.head.bias.grad = torch.full_like(model.head.bias, 100.0)
        trunk, aux = list(model.trunk.parameters()), list(model.aux.parameters())
        rest = [model.head.weight, model.emb.weight]
        assert grad_norms(handle, prefix="n/") == pytest.approx(
            {
                "n/aux": norm(*aux),
                "n/probe": 0.0,  # no gradient
                "n/trunk": norm(*trunk),
                "n/rest": norm(*rest),
                "n/total": norm(*trunk, *aux, *rest),
            },
            rel=1e-12,
        )
        assert norm(model.emb.weight) == pytest.approx(10**0.5)  # rows 2 * ones and ones
    finally:
        handle.restore()


class Experiment:
    def __init__(self) -> None:
        self.figures: list[tuple[str, Any, int]] = []

    def add_figure(self, tag: str, figure: Any, global_step: int) -> None:
        self.figures.append((tag, figure, global_step))


def test_the_figure_goes_to_every_logger_that_takes_figures_and_counts_them() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"body": nn.Linear(3, 3), "head": nn.Linear(3, 1), "idle": nn.Linear(3, 1)}
    )
    h = model["body"](torch.randn(4, 3))
    losses = {"main": model["head"](h).pow(2).mean(), "l2": h.pow(2).mean()}
    total = losses["main"] + losses["l2"]
    first, second = Experiment(), Experiment()
    loggers = [
        types.SimpleNamespace(experiment=first),
        types.SimpleNamespace(experiment=object()),  # an experiment without add_figure
        object(),  # a logger without an experiment
        types.SimpleNamespace(experiment=second),
    ]
    fit = types.SimpleNamespace(is_global_zero=True, global_step=7, loggers=loggers)
    assert log_figure(fit, model, losses, total, ["idle"], tag="fig") == 2  # type: ignore[arg-type]
    assert [(tag, step) for tag, _, step in first.figures + second.figures] == [
        ("fig", 7),
        ("fig", 7),
    ]
    axes = first.figures[0][1].axes[0]
    assert [t.get_text() for t in axes.get_yticklabels()] == ["main", "l2", "cut off"]
    # idle is expected unused: not counted as cut off
    assert [t.get_text() for t in axes.texts if t.get_position()[1] == 2] == ["none"] * 3
    rank_one = types.SimpleNamespace(is_global_zero=False, global_step=7, loggers=loggers)
    assert log_figure(rank_one, model, losses, total, ["idle"]) == 0  # type: ignore[arg-type]
    assert len(first.figures) == 1
