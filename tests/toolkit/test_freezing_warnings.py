"""Where freeze's warnings point: the user's line, past the frames isolate, torch's compile
guard and contextlib put above it.

mutmut's trampolines add frames of their own: mutation runs leave this file out."""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

import isolate
from isolate import freeze, frozen


def test_the_exposure_warning_points_at_the_line_that_froze() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    decayed = torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lines = [sys._getframe().f_lineno + 1]
        handle = freeze(net, "1", optimizer=decayed)
        handle.restore()
        lines.append(sys._getframe().f_lineno + 1)
        with frozen(net, "1", optimizer=decayed):
            pass
    assert all(issubclass(w.category, isolate.IsolationWarning) for w in caught)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line) for line in lines]
