"""The checks on the standard PEFT setup at 1.1B parameters: a random-initialised Llama (the
shape of TinyLlama, built from a config) with LoRA adapters (r=8), the base frozen, behind
transformers' reentrant gradient checkpointing, trained on the CPU with AdamW.

Rows, each against a baseline measured in the same run:

* the drift check of the frozen base (the handle's fingerprint watch, ``verify(checks=
  ("drift",))``) against one read of the weights (a sum over every tensor), and the extra
  memory it takes: what the watch keeps (Python heap, ``tracemalloc``) plus how far the check
  raises the process's peak resident memory (the kernel's high-water mark, reset first);
* the reach and cut-off walks (``reachable_parameters``, ``cut_off_parameters``), which re-run
  every checkpointed segment to see the parameters it uses, against one training forward;
* the handle's whole ``verify`` (every check) once every ``check_every`` steps against the
  training steps: each side measured on real steps, the check's time divided by
  ``check_every`` times a step's (the steps between checks run no check at all);
* the peers' way: a deep copy of the model before training and a comparison of every frozen
  tensor after (PEFT's own tests do this), its time and memory.

Its size is set by ``--peft-*`` (:class:`PeftConfig`); the test runs it tiny. Needs
``transformers`` and ``peft`` (the ``peft`` extra).
"""

from __future__ import annotations

import copy
import statistics
import time
import tracemalloc
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

import isolate
from experiments.bench._rows import Row
from experiments.bench._timing import (
    PeakResident,
    geometric_mean_ratio,
    paired,
    return_freed_memory,
    settle,
)
from experiments.bench.networks import LlamaShape, LlamaSizes, llama_lora
from experiments.bench.scale import read_weights
from isolate.cutoff import cut_off_parameters
from isolate.drift import snapshot
from isolate.errors import DriftError
from isolate.reachability import reachable_parameters
from isolate.spec.handle import IsolationHandle

__all__ = ["QUICK_PEFT", "PeftConfig", "run"]


@dataclass(frozen=True)
class PeftConfig(LlamaSizes):
    """Sizes of the ``peft`` section (``--peft-*`` options): the Llama's (by default
    TinyLlama's, 1.1B parameters, 4.4 GB in fp32), then the run's."""

    rank: int = 8  # LoRA r, on q_proj and v_proj
    batch: int = 1
    tokens: int = 64
    steps: int = 3  # training steps; the first warms up and is not counted
    check_every: int = 50  # the cadence a check is amortised over
    repeat: int = 3

    def shape(self) -> LlamaShape:
        return self.with_positions(max(self.tokens, 16))


QUICK_PEFT = PeftConfig(
    hidden=64, intermediate=172, layers=2, heads=4, kv_heads=2, vocab=256, tokens=16, repeat=2
)
# The spec of the standard PEFT setup: everything but the adapters is frozen.
_ADAPTERS = "*lora_*"


class _Run:
    """The model, its handle and optimizer, and a fixed batch."""

    def __init__(self, cfg: PeftConfig) -> None:
        self.cfg = cfg
        self.model = llama_lora(cfg.shape(), reentrant=True, rank=cfg.rank)
        self.handle: IsolationHandle = isolate.IsolationSpec(freeze=[f"!{_ADAPTERS}"]).apply(
            self.model
        )
        self.trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        self.handle.attach(self.optimizer)
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.tokens), generator=generator)

    def forward(self) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=self.ids, labels=self.ids).loss
        return loss

    def finish(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def describe(self) -> dict[str, Any]:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return {
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "trainable parameters": sum(
                p.numel() for p in self.model.parameters() if p.requires_grad
            ),
            "frozen tensors": len(self.handle.frozen),
            "trainable tensors": len(self.trainable),
            "model MB": sum(t.numel() * t.element_size() for t in tensors) / 2**20,
        }


def _label(cfg: PeftConfig, params: int) -> str:
    return (
        f"{params / 1e9:.3g}B Llama + LoRA r={cfg.rank}, reentrant checkpointing, "
        f"{cfg.batch}x{cfg.tokens} tokens"
    )


def _drift_rows(run: _Run, label: str) -> list[Row]:
    """The drift check against one read of the weights: time, and memory."""
    handle, cfg = run.handle, run.cfg
    read = read_weights(run.model)
    seen: list[int] = []
    check_s, read_s, ratio = paired(
        lambda: seen.append(handle.verify(checks=("drift",)).drift),
        read,
        warmup=1,
        repeat=max(cfg.repeat, 2),
    )
    # Memory: what the watch keeps (the same call the handle makes: fingerprints of the
    # frozen tensors by name), then the peak of one check above the resident memory before.
    settle()
    tracemalloc.start()
    kept = snapshot(run.model, names=handle.frozen, drift="fingerprint")
    watch_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    before = settle()
    with PeakResident() as peak:
        handle.verify(checks=("drift",))
    transient = max(peak.peak - before, 0)
    extra_mb = (watch_bytes + transient) / 2**20
    size = sum(t.numel() * t.element_size() for t in [*run.model.parameters()])
    memory = {
        "extra MB": extra_mb,
        "watch kept (tracemalloc) MB": watch_bytes / 2**20,
        "check peak resident growth MB": transient / 2**20,
        "kernel high-water mark": peak.kernel,
        "model MB": size / 2**20,
    }
    checked = {"frozen tensors checked per drift check": seen[-1]}
    return [Row(f"drift check of the frozen base vs one read, {label}",
                "verify(checks=('drift',))", "one read of the weights (sum)", check_s, read_s,
                "<= 1.2", False, checked, paired_ratio=ratio, limit=1.2),
            Row(f"drift check extra memory, {label}", "the watch + one drift check",
                "model size", max(watch_bytes + transient, 1), size, "<= 1 MB", False, memory,
                limit=1.0, metric_name="extra MB", unit="bytes")]  # fmt: skip


def _peers_rows(run: _Run, label: str) -> list[Row]:
    """A deep copy before training and an exact comparison of every frozen tensor after."""
    read = read_weights(run.model)
    start = time.perf_counter()
    read()
    read_s = time.perf_counter() - start
    before = settle()
    with PeakResident() as peak:
        start = time.perf_counter()
        twin = copy.deepcopy(run.model)
        copy_s = time.perf_counter() - start
        frozen = run.handle.frozen
        ours, theirs = dict(run.model.named_parameters()), dict(twin.named_parameters())
        start = time.perf_counter()
        equal = all(torch.equal(ours[n], theirs[n]) for n in frozen)
        compare_s = time.perf_counter() - start
    grown = max(peak.peak - before, 0)
    del twin, ours, theirs
    settle()
    extra = {"deepcopy s": copy_s, "compare s": compare_s, "unchanged": equal,
             "compared tensors": len(frozen)}  # fmt: skip
    return [Row(f"peers: deepcopy before + compare after vs one read, {label}",
                "copy.deepcopy + torch.equal", "one read of the weights (sum)",
                copy_s + compare_s, read_s, "(measured)", None, extra),
            Row(f"peers: deepcopy extra resident memory, {label}", "copy.deepcopy",
                "model size", max(grown, 1), sum(p.numel() * p.element_size()
                                                 for p in run.model.parameters()),
                "(measured)", None, {"extra MB": grown / 2**20}, unit="bytes")]  # fmt: skip


def _walk_rows(run: _Run, label: str) -> list[Row]:
    """The walks through the re-run segments against one training forward."""
    loss = run.forward()
    wanted = tuple(run.trainable)
    results: dict[str, Any] = {}

    def reach() -> None:
        results["reached"] = reachable_parameters(loss, run.model)

    def cut() -> None:
        results["cut"] = cut_off_parameters(loss, run.model)

    rows = []
    repeat = max(run.cfg.repeat, 2)
    for name, walk in (("reachable_parameters", reach), ("cut_off_parameters", cut)):
        walk_s, forward_s, ratio = paired(walk, run.forward, warmup=1, repeat=repeat)
        rows.append(Row(f"{name} through checkpointed segments vs one forward, {label}", name,
                        "one training forward", walk_s, forward_s, "<= 1.0", False,
                        paired_ratio=ratio, limit=1.0))  # fmt: skip
    reached, found = results["reached"], results["cut"]
    # The walks are real: every adapter behind the checkpoints is reached, nothing is cut.
    rows[0].extra = {"reached": len(reached), "trainable": len(wanted),
                     "reached == trainable": reached == wanted}  # fmt: skip
    rows[1].extra = {"cut off": len(found.parameters), "checked": found.trainable}
    return rows


def _loop_step(run: _Run) -> str:
    """One check step of ``handle.check_every(check_every)``; what it raised ("" for nothing).

    The loop checks reach after backward, whose reentrant segments have freed the arguments
    a re-run needs."""
    loop = run.handle.check_every(run.cfg.check_every)
    loop.begin_step(epoch=0, step=0)
    loss = run.forward()
    loop.before_backward(loss, {"loss": loss})
    run.finish(loss)
    try:
        loop.end_step()
    except isolate.IsolationError as error:
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return ""


def _verify_rows(run: _Run, label: str) -> list[Row]:
    """Training steps, each also timing the handle's ``verify`` (every check) before its
    backward: the check's time over ``check_every`` steps' time."""
    cfg, handle = run.cfg, run.handle
    loop_raised = _loop_step(run)  # also the warm-up step
    steps: list[float] = []
    checks: list[float] = []
    verifications = []
    for step in range(1, max(cfg.steps, 2)):
        handle.step(epoch=0, step=step)
        start = time.perf_counter()
        loss = run.forward()
        forward_s = time.perf_counter() - start
        start = time.perf_counter()
        verifications.append(handle.verify({"loss": loss}, total=loss))
        checks.append(time.perf_counter() - start)
        start = time.perf_counter()
        run.finish(loss)
        steps.append(forward_s + time.perf_counter() - start)
    per_step = geometric_mean_ratio(checks, steps)
    every = cfg.check_every
    extra = {
        "verify / one step": per_step,
        "step seconds": steps,
        "verify seconds": checks,
        "verification": asdict(verifications[-1]),
        f"handle.check_every({every}) check step": loop_raised or "passed",
    }
    return [Row(f"verification every {every} steps vs training, {label} (amortised)",
                "handle.verify (all checks)", f"{every} training steps", statistics.median(checks),
                every * statistics.median(steps), "<= 0.01", False, extra,
                paired_ratio=per_step / every, limit=0.01)]  # fmt: skip


def _nudged(run: _Run) -> str:
    """One element of a frozen base weight moves: what the drift check raised ("" for
    nothing); the element is put back."""
    name = run.handle.frozen[len(run.handle.frozen) // 2]
    weight = run.model.get_parameter(name)
    with torch.no_grad():
        old = weight.view(-1)[0].item()
        weight.view(-1)[0] += 1.0
    try:
        run.handle.verify(checks=("drift",))
    except DriftError as error:
        return f"{name}: {error}"
    finally:
        with torch.no_grad():
            weight.view(-1)[0] = old
    return f"{name}: "


def run(cfg: PeftConfig) -> list[Row]:
    """The rows of the section (see the module's docstring)."""
    return_freed_memory()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
        training = _Run(cfg)
        try:
            described = training.describe()
            label = _label(cfg, described["parameters"])
            rows = _drift_rows(training, label)
            rows += _peers_rows(training, label)
            rows += _walk_rows(training, label)
            rows += _verify_rows(training, label)
            caught = _nudged(training)
        finally:
            training.handle.restore()
    rows[0].extra |= described | {"a base weight moved, the drift check raised": caught}
    return rows
