"""Two CPU processes (gloo) training a compiled model that is frozen or thawed between steps,
for ``tests/distributed/test_compile_thaw.py``.

Usage: ``python tests/distributed/_compile_thaw_script.py MODE OUT_DIR``; each rank writes
``OUT_DIR/<mode>-rank<r>.json``: for each wrapping and flip, the steps at which its weights
differ bitwise from one process training the same model eagerly on both ranks' batches.

Modes: ``ddp`` (``DDP(torch.compile(model))`` and ``torch.compile(DDP(model))``, rebuilt
after each flip, as DDP needs) and ``fsdp`` (``torch.compile`` of a ``fully_shard`` model).
A freeze is ``isolate.freeze``; a thaw is an ``IsolationSpec`` thaw run by its loop.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import isolate
from isolate.spec import IsolationSpec, Thaw
from tests.distributed._spawn import Mode, batch, full, spawn

STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).mean()


Build = Callable[[Net], Callable[[torch.Tensor], torch.Tensor]]


def train(event: str, build: Build | None, *, shard: bool = False) -> dict[str, Any]:
    """``STEPS`` SGD steps; ``b`` frozen or thawed at step 1. ``build`` wraps the model (and
    is called again after the flip); ``None``: one eager process on both ranks' batches."""
    model = Net()
    if shard:
        fully_shard(model.a)
        fully_shard(model.b)
        fully_shard(model)
    handle = freeze = loop = None
    if event == "thaw":
        handle = IsolationSpec(freeze=["b"], thaw=[Thaw("b", step=1, lr=0.1)]).apply(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    if handle is not None:
        handle.attach(opt)
        loop = handle.check_every(1)
    forward = model if build is None else build(model)
    rank = dist.get_rank()
    weights, b_grads = [], []
    for step in range(STEPS):
        flipped = False
        if loop is not None:
            flipped = bool(loop.begin_step(epoch=0, step=step))
        elif step == 1:
            freeze = isolate.freeze(model, "b")
            flipped = True
        if flipped and build is not None and not shard:
            forward = build(model)  # DDP syncs only what required grad when it was built
        if build is None:
            loss = sum(model(batch(step, rank=r)) for r in range(dist.get_world_size())) / 2
        else:
            loss = forward(batch(step, rank=rank))
        if loop is not None:
            loop.before_backward(loss)
        loss.backward()
        b_grads.append(model.b.weight.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if loop is not None:
            loop.end_step()
        weights.append({n: full(p.detach()).clone() for n, p in model.named_parameters()})
    for h in (handle, freeze):
        if h is not None:
            h.restore()
    return {"weights": weights, "b_grads": b_grads}


def differs(got: dict[str, Any], want: dict[str, Any]) -> list[list[Any]]:
    """``[step, name]`` of every weight that differs bitwise from the reference."""
    return [
        [step, name]
        for step, (g, w) in enumerate(zip(got["weights"], want["weights"], strict=True))
        for name in w
        if not torch.equal(g[name], w[name])
    ]


def ddp() -> dict[str, Any]:
    builds: dict[str, Build] = {
        "ddp_of_compiled": lambda m: DistributedDataParallel(torch.compile(m, backend="aot_eager")),
        "compiled_ddp": lambda m: torch.compile(DistributedDataParallel(m), backend="aot_eager"),
    }
    out: dict[str, Any] = {}
    for event in ("freeze", "thaw"):
        want = train(event, None)
        for name, build in builds.items():
            got = train(event, build)
            out[f"{name}/{event}"] = {"differs": differs(got, want), "b_grads": got["b_grads"]}
    return out


def fsdp() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for event in ("freeze", "thaw"):
        want = train(event, None)
        got = train(event, lambda m: torch.compile(m, backend="aot_eager"), shard=True)
        out[f"fsdp/{event}"] = {"differs": differs(got, want), "b_grads": got["b_grads"]}
    return out


MODES: dict[str, Mode] = {"ddp": ddp, "fsdp": fsdp}


def main() -> None:
    spawn(MODES, sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    main()
