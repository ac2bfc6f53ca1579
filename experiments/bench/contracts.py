"""What contracts and the ledger cost, each as a ratio measured in one run.

Rows (each a ratio against training measured in the same run; ``ok`` applies the limit):

* ``contracts/<model>``: the contract checks of one check step (the windows they open and
  close, the clauses before backward and after the step), amortised over checks every 50
  steps, over one training step of the same model: ``(with - without) / (50 * step) <= 0.02``.
  "Without" is the same spec and loop without its contracts, so the other checks (reach,
  drift, flags, optimizers) are not counted; they are given for reference (``all_checks``).
  The suite's models are :class:`experiments.model.IsolationNet` (probes, a frozen teacher
  trunk, a reversal) and :class:`experiments.simsiam.SimSiam` on MNIST-shaped batches of 128;
  the large model is a BYOL-like pair: an online MLP of residual blocks and its EMA target
  (``--contracts-layers`` blocks of width ``--contracts-width`` each, 302M parameters in all by
  default), with an ``ema`` and a ``trains`` contract.
* ``ledger/<model>``: :func:`isolate.ledger.ledger` with its loss, optimizer and handle, over
  one ``loss.backward()`` of the same model: ``<= 1``.

Every figure is a median over repeats, the phases with and without contracts interleaved so
that slow phases of a shared machine hit both; at one torch thread (``--contracts-threads``).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.bench._rows import Row
from isolate.ledger import ledger
from isolate.spec import IsolationSpec

__all__ = ["QUICK_CONTRACTS", "ContractsConfig", "contract_cost", "ledger_cost", "run"]


@dataclass(frozen=True)
class ContractsConfig:
    """Sizes of the ``contracts`` section (``--contracts-*`` options): the large model's
    blocks and width, repeats per measurement, and torch threads."""

    layers: int = 18
    width: int = 1024
    repeats: int = 3
    threads: int = 1


QUICK_CONTRACTS = ContractsConfig(layers=2, width=256, repeats=2)

EVERY = 50  # the callback's default verify_every_n_steps
Losses = tuple[torch.Tensor, dict[str, torch.Tensor]]


@dataclass
class Case:
    """A model, how to build its optimizer, a step's losses, what runs after the optimizer
    step (an EMA update), and its spec with and without contracts."""

    name: str
    model: nn.Module
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    losses: Callable[[nn.Module, torch.Tensor, torch.Tensor], Losses]
    spec: dict[str, Any]
    after_step: Callable[[nn.Module], None] = lambda m: None


def _batch(shape: tuple[int, ...], classes: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return torch.randn(shape, generator=gen), torch.randint(0, classes, (shape[0],), generator=gen)


class _Timed:
    """Times the loop's calls of one step and the whole step."""

    def __init__(self) -> None:
        self.loop = 0.0

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.loop += time.perf_counter() - start
        return out


def _phase(
    case: Case,
    contracts: bool,
    steps: int,
    every: int,
    gen: torch.Generator,
    shape: tuple[int, ...],
) -> list[tuple[float, float]]:
    """``steps`` training steps under the spec (with or without its contracts), checked every
    ``every`` steps; per step, (time in the loop's calls, time of the whole step)."""
    data = dict(case.spec)
    if not contracts:
        data.pop("contracts", None)
    model = case.model
    handle = IsolationSpec.from_dict(data).apply(model)
    opt = case.optimizer(model)  # of what trains, as configure_optimizers builds it
    handle.attach(opt)
    loop = handle.check_every(every)
    out = []
    try:
        for step in range(steps):
            timed = _Timed()
            start = time.perf_counter()
            timed(loop.begin_step, epoch=0, step=step)
            model.train()
            x, y = _batch(shape, 10, gen)
            total, named = case.losses(model, x, y)
            timed(loop.before_backward, total, named)
            total.backward()
            opt.step()
            case.after_step(model)
            opt.zero_grad(set_to_none=True)
            timed(loop.end_step)
            out.append((timed.loop, time.perf_counter() - start))
    finally:
        handle.restore()
    return out


def contract_cost(case: Case, shape: tuple[int, ...], repeats: int) -> Row:
    """Per check: the loop's time on a check step and the step after (which closes the
    windows), less twice its time on a step without checks; with and without contracts."""
    gen = torch.Generator().manual_seed(0)
    every = 4  # steps 0 (check), 1 (windows close), 2 and 3 (no checks)
    cycle: dict[bool, list[float]] = {True: [], False: []}
    steps: list[float] = []
    _phase(case, True, every, every, gen, shape)  # warm-up
    for _ in range(repeats):
        for contracts in (True, False):
            timed = _phase(case, contracts, every, every, gen, shape)
            quiet = statistics.mean(t for t, _ in timed[2:])
            cycle[contracts].append(timed[0][0] + timed[1][0] - 2 * quiet)
            steps += [s for _, s in timed[2:]]
    step = statistics.median(steps)
    with_c, without = statistics.median(cycle[True]), statistics.median(cycle[False])
    extra = {
        "contracts": [c["kind"] for c in case.spec.get("contracts", [])],
        "parameters": sum(p.numel() for p in case.model.parameters()),
        "check_with_contracts_s": with_c,
        "check_without_contracts_s": without,
        "contracts_per_check_s": with_c - without,
        "all_checks_ratio": with_c / (EVERY * step),
    }
    return Row(f"contracts/{case.name}", f"contract checks per step (checks every {EVERY})",
               "one training step", max(with_c - without, 0.0) / EVERY, step, "<= 0.02", None,
               extra, limit=0.02)  # fmt: skip


def ledger_cost(case: Case, shape: tuple[int, ...], repeats: int) -> Row:
    """The ledger of the model with its loss, optimizer and handle, over one backward."""
    gen = torch.Generator().manual_seed(1)
    model = case.model
    handle = IsolationSpec.from_dict(case.spec).apply(model)
    opt = case.optimizer(model)
    handle.attach(opt)
    books, backwards = [], []
    try:
        for i in range(repeats + 1):
            x, y = _batch(shape, 10, gen)
            total, named = case.losses(model, x, y)
            start = time.perf_counter()
            book = ledger(model, {**named, "total": total}, opt, spec=handle)
            took = time.perf_counter() - start
            start = time.perf_counter()
            total.backward()
            back = time.perf_counter() - start
            opt.zero_grad(set_to_none=True)
            if i:  # the first is a warm-up
                books.append(took)
                backwards.append(back)
    finally:
        handle.restore()
    extra = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensors": len(book.rows),
        "summary": book.summary_line(),
    }
    return Row(f"ledger/{case.name}", "ledger(model, losses, optimizer, spec=handle)",
               "loss.backward()", statistics.median(books), statistics.median(backwards),
               "<= 1", None, extra, limit=1.0)  # fmt: skip


# -- the cases --------------------------------------------------------------------------------


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9
    )


def _net_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Losses:
    model.isolation_losses = {}
    total = model._step((x, y), "train")  # the suite's training step, logging aside
    return total, dict(model.losses)


def _net(*branches: Any) -> nn.Module:
    """The suite's IsolationNet with ``branches``, seeded, its logging off."""
    from experiments.model import IsolationNet

    torch.manual_seed(0)
    model = IsolationNet(branches=branches)
    model.log = lambda *a, **k: None  # type: ignore[method-assign]
    return model


def _simsiam() -> nn.Module:
    from experiments.simsiam import SimSiam

    torch.manual_seed(0)
    model = SimSiam()
    model.log = lambda *a, **k: None  # type: ignore[method-assign]
    return model


def _simsiam_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Losses:
    loss = model.training_step((x, y), 0)
    return loss, dict(model.isolation_losses)


def suite_cases() -> list[Case]:
    """The suite's models, each with the contracts its variants declare."""
    from experiments.model import Branch

    probes = _net(
        Branch("probe", "detached", dropout=0.1),
        Branch("ink_probe", "detached", target="ink", seed=2),
    )
    reversal = _net(
        Branch("adversary", "reversal", target="ink", alpha=-0.1),
        Branch("ink_probe", "detached", target="ink", seed=2),
    )
    probe = {"kind": "probe", "select": "branches.probe", "loss": "probe"}
    ink = {"kind": "probe", "select": "branches.ink_probe", "loss": "ink_probe"}
    return [
        Case("IsolationNet probes", probes, _sgd, _net_losses, {"contracts": [probe, ink]}),
        Case(
            "IsolationNet frozen teacher",
            _net(),
            _sgd,
            _net_losses,
            {
                "freeze": ["trunk"],
                "mode": "eval",
                "contracts": [{"kind": "teacher", "select": "trunk"}],
            },
        ),
        Case(
            "IsolationNet reversal",
            reversal,
            _sgd,
            _net_losses,
            {
                "contracts": [
                    {
                        "kind": "reversal",
                        "loss": "adversary",
                        "features": "trunk",
                        "classifier": "branches.adversary.1",
                        "scale": 0.1,
                    },
                    ink,
                ]
            },
        ),
        Case(
            "SimSiam",
            _simsiam(),
            _sgd,
            _simsiam_losses,
            {
                "contracts": [
                    {
                        "kind": "stop_gradient",
                        "loss": "simsiam",
                        "blocked": ["encoder", "projector"],
                        "through": "predictor",
                    }
                ]
            },
        ),
    ]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def large_case(layers: int, width: int) -> Case:
    """BYOL-like: an online network of residual MLP blocks, a predictor, and the online
    network's EMA target, built with ``requires_grad=False``."""
    torch.manual_seed(0)
    online = nn.Sequential(*(Block(width) for _ in range(layers)))
    target = copy.deepcopy(online).requires_grad_(False)  # as BYOL builds it
    model = nn.ModuleDict(
        {"online": online, "predictor": nn.Linear(width, width), "target": target}
    )
    decay = 0.996

    def losses(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Losses:
        p = m["predictor"](m["online"](x))
        with torch.no_grad():
            z = m["target"](x + 0.1 * torch.randn_like(x))
        loss = 2 - 2 * F.cosine_similarity(p, z).mean()
        return loss, {"byol": loss}

    @torch.no_grad()
    def ema(m: nn.Module) -> None:
        torch._foreach_lerp_(
            list(m["target"].parameters()), list(m["online"].parameters()), 1 - decay
        )

    spec = {
        "contracts": [
            {"kind": "ema", "target": "target", "online": "online", "decay": decay},
            {"kind": "trains", "select": ["online", "predictor"], "within": 1},
        ],
    }
    return Case("BYOL 2x" + f"{layers}x{width}", model, _sgd, losses, spec, ema)


def run(config: ContractsConfig) -> list[Row]:
    """The suite's models, then the large one (contracts and the ledger), at
    ``config.threads`` torch threads (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        rows = [contract_cost(case, (128, 1, 28, 28), config.repeats) for case in suite_cases()]
        large = large_case(config.layers, config.width)
        shape = (64, config.width)
        rows.append(contract_cost(large, shape, config.repeats))
        rows.append(ledger_cost(large, shape, config.repeats))
    finally:
        torch.set_num_threads(threads)
    return rows
