"""The engine's verification against a training step under ``fully_shard`` (FSDP2) on 2 CPU
processes (gloo), the first half of the layers frozen; then one element of a frozen shard
moves on rank 1, and every rank must raise.

Its size is set by ``--sharded-*`` (:class:`ShardedConfig`; the default is 8 encoder layers of
width 512, 25M parameters).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

import isolate
from experiments.bench._launch import launch
from experiments.bench._rows import Row
from experiments.bench._timing import geometric_mean_ratio
from experiments.bench.networks import transformer
from isolate.spec.checks import Verification

__all__ = ["QUICK_SHARDED", "SHARDED_WORLD", "ShardedConfig", "run", "run_rank"]


@dataclass
class ShardedConfig:
    """Sizes of the ``sharded`` section (``--sharded-*`` options): a transformer encoder
    sharded by ``fully_shard`` over 2 CPU processes (gloo), the first half of its layers
    frozen; the default is 8 layers of width 512, 25M parameters."""

    layers: int = 8
    width: int = 512
    heads: int = 8
    batch: int = 4  # per process
    tokens: int = 64
    check_every: int = 50  # the callback's verify_every_n_steps, to amortise a check
    warmup: int = 2
    repeat: int = 20


QUICK_SHARDED = ShardedConfig(layers=2, width=64, heads=4, batch=2, tokens=8, warmup=1, repeat=2)
SHARDED_WORLD = 2
# What the callback checks at the end of a check step (no graph needed).
_END_OF_STEP_CHECKS = ("params", "drift", "flags", "optimizers", "ranks")


class _Training:
    """One rank's sharded model, half frozen by a spec, with its optimizer attached."""

    def __init__(self, cfg: ShardedConfig) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        self.rank = dist.get_rank()
        self.model = transformer(cfg.layers, cfg.width, cfg.heads)  # seeded: same on every rank
        self.parameters = sum(p.numel() for p in self.model.parameters())
        for layer in self.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        frozen = tuple(f"layers.{i}" for i in range(cfg.layers // 2))  # the first half
        self.handle = isolate.IsolationSpec(freeze=frozen).apply(self.model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(trainable, lr=1e-4)
        self.handle.attach(self.optimizer)  # searched by the "optimizers" check
        seed = torch.Generator().manual_seed(self.rank)
        self.x = torch.randn(cfg.batch, cfg.tokens, cfg.width, generator=seed)
        self.verifications: list[Verification] = []

    @staticmethod
    def timed(fn: Callable[[], object]) -> float:
        import torch.distributed as dist

        gc.collect()
        dist.barrier()  # both ranks start together: neither time holds the other's lag
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def _finish(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self._finish(self.model(self.x).square().mean())

    def check_step(self) -> float:
        loss = self.model(self.x).square().mean()
        verify = self.handle.verify
        check = self.timed(lambda: self.verifications.append(verify({"loss": loss}, total=loss)))
        self._finish(loss)
        return check

    def rounds(self, cfg: ShardedConfig) -> tuple[list[float], list[float]]:
        """Plain steps and check steps, timed after warm-up: (steps, checks)."""
        steps: list[float] = []
        checks: list[float] = []
        for i in range(cfg.warmup + cfg.repeat):
            # Alternate which goes first so neither always runs on a warmer cache.
            if i % 2 == 0:
                s = self.timed(self.step)
                c = self.check_step()
            else:
                c = self.check_step()
                s = self.timed(self.step)
            if i >= cfg.warmup:
                steps.append(s)
                checks.append(c)
        return steps, checks

    def gathers_per_verify(self) -> int:
        """The ranks check is a collective of its own (one all_gather_object of fingerprints
        and of what each rank found): count it in one more check step, outside the timings."""
        import torch.distributed as dist

        gathers: list[int] = []
        plain = dist.all_gather_object

        def counted(*args: Any, **kwargs: Any) -> Any:
            gathers.append(1)
            return plain(*args, **kwargs)

        dist.all_gather_object = counted
        try:
            self.check_step()
        finally:
            dist.all_gather_object = plain
        return len(gathers)

    def nudge_and_verify(self, nudged: str) -> str:
        """Move one element of ``nudged``'s shard on rank 1 only, verify on every rank;
        returns what verify raised here ("" for nothing)."""
        if self.rank == 1:
            local = self.model.get_parameter(nudged).to_local()  # type: ignore[attr-defined]
            with torch.no_grad():
                local[(0,) * local.dim()] += 1e-3
        try:
            self.handle.verify(checks=_END_OF_STEP_CHECKS)  # every rank: "ranks" is a collective
        except isolate.IsolationError as error:
            return f"{type(error).__name__}: {error}"
        return ""


def run_rank(cfg: ShardedConfig) -> dict[str, Any]:
    """One rank's part: train the sharded model, timing plain steps against the engine's
    ``verify`` (every check, the ``ranks`` collective included) run before backward in a step
    of its own; then move one element of a frozen shard on rank 1 and verify again."""
    training = _Training(cfg)
    nudged = "layers.0.linear1.weight"
    try:
        steps, checks = training.rounds(cfg)
        gathers = training.gathers_per_verify()
        # The checks are real: one element of a frozen tensor's shard moves on rank 1 only.
        caught = training.nudge_and_verify(nudged)
    finally:
        training.optimizer.zero_grad(set_to_none=True)  # no gradient left on a DTensor
        training.handle.restore()
    return {
        "rank": training.rank,
        "parameters": training.parameters,
        "frozen tensors": len(training.handle.plan.frozen),
        "steps": steps,
        "checks": checks,
        "verification": asdict(training.verifications[-1]),
        "gathers per verify": gathers,
        "nudged": nudged,
        "caught": caught,
    }


def run(cfg: ShardedConfig) -> list[Row]:
    """The rows of the section, from the timings of rank 0 (the ranks wait for each other at
    every collective) and what both ranks saw."""
    ranks = launch(run_rank, cfg, SHARDED_WORLD)
    lead = ranks[0]

    def per_check(rank: dict[str, Any]) -> float:
        # The check and the step of one round ran back to back: the geometric mean of their
        # ratios cancels slow phases of the machine.
        return geometric_mean_ratio(rank["checks"], rank["steps"])

    step_s, check_s = statistics.median(lead["steps"]), statistics.median(lead["checks"])
    ratio = per_check(lead)
    label = (
        f"{lead['parameters'] / 1e6:.3g}M-parameter transformer ({cfg.layers}x{cfg.width}), "
        f"fully_shard on {SHARDED_WORLD} gloo processes"
    )
    every = cfg.check_every
    extra = {
        "check / one step": ratio,
        "rank 1 check / one step": per_check(ranks[1]),
        "frozen tensors": lead["frozen tensors"],
        "verification (rank 0)": lead["verification"],
        "all_gather_object calls per verify, by rank": [r["gathers per verify"] for r in ranks],
        # The first line of what verify raised on each rank after the move ("": nothing).
        f"{lead['nudged']} moved on rank 1, raised by rank": [
            r["caught"].splitlines()[0] if r["caught"] else "" for r in ranks
        ],
    }
    candidate = "handle.verify (all checks)"
    return [
        Row(f"FSDP2 verification vs one training step, {label}", candidate, "one training step",
            check_s, step_s, "(measured)", None, extra, paired_ratio=ratio),
        Row(f"FSDP2 verification vs training step, {label}, checks every {every} steps "
            "(amortised)", candidate, f"{every} training steps", check_s, every * step_s,
            "<= 0.01", False, {"check / one step": ratio}, paired_ratio=ratio / every,
            limit=0.01),
    ]  # fmt: skip
