"""attach and load_state_dict refuse in the caller's name (the spec, or the integration that
applied it) and change nothing: a bad optimizer, a held BatchNorm or frozen parameter replaced
since apply, a malformed saved state or plateau state."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from isolate import IsolationSpec, Thaw
from isolate.errors import (
    CheckpointMismatchError,
    IsolationTypeError,
    ReplacedParameterError,
    SpecError,
)
from isolate.spec.handle import IsolationHandle
from isolate.spec.isolation import apply

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(norm=nn.BatchNorm1d(2), trunk=nn.Linear(2, 3), head=nn.Linear(3, 1))
    )


def applied(caller: str) -> IsolationHandle:
    spec = IsolationSpec(
        freeze=["norm", "trunk"], thaw=[Thaw("trunk", monitor="val_loss", lr=0.01)]
    )
    return apply(spec, net(), caller=caller, warn=lambda text: None)


@pytest.mark.parametrize("caller", ["IsolationSpec", "IsolationCallback"])
def test_attach_refuses_in_the_callers_name_and_changes_nothing(caller: str) -> None:
    handle = applied(caller)
    model = handle.plan.model
    try:
        with pytest.raises(IsolationTypeError, match=rf"^{caller}\.attach\(\): optimizer must"):
            handle.attach("sgd")  # type: ignore[arg-type]
        opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
        norm = model.norm
        model.norm = nn.BatchNorm1d(2)  # as sync_batchnorm does: the held layer is gone
        with pytest.raises(SpecError, match=rf"^{caller}: 1 frozen BatchNorm layers were"):
            handle.attach(opt)
        model.norm = norm
        weight = model.trunk.weight
        model.trunk.weight = nn.Parameter(weight.detach().clone())  # replaced since apply
        with pytest.raises(ReplacedParameterError, match=rf"^{caller}: at attach, the spec's"):
            handle.attach(opt)
        model.trunk.weight = weight
        assert [len(g["params"]) for g in opt.param_groups] == [2]  # nothing was attached
        handle.attach(opt)  # all put back: it attaches
    finally:
        handle.restore()


@pytest.mark.parametrize("caller", ["IsolationSpec", "IsolationCallback"])
def test_a_bad_saved_state_is_refused_in_the_callers_name(caller: str) -> None:
    handle = applied(caller)
    try:
        good = handle.state_dict()
        with pytest.raises(CheckpointMismatchError, match=rf"^{caller}: the saved isolation"):
            handle.load_state_dict({"format": good["format"]})
        bad_phases = {**good, "phases": {"fired": [], "plateaus": {"nowhere": {}}}}
        with pytest.raises(CheckpointMismatchError, match=rf"^{caller}: the saved plateau"):
            handle.load_state_dict(bad_phases)
        assert handle.state_dict() == good
    finally:
        handle.restore()
