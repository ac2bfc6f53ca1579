"""The thaw groups of an applied spec: spacing by ``after_previous``, the BatchNorm layers a
thaw gives back, and the caller a refused thaw names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isolate import IsolationSpec, Thaw
from isolate.errors import ReplacedParameterError
from tests.spec._models import Net


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(2, 2) for _ in range(5)))


def test_after_previous_counts_from_the_thaw_listed_just_before() -> None:
    """Layer 0 thaws at once (the first thaw has nothing to wait for, whatever its gap);
    layer 2 waits one epoch after layer 1 (not after layer 0, which thawed long before);
    layer 3 waits two epochs after layer 2, on the boundary exactly."""
    spec = IsolationSpec(
        freeze=["0", "1", "2", "3"],
        thaw=[
            Thaw("0", epoch=0, lr=0.1, after_previous=2),
            Thaw("1", epoch=3, lr=0.1),
            Thaw("2", epoch=1, lr=0.1, after_previous=1),
            Thaw("3", epoch=0, lr=0.1, after_previous=2),
        ],
    )
    model = _layers()
    opt = torch.optim.SGD(model[4].parameters(), lr=0.1)
    with spec.applied(model, opt) as handle:
        at = {e: handle.step(epoch=e, step=e) for e in range(9)}
        assert [g["lr"] for g in opt.param_groups] == [0.1] * 5
    assert {e: names for e, names in at.items() if names} == {
        0: ["0"],
        3: ["1"],
        4: ["2"],
        6: ["3"],
    }


def test_a_spaced_thaw_waits_for_the_one_before_it_however_late() -> None:
    spec = IsolationSpec(
        freeze=["0", "1"],
        thaw=[Thaw("0", step=5, lr=0.1), Thaw("1", epoch=0, lr=0.1, after_previous=1)],
    )
    model = _layers()
    opt = torch.optim.SGD(model[4].parameters(), lr=0.1)
    with spec.applied(model, opt) as handle:
        assert handle.due(epoch=3, step=4) == []  # "1" is due by epoch, "0" has not thawed
        assert handle.step(epoch=3, step=5) == ["0"]
        assert handle.due(epoch=3, step=6) == []  # one epoch after "0": epoch 4
        assert handle.step(epoch=4, step=7) == ["1"]


def test_a_thawed_groups_norms_are_no_longer_held_or_watched() -> None:
    """Once ``trunk.1`` (a BatchNorm) thaws with ``bn="train"``, it follows the model's mode
    and its running statistics move: the handle no longer lists it as frozen, and the drift
    check does not call its moving statistics a violation."""
    model = Net()
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.1", epoch=1, lr=0.1, bn="train")])
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with spec.applied(model, opt) as handle:
        handle.step(epoch=0, step=0)
        assert list(handle.frozen_norms()) == ["trunk.1"]
        assert handle.step(epoch=1, step=1) == ["trunk.1"]
        assert handle.frozen_norms() == {}
        model.train()
        before = model.trunk[1].running_mean.clone()
        model(torch.randn(6, 4))
        assert not torch.equal(model.trunk[1].running_mean, before)
        assert handle.verify(checks=("drift",)).violations == ()


def test_a_refused_thaw_names_the_handle_that_refused() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", step=1, lr=0.1)])
    with pytest.warns(UserWarning, match="frozen parameters out"):
        handle = spec.apply(model, optimizer=opt)
    try:
        model.trunk[0].weight = nn.Parameter(model.trunk[0].weight.detach().clone())
        with pytest.raises(ReplacedParameterError) as refused:
            handle.thaw("trunk")
        assert str(refused.value).startswith(f"{handle.caller}: before thawing 'trunk', ")
        assert handle.thawed == ()
    finally:
        model.trunk[0].weight = handle.plan.frozen["trunk.0.weight"]
        handle.restore()
