"""Models, a spec and helpers shared by the tests of the spec package."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import lr_scheduler as L

from isolate import IsolationSpec, Thaw


class Net(nn.Module):
    """A trunk (Linear, BatchNorm, ReLU, Linear), a head, and an auxiliary branch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)
        self.aux = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        return self.head(features), self.aux(features)


SPEC = IsolationSpec(freeze=["trunk"], detach=["aux"], thaw=[Thaw("trunk.3", epoch=1, lr=0.5)])


def state_of(model: nn.Module) -> dict[str, Any]:
    """Everything an apply or a restore may touch, for exact comparisons."""
    return {
        "flags": [(n, p.requires_grad) for n, p in model.named_parameters()],
        "ids": [id(p) for p in model.parameters()],
        "classes": [type(m) for m in model.modules()],
        "modes": [m.training for m in model.modules()],
        "hooks": [len(m._forward_pre_hooks) for m in model.modules()],
        "values": {k: v.clone() for k, v in model.state_dict().items()},
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in ("flags", "ids", "classes", "modes", "hooks"):
        assert before[key] == after[key], key
    for name, value in before["values"].items():
        assert torch.equal(value, after["values"][name]), name


def groups_of(opt: torch.optim.Optimizer) -> list[list[int]]:
    """The optimizer's param groups, as parameter identities."""
    return [[id(p) for p in g["params"]] for g in opt.param_groups]


def two_layers() -> nn.Sequential:
    """Layer 0 (frozen and thawed by the schedules) and layer 1 (trains from the start)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))


def train(
    model: nn.Module,
    spec: IsolationSpec,
    opt: torch.optim.Optimizer,
    scheduler: Any,
    steps: int,
    *,
    per_epoch: int = 1,
) -> tuple[list[list[float]], list[list[float]]]:
    """Run ``steps`` optimizer steps; return each group's lr as the step used it (read by a
    post-hook registered before the spec's) and as the scheduler left it after the step."""
    used: list[list[float]] = []
    opt.register_step_post_hook(lambda o, *_: used.append([g["lr"] for g in o.param_groups]))
    handle = spec.apply(model)
    handle.attach(opt, [scheduler] if scheduler is not None else [])
    after: list[list[float]] = []
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(steps):
            handle.step(epoch=step // per_epoch, step=step)
            model(torch.randn(4, 2, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if isinstance(scheduler, L.ReduceLROnPlateau):
                scheduler.step(float(step))  # worse every time: reduces every step
            elif scheduler is not None:
                scheduler.step()
            after.append([gr["lr"] for gr in opt.param_groups])
    finally:
        handle.restore()
    return used, after
