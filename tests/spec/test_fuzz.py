"""The spec engine against the same training written by hand, on random models, random specs
and random loops: attach once or twice, manual thaws, skipped and repeated ``step`` calls,
checkpoint and resume, and ``restore``, at random points. After every operation both runs
must agree bit for bit: flags, param groups and their settings, optimizer state, weights and
buffers."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from isolate.errors import IsolationWarning, SpecError
from isolate.spec import IsolationSpec, Thaw


@dataclass
class Case:
    norms: list[bool]  # per block: whether it holds a BatchNorm1d
    frozen: list[int]
    thaws: list[tuple[int, str, int, float | None]]  # block, "epoch" | "step", when, lr
    bn: str
    optimizer: str
    ops: list[tuple[Any, ...]]


OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd-decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.05, nesterov=False),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


@st.composite
def cases(draw: st.DrawFn) -> Case:
    blocks = draw(st.integers(2, 5))
    norms = draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks))
    frozen = sorted(draw(st.sets(st.integers(0, blocks - 1), min_size=1)))
    thawed = draw(st.permutations(frozen))[: len(frozen) - draw(st.integers(0, 1))]
    thaws = [
        (
            b,
            draw(st.sampled_from(["epoch", "step"])),
            draw(st.integers(0, 3)),
            draw(st.sampled_from([None, 0.05, 0.3])),
        )
        for b in thawed
    ]
    kinds = ["train"] * 8 + ["epoch"] * 2 + ["repeat", "manual", "attach", "resume", "restore"]
    op = st.sampled_from(kinds).flatmap(
        lambda kind: {
            "train": st.tuples(st.just(kind), st.sampled_from([True, True, True, False])),
            "manual": st.tuples(st.just(kind), st.integers(0, 3), st.sampled_from([None, 0.07])),
            "resume": st.tuples(st.just(kind), st.booleans()),  # attach before or after load
        }.get(kind, st.tuples(st.just(kind)))
    )
    ops = draw(st.lists(op, min_size=8, max_size=24))
    return Case(
        norms,
        frozen,
        thaws,
        draw(st.sampled_from(["eval", "train"])),
        draw(st.sampled_from(sorted(OPTIMIZERS))),
        ops,
    )


def build(case: Case) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: OrderedDict[str, nn.Module] = OrderedDict()
    for i, norm in enumerate(case.norms):
        layers = [nn.Linear(3, 3), *([nn.BatchNorm1d(3)] if norm else []), nn.Tanh()]
        blocks[f"b{i}"] = nn.Sequential(*layers)
    blocks["head"] = nn.Linear(3, 1)
    return nn.Sequential(blocks)


def spec_of(case: Case) -> IsolationSpec:
    return IsolationSpec(
        freeze=[f"b{i}" for i in case.frozen],
        bn=case.bn,  # type: ignore[arg-type]
        thaw=[
            Thaw(f"b{b}", **{kind: at}, lr=lr, name=f"t{b}")  # type: ignore[arg-type]
            for b, kind, at, lr in case.thaws
        ],
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 3, generator=generator), torch.randn(6, 1, generator=generator)


class ByHand:
    """The training a user writes without isolate: requires_grad_, .eval() and param groups."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.model = build(case)
        self.frozen = {f"b{i}" for i in case.frozen}
        for name, p in self.model.named_parameters():
            p.requires_grad_(name.split(".")[0] not in self.frozen)
        self.opt = OPTIMIZERS[case.optimizer](
            [p for p in self.model.parameters() if p.requires_grad]
        )
        self.pending = [(f"t{b}", f"b{b}", kind, at, lr) for b, kind, at, lr in case.thaws]
        self.held = set(self.frozen) if case.bn == "eval" else set()
        self.active = True

    def step(self, epoch: int, step: int) -> None:
        by_epoch = [t for t in self.pending if t[2] == "epoch" and epoch >= t[3]]
        by_step = [t for t in self.pending if t[2] == "step" and step >= t[3]]
        for t in [*by_epoch, *by_step]:
            self.thaw(t[0], None)

    def thaw(self, name: str, lr: float | None) -> None:
        entry = next(t for t in self.pending if t[0] == name)
        self.pending.remove(entry)
        block = entry[1]
        params = [p for n, p in self.model.named_parameters() if n.split(".")[0] == block]
        for p in params:
            p.requires_grad_(True)
        self.held.discard(block)  # Thaw(bn="train"): the block's BatchNorm trains again
        settings = {k: v for k, v in self.opt.param_groups[0].items() if k != "params"}
        chosen = lr if lr is not None else entry[4]
        if chosen is not None:
            settings["lr"] = float(chosen)
        self.opt.add_param_group({"params": params, **settings})

    def restore(self) -> None:
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.held.clear()
        first = self.opt.param_groups[0]
        first["params"] = list(self.model.parameters())
        del self.opt.param_groups[1:]
        self.active = False

    def forward_modes(self) -> None:
        self.model.train()
        for block in self.held:
            self.model.get_submodule(block).eval()


class WithSpec:
    """The same training under the spec's handle."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.spec = spec_of(case)
        self.model = build(case)
        self.opt = OPTIMIZERS[case.optimizer](self.model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IsolationWarning)  # frozen ones taken out
            self.handle = self.spec.apply(self.model, self.opt)
        self.active = True
        self.driven = False  # handle.step() ran since apply

    def resume(self, attach_first: bool) -> None:
        saved = {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.opt.state_dict(),
            "isolation": self.handle.state_dict(),
        }
        self.handle.restore(optimizers=False)  # the old process ends
        model = build(self.case)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # not the saved values: the load must bring them
        model.load_state_dict(saved["model"])
        opt = OPTIMIZERS[self.case.optimizer](model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IsolationWarning)
            handle = self.spec.apply(model)
            if attach_first:  # a plain loop: attach, then load
                handle.attach(opt)
                handle.load_state_dict(saved["isolation"])
            else:  # as under sharded strategies: thaw what was thawed, then attach
                handle.load_state_dict(saved["isolation"])
                handle.attach(opt)
        opt.load_state_dict(saved["optimizer"])
        self.model, self.opt, self.handle, self.driven = model, opt, handle, False


def train(model: nn.Module, opt: torch.optim.Optimizer, step: int, *, update: bool = True) -> None:
    x, y = batch(step)
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if update:
        opt.step()


def layout(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        ([names[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
        for g in opt.param_groups
    ]


def opt_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items() if s}


def assert_same(mine: WithSpec, theirs: ByHand, where: str) -> None:
    a, b = mine.model, theirs.model
    assert {n: p.requires_grad for n, p in a.named_parameters()} == {
        n: p.requires_grad for n, p in b.named_parameters()
    }, f"{where}: flags"
    assert layout(a, mine.opt) == layout(b, theirs.opt), f"{where}: param groups"
    for (name, x), (other, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert name == other and torch.equal(x, y), f"{where}: {name}"
    sa, sb = opt_state(a, mine.opt), opt_state(b, theirs.opt)
    assert sorted(sa) == sorted(sb), f"{where}: optimizer state of {sorted(sa)} vs {sorted(sb)}"
    for name in sa:
        assert sa[name].keys() == sb[name].keys(), f"{where}: state keys of {name}"
        for key, value in sa[name].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb[name][key])), (
                f"{where}: optimizer state {key} of {name}"
            )


def run(case: Case) -> None:
    mine, theirs = WithSpec(case), ByHand(case)
    epoch = step = 0
    try:
        assert_same(mine, theirs, "after apply")
        for i, op in enumerate(case.ops):
            where = f"op {i} {op} (epoch {epoch}, step {step})"
            kind = op[0]
            if kind == "train":
                if mine.active and op[1]:
                    mine.handle.step(epoch=epoch, step=step)
                    theirs.step(epoch, step)
                    mine.driven = True
                refused = mine.active and not mine.driven and bool(theirs.pending)
                mine.model.train()
                theirs.forward_modes()
                if refused:  # the guard: thaws pending, and the schedule never ran
                    with pytest.raises(SpecError, match=r"handle\.step\(\) was never called"):
                        train(mine.model, mine.opt, step)
                    train(theirs.model, theirs.opt, step, update=False)  # the forward ran
                    assert_same(mine, theirs, where)
                    continue
                train(mine.model, mine.opt, step)
                train(theirs.model, theirs.opt, step)
                step += 1
            elif kind == "epoch":
                epoch += 1
            elif not mine.active:
                continue
            elif kind == "repeat" and mine.driven:
                mine.handle.step(epoch=epoch, step=step)
                theirs.step(epoch, step)
            elif kind == "manual":
                if not theirs.pending:
                    continue
                name = theirs.pending[op[1] % len(theirs.pending)][0]
                mine.handle.thaw(name, lr=op[2])
                theirs.thaw(name, op[2])
            elif kind == "attach":
                mine.handle.attach(mine.opt)
            elif kind == "resume":
                mine.resume(op[1])
            elif kind == "restore":
                mine.handle.restore()
                mine.active = False
                theirs.restore()
            assert_same(mine, theirs, where)
    finally:
        if mine.active:
            mine.handle.restore()


@pytest.mark.usefixtures("one_thread")
@example(  # resumed with two groups thawed, attached after the load (sharded strategies)
    Case(
        [False, True, False],
        [0, 1, 2],
        [(1, "epoch", 0, 0.05), (0, "step", 1, None)],
        "eval",
        "sgd-momentum",
        [("train", True), ("train", True), ("resume", False), ("train", True)],
    )
)
@example(  # thawed by hand and by schedule, restored mid-run, trained on
    Case(
        [True, False],
        [0, 1],
        [(0, "step", 2, None), (1, "epoch", 1, 0.3)],
        "train",
        "adamw",
        [
            ("train", True),
            ("manual", 1, 0.07),
            ("train", True),
            ("train", False),
            ("epoch",),
            ("repeat",),
            ("train", True),
            ("restore",),
            ("train", False),
        ],
    )
)
@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(cases())
def test_the_spec_engine_trains_as_the_same_loop_written_by_hand(case: Case) -> None:
    run(case)
