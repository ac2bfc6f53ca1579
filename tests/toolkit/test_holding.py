"""Holding a frozen part in eval mode as a whole: dropout, drop path, BatchNorm and any module
whose forward reads ``.training``, through ``model.train()`` and Lightning's direct
assignments, undone exactly."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import isolate
from isolate._holding import READS_TRAINING, reads_training
from isolate.errors import SelectorError, SpecError
from isolate.freezing import held_in_eval, unfreeze
from isolate.spec import IsolationSpec


class DropPath(nn.Module):
    """Stochastic depth as timm writes it: the forward reads ``self.training``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = torch.rand(x.shape[0], 1) > self.p
        return x * keep / (1 - self.p)


class Helper(nn.Module):
    """Reads the flag in a method its forward calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._noise(x)

    def _noise(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x) if self.training else x


class Declared(nn.Module):
    """Reads the flag of something else; says so."""

    isolate_reads_training = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ReadsTrainer(nn.Module):
    """Reads ``self.trainer.training``, which is not its own mode."""

    def __init__(self) -> None:
        super().__init__()
        self.trainer = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if getattr(self.trainer, "training", False) else x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.path = DropPath(0.5)
        self.noise = Helper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.noise(self.path(self.drop(self.norm(self.fc(x)))))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "trunk": nn.Sequential(Block(), Block()),
            "head": nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 2)),
        }
    )


def run(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net["head"](net["trunk"](x))


def test_which_modules_read_their_mode() -> None:
    found = {type(m).__name__: reads_training(m) for m in Block().modules()}
    assert found == {
        "Block": False,
        "Linear": False,
        "BatchNorm1d": True,
        "Dropout": True,
        "DropPath": True,
        "Helper": True,
    }
    assert reads_training(Declared()) and not reads_training(ReadsTrainer())
    assert all(
        reads_training(m)
        for m in (
            nn.InstanceNorm1d(2, track_running_stats=True),
            nn.LSTM(2, 2, dropout=0.1, num_layers=2),
            nn.MultiheadAttention(4, 2),
        )
    )


class InClosure(nn.Module):
    """Reads the flag inside a function its forward defines (a closure over ``self``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def scale() -> float:
            return 2.0 if self.training else 1.0

        return x * scale()


class ReadsChildsFlag(nn.Module):
    """Reads ``self.sub.training``: a child's mode, not its own."""

    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.sub.training else x


class CallsHelpersWithoutSelf(nn.Module):
    """Calls a static method without arguments and a class method: neither reads the
    module's own mode (a class method's ``cls.training`` is a class attribute)."""

    training_scale = 2.0

    @staticmethod
    def constant() -> float:
        return 1.0

    @classmethod
    def class_scale(cls) -> float:
        return cls.training_scale if hasattr(cls, "training") and cls.training else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.constant() * self.class_scale()


def test_the_code_read_is_the_modules_own_forward_and_closures() -> None:
    assert reads_training(InClosure())
    assert not reads_training(ReadsChildsFlag())
    assert not reads_training(CallsHelpersWithoutSelf())
    x = torch.ones(1)
    assert torch.equal(CallsHelpersWithoutSelf()(x), x)


class ScaledDropout(nn.Dropout):
    """Reads its mode only through ``super().forward``, in nn.Dropout's code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class SkipsDropout(nn.Dropout):
    """Overrides the base's forward without calling it: its mode does not matter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class NoisierHelper(Helper):
    """Calls the base class's helper, not its forward, through ``super()``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super()._noise(x) * 2

    def _noise(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Attention(nn.MultiheadAttention):
    def forward(self, *args: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, ...]:
        return tuple(super().forward(*args, **kwargs))  # type: ignore[arg-type]


def test_a_subclass_that_calls_the_base_forward_through_super_reads_the_base_flag() -> None:
    assert reads_training(ScaledDropout(0.5))
    assert reads_training(Attention(4, 1, dropout=0.5))
    assert reads_training(NoisierHelper())
    assert not reads_training(SkipsDropout(0.5))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), ScaledDropout(0.5))
    with isolate.frozen(net, mode="eval") as handle:
        assert handle.held == ("1",)
        x = torch.ones(8, 4)
        net.train()
        assert torch.equal(net(x), net(x))
        assert torch.equal(net(x), net[0](x) * 2)  # the dropout in eval mode: identity
    assert net[1].training and held_in_eval(net) == ()


class ThroughProperty(nn.Module):
    """Reads its mode in a property that its forward reads."""

    p = 0.5

    @property
    def stochastic(self) -> bool:
        return self.training and self.p > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, self.p, self.stochastic)


class ThroughPartial(nn.Module):
    def _drop(self, x: torch.Tensor, p: float) -> torch.Tensor:
        return torch.nn.functional.dropout(x, p, self.training)

    drop_half = functools.partialmethod(_drop, p=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop_half(x)  # type: ignore[no-any-return]


def test_a_mode_read_in_a_property_or_a_partial_method_counts() -> None:
    assert reads_training(ThroughProperty())
    assert reads_training(ThroughPartial())
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), ThroughProperty())
    with isolate.frozen(net, mode="eval") as handle:
        assert handle.held == ("1",)
        x = torch.ones(8, 4)
        assert torch.equal(net.train()(x), net[0](x))


def test_a_declaration_overrides_what_the_code_says() -> None:
    class Quiet(DropPath):
        isolate_reads_training = False

    assert READS_TRAINING == "isolate_reads_training"
    assert not reads_training(Quiet(0.5))


def test_mode_eval_holds_the_whole_frozen_part_through_train_and_assignment() -> None:
    net = model()
    x = torch.randn(6, 4)
    before = {n: m.training for n, m in net.named_modules()}
    handle = isolate.freeze(net, "trunk", mode="eval")
    assert handle.held == (
        "trunk.0.norm",
        "trunk.0.drop",
        "trunk.0.path",
        "trunk.0.noise",
        "trunk.1.norm",
        "trunk.1.drop",
        "trunk.1.path",
        "trunk.1.noise",
    )
    assert handle.norms == ("trunk.0.norm", "trunk.1.norm")
    assert repr(handle) == (
        "FreezeHandle(freeze on ModuleDict: 8 parameters, 2 BatchNorm layers, "
        "6 other mode-dependent layers, active)"
    )
    net.train()
    for m in net.modules():  # as Lightning restores modes after validation
        m.training = True
    stats = net["trunk"][0].norm.running_mean.clone()
    features = [net["trunk"](x) for _ in range(3)]
    assert all(torch.equal(features[0], f) for f in features[1:])  # deterministic features
    assert torch.equal(net["trunk"][0].norm.running_mean, stats)  # statistics still
    assert not torch.equal(run(net, x), run(net, x))  # the head's dropout still trains
    assert held_in_eval(net) == handle.held
    handle.restore()
    assert {n: m.training for n, m in net.named_modules()} == before
    assert held_in_eval(net) == ()
    assert all(not m._forward_pre_hooks for m in net.modules())


def test_the_default_still_holds_only_batchnorm() -> None:
    net = model()
    with isolate.frozen(net, "trunk") as handle:
        assert handle.held == handle.norms == ("trunk.0.norm", "trunk.1.norm")
        net.train()
        x = torch.randn(6, 4)
        assert not torch.equal(net["trunk"](x), net["trunk"](x))  # dropout left training


def test_unfreeze_mode_train_releases_an_outer_hold_and_nests() -> None:
    net = model()
    outer = isolate.freeze(net, mode="eval")
    inner = unfreeze(net, "trunk.1", mode="train")
    net.train()
    assert held_in_eval(net) == (
        "trunk.0.norm",
        "trunk.0.drop",
        "trunk.0.path",
        "trunk.0.noise",
        "head.0",
    )
    x = torch.randn(6, 4)
    assert not torch.equal(net["trunk"][1](x), net["trunk"][1](x))
    inner.restore()
    assert "trunk.1.drop" in held_in_eval(net)
    outer.restore()
    assert held_in_eval(net) == ()


def test_a_copy_of_a_held_model_is_held_on_its_own() -> None:
    net = model()
    with isolate.frozen(net, "trunk", mode="eval"):
        twin = copy.deepcopy(net)
    twin.train()
    x = torch.randn(6, 4)
    assert torch.equal(twin["trunk"](x), twin["trunk"](x))
    assert held_in_eval(net) == ()


def test_what_a_selection_covers() -> None:
    net = model()
    with isolate.frozen(net, "trunk.*", "!trunk.1.fc.*", mode="eval") as handle:
        assert "trunk.0.drop" in handle.held and "trunk.1.drop" in handle.held
        assert "trunk.1.norm" in handle.held and "head.0" not in handle.held
    with isolate.frozen(net, "*.weight", mode="eval") as handle:
        assert handle.held == ()  # weights only: no layer is frozen whole


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "eval", "bn": "eval"}, r"^freeze\(\): give mode= .* or bn= .*, not both"),
        ({"mode": "inference"}, r"^freeze\(\): mode='inference' is not a mode"),
    ],
)
def test_bad_modes_are_refused_before_anything_changes(kwargs: dict, message: str) -> None:
    net = model()
    with pytest.raises(SelectorError, match=message):
        isolate.freeze(net, "trunk", **kwargs)
    assert all(p.requires_grad for p in net.parameters()) and held_in_eval(net) == ()


def test_a_spec_holds_in_eval_mode_and_thaws_back_to_train() -> None:
    net = model()
    spec = IsolationSpec(
        freeze=["trunk"],
        mode="eval",
        thaw=[{"select": "trunk.1", "step": 1, "bn": "train", "lr": 0.1}],
    )
    handle = spec.apply(net, torch.optim.SGD(net["head"].parameters(), lr=0.1))
    assert len(held_in_eval(net)) == 8
    assert handle.plan.record()["mode"] == "eval"
    handle.step(epoch=0, step=1)
    assert held_in_eval(net) == ("trunk.0.norm", "trunk.0.drop", "trunk.0.path", "trunk.0.noise")
    handle.restore()
    assert held_in_eval(net) == ()
    plain = IsolationSpec(freeze=["trunk"]).apply(net)
    assert "mode" not in plain.plan.record()  # checkpoints written before mode= still load
    plain.restore()
    with pytest.raises(SpecError, match=r"mode='eval' .* but bn='train' lets BatchNorm train"):
        IsolationSpec(freeze=["trunk"], mode="eval", bn="train")
