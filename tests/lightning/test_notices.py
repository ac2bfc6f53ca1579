"""What the callback says at the start of training: which modules Lightning reports in eval
mode are held there by the spec, and which are in eval mode for another reason."""

from __future__ import annotations

import logging
import types
from typing import Any

import lightning_utilities.core.rank_zero as rank_zero
import pytest
import torch
from torch import nn

from isolate import IsolationSpec, IsolationWarning
from isolate.freezing import frozen
from isolate.ledger import ledger
from isolate.lightning.notices import explain_eval_modes, print_ledger, warn_on_norm_clipping
from tests.lightning._models import Net


def test_the_modules_held_in_eval_are_told_apart_from_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    net = Net()
    net.norm = nn.BatchNorm1d(2)
    net.drop = nn.Dropout()
    with frozen(net, "norm", bn="eval"):
        net.train()
        net.norm(torch.zeros(3, 2))  # the hold puts it back in eval mode at its forward
        net.drop.eval()  # in eval mode by the user's hand
        # rank_zero_info logs through the logger Lightning installed last (the experiments'
        # CLI raises those to WARNING); listen to that one at INFO.
        with caplog.at_level(logging.INFO, logger=rank_zero.log.name):
            explain_eval_modes(net)
    assert [r.getMessage() for r in caplog.records] == [
        "IsolationCallback: 1 of the 2 module(s) Lightning finds in eval mode at the start of "
        "training are held there by the spec (a frozen part in eval mode, through "
        "model.train()): norm; the other 1 are in eval mode for another reason: drop"
    ]


def test_nothing_is_said_when_the_spec_holds_no_module_in_eval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    net = Net()
    net.drop = nn.Dropout().eval()
    with caplog.at_level(logging.INFO, logger=rank_zero.log.name):
        explain_eval_modes(net)
    assert caplog.records == []


class Recorder:
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.logged.append((metrics, step))


def test_the_ledger_is_printed_in_full_to_forty_rows_and_its_summary_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"trunk": nn.Sequential(*(nn.Linear(2, 2) for _ in range(21))), "aux": nn.Linear(2, 1)}
    )
    handle = IsolationSpec(detach=["aux"]).apply(model)
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        features = model["trunk"](torch.randn(3, 2))
        aux = model["aux"](features).pow(2).mean()
        total = features.sum() + aux
        fit = types.SimpleNamespace(optimizers=[optimizer], global_step=3, loggers=[Recorder()])
        with caplog.at_level(logging.INFO, logger=rank_zero.log.name):
            book = print_ledger(fit, model, handle, {"aux": aux}, total)  # type: ignore[arg-type]
        # The ledger of the named losses and the step's total, the optimizers and the spec.
        expected = ledger(model, {"aux": aux, "total": total}, [optimizer], spec=handle)
        assert book.to_dict() == expected.to_dict()
        assert len(expected.rows) == 44 and not expected.irregular
        assert [r.getMessage() for r in caplog.records] == [
            f"IsolationCallback: the parameters at step 3\n{expected.format(limit=40)}"
        ]
        summary = {f"isolation/ledger/{k}": v for k, v in expected.summary().items()}
        assert None not in summary.values()
        assert fit.loggers[0].logged == [(summary, 3)]
        # Losses that are no mapping (training_step named none) leave the total alone.
        assert print_ledger(fit, model, handle, None, total).losses == ("total",)  # type: ignore[arg-type]
    finally:
        handle.restore()


def test_a_trainer_that_names_no_clipping_algorithm_is_taken_to_clip_by_norm() -> None:
    # Lightning's default algorithm is the norm; a trainer that does not name one clips so.
    fit = types.SimpleNamespace(gradient_clip_val=0.5)
    with pytest.warns(IsolationWarning, match=r"^IsolationCallback: gradient_clip_val=0\.5 clips"):
        warn_on_norm_clipping(fit, ("aux",))  # type: ignore[arg-type]


def said(net: nn.Module, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What explain_eval_modes logs for ``net``."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=rank_zero.log.name):
        explain_eval_modes(net)
    return [r.getMessage() for r in caplog.records]


def test_five_held_modules_are_named_and_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    net = nn.ModuleDict({f"n{i}": nn.BatchNorm1d(2) for i in range(6)})
    net.update({f"d{i}": nn.Dropout() for i in range(6)})
    start = "IsolationCallback: {} of the {} module(s) Lightning finds in eval mode at the start "
    start += "of training are held there by the spec (a frozen part in eval mode, through "
    start += "model.train()): "
    with frozen(net, *(f"n{i}" for i in range(5)), bn="eval"):
        net.train()
        for i in range(5):
            net[f"n{i}"](torch.zeros(3, 2))  # the hold puts it back in eval mode
        assert said(net, caplog) == [start.format(5, 5) + "n0, n1, n2, n3, n4"]
    with frozen(net, *(f"n{i}" for i in range(6)), bn="eval"):
        net.train()
        for i in range(6):
            net[f"n{i}"](torch.zeros(3, 2))
        for i in range(6):
            net[f"d{i}"].eval()  # in eval mode by the user's hand
        net.training = False  # the root too, and named so
        assert said(net, caplog) == [
            start.format(6, 13) + "n0, n1, n2, n3, n4 and 1 more; the other 7 are in eval mode "
            "for another reason: <root>, d0, d1, d2, d3"
        ]
