"""What the callback says at the start of training: which modules Lightning reports in eval
mode are held there by the spec, and which are in eval mode for another reason."""

from __future__ import annotations

import logging

import lightning_utilities.core.rank_zero as rank_zero
import pytest
import torch
from torch import nn

from isolate.freezing import frozen
from isolate.lightning.notices import explain_eval_modes
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
