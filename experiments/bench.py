"""Benchmarks: what isolation costs and what it saves, each as a ratio against its baseline
measured in the same run.

Run ``python -m experiments.bench`` (``--quick`` for small sizes). Results are printed as a
Markdown table and written to ``outputs/bench/bench.json`` and ``outputs/bench/bench.md``.
The ``scale`` section (``--only scale``) measures the checks on a large model; its size is set
by ``--scale-layers/--scale-width`` (default: 24 encoder layers of width 1024, 302M
parameters, 1.2 GB in fp32; under 3 minutes at one thread on a busy 2-core machine, peak resident
memory under 4 GB).
The ``sharded`` section (``--only sharded``) measures the engine's verification against a
training step under ``fully_shard`` (FSDP2) on 2 CPU processes (gloo); its size is set by
``--sharded-layers/--sharded-width`` (default: 8 encoder layers of width 512, 25M parameters,
40 s on an idle 2-core machine).

Every row states its target as a limit on one number (``metric``, the ratio unless said
otherwise), and ``ok`` is that limit applied to the number written next to it.

Every figure is the median of interleaved repeats (A, B, A, B, ...) after warm-up, so slow
phases of a shared machine hit both sides alike.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import math
import os
import platform
import re
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

import isolate
from isolate import gradient_report
from isolate.fingerprints import Scheme, fingerprints
from isolate.reachability import reachable_parameters
from isolate.spec.checks import Verification


@dataclass
class Row:
    """One comparison: the candidate's median time over the baseline's."""

    name: str
    candidate: str
    baseline: str
    candidate_s: float
    baseline_s: float
    target: str
    ok: bool | None  # None: measured, no target
    extra: dict[str, Any] = field(default_factory=dict)
    paired_ratio: float | None = None
    limit: float | None = None  # the target as "metric <= limit"; None: measured, no target
    metric_name: str = "ratio"  # what the limit applies to: "ratio", or a key of extra
    unit: str = "s"  # of candidate_s / baseline_s: "s" or "bytes"

    def __post_init__(self) -> None:
        if self.limit is not None:  # the verdict is the stated limit applied to the number
            self.ok = self.metric <= self.limit

    @property
    def metric(self) -> float:
        """The number the target's limit applies to."""
        return self.ratio if self.metric_name == "ratio" else float(self.extra[self.metric_name])

    @property
    def ratio(self) -> float:
        """The geometric mean of per-pair ratios where pairs were timed back to back, else
        the ratio of medians."""
        if self.paired_ratio is not None:
            return self.paired_ratio
        return self.candidate_s / self.baseline_s


def _median_pair(
    candidate: Callable[[], object],
    baseline: Callable[[], object],
    *,
    warmup: int,
    repeat: int,
    collect: bool = True,
) -> tuple[float, float]:
    c, b, _ = _paired(candidate, baseline, warmup=warmup, repeat=repeat, collect=collect)
    return c, b


def _paired(
    candidate: Callable[[], object],
    baseline: Callable[[], object],
    *,
    warmup: int,
    repeat: int,
    collect: bool = True,
) -> tuple[float, float, float]:
    """Medians of both sides and the median of the ratios of back-to-back pairs: a slow phase
    of a shared machine hits both members of a pair, so the per-pair ratio cancels it."""
    for _ in range(warmup):
        candidate()
        baseline()
    times_c: list[float] = []
    times_b: list[float] = []
    for i in range(repeat):
        # Alternate which side goes first so neither always runs on a warmer cache.
        order = [(candidate, times_c), (baseline, times_b)]
        for fn, bucket in order if i % 2 == 0 else reversed(order):
            if collect:
                gc.collect()
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    # Which member of a pair runs first alternates, and the first one tends to run on colder
    # caches: the geometric mean over an even number of pairs cancels that order effect,
    # where a median of the (two-humped) ratios would land on either hump.
    ratios = [c / b for c, b in zip(times_c, times_b, strict=True)]
    mean_log = statistics.fmean(math.log(r) for r in ratios)
    return statistics.median(times_c), statistics.median(times_b), math.exp(mean_log)


def _median(fn: Callable[[], object], *, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- networks ----------------------------------------------------------------------------


def mnist_net() -> tuple[nn.Module, nn.Module, Callable[[int], torch.Tensor]]:
    trunk = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
    )  # fmt: skip
    return trunk, nn.Linear(128, 10), lambda n: torch.randn(n, 1, 28, 28)


def resnet_net(size: int) -> tuple[nn.Module, nn.Module, Callable[[int], torch.Tensor]]:
    import torchvision

    resnet = torchvision.models.resnet18(weights=None)
    resnet.fc = nn.Identity()  # type: ignore[assignment]
    return resnet, nn.Linear(512, 10), lambda n: torch.randn(n, 3, size, size)


def _step_fn(
    trunk: nn.Module,
    head: nn.Module,
    aux: nn.Module,
    feed: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
) -> Callable[[], None]:
    params = [*trunk.parameters(), *head.parameters(), *aux.parameters()]
    optimizer = torch.optim.SGD(params, lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        features = trunk(x)
        main = nn.functional.cross_entropy(head(features), y)
        side = nn.functional.cross_entropy(feed(features), y)
        (main + side).backward()
        optimizer.step()

    return step


class _ReverseByHand(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


def bench_wrappers(quick: bool) -> list[Row]:
    rows = []
    nets = {
        "MNIST CNN, batch 128": (mnist_net, 128),
        "ResNet-18, batch 16 of 64x64" if not quick else "ResNet-18, batch 4 of 32x32": (
            (lambda: resnet_net(64 if not quick else 32)),
            16 if not quick else 4,
        ),
    }
    for label, (build, batch) in nets.items():
        torch.manual_seed(0)
        trunk, head, _ = build()
        x = build()[2](batch)
        y = torch.randint(0, 10, (batch,))
        width = head.in_features  # type: ignore[union-attr]
        side = nn.Linear(width, 10)
        pairs: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., Any]]] = {
            "Detached vs x.detach()": (isolate.Detached(side), lambda f, s=side: s(f.detach())),
            "Cloned vs x.clone()": (isolate.Cloned(side), lambda f, s=side: s(f.clone())),
            "GradientScale(-1) vs hand-written reversal": (
                nn.Sequential(isolate.GradientScale(-1.0), side),
                lambda f, s=side: s(_ReverseByHand.apply(f)),
            ),
        }
        features = trunk(x).detach().requires_grad_(True)
        for name, (wrapped, by_hand) in pairs.items():
            candidate = _step_fn(trunk, head, side, wrapped, x, y)
            baseline = _step_fn(trunk, head, side, by_hand, x, y)
            c, b, ratio = _paired(candidate, baseline, warmup=3, repeat=6 if quick else 60)
            # The wrapper's own cost, timed on the branch alone (forward + backward) where it is
            # not buried in the noise of a whole step: the step ratio it implies.
            branch_c, branch_b = _median_pair(
                lambda w=wrapped, f=features: w(f).sum().backward(),
                lambda h=by_hand, f=features: h(f).sum().backward(),
                warmup=20,
                repeat=50 if quick else 400,
                collect=False,
            )
            overhead = branch_c - branch_b
            candidate_name, baseline_name = name.split(" vs ")
            rows.append(
                Row(
                    f"{name} ({label})",
                    candidate_name,
                    baseline_name,
                    c,
                    b,
                    "<= 1.02",
                    ratio <= 1.02,
                    {
                        "overhead per call (us)": round(1e6 * overhead, 1),
                        "step ratio implied by the overhead": round((b + overhead) / b, 5),
                    },
                    paired_ratio=ratio,
                    limit=1.02,
                )
            )
            if isinstance(wrapped, isolate.Detached | isolate.Cloned):
                wrapped.unwrap()
    return rows


def bench_freeze(quick: bool) -> list[Row]:
    from pytorch_lightning.callbacks import BaseFinetuning

    count = 1000 if quick else 5000  # two parameter tensors per layer
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(count))  # type: ignore[assignment]
    params = list(model.parameters())

    def with_isolate() -> None:
        isolate.freeze(model, "blocks.*.weight", "blocks.*.bias").restore()

    def by_hand() -> None:
        flags = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(False)
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)

    def with_lightning() -> None:
        BaseFinetuning.freeze(model.blocks, train_bn=True)
        BaseFinetuning.make_trainable(model.blocks)

    repeat = 5 if quick else 15
    c, b = _median_pair(with_isolate, by_hand, warmup=1, repeat=repeat)
    lightning = _median(with_lightning, warmup=1, repeat=3 if quick else 5)
    return [
        Row(f"freeze+restore, {len(params)} tensors, glob selectors", "isolate.freeze",
            "bare requires_grad loop", c, b, "<= 1.5", c / b <= 1.5, limit=1.5),
        Row(f"freeze+restore, {len(params)} tensors", "isolate.freeze",
            "BaseFinetuning.freeze+make_trainable", c, lightning, "<= 0.1", c / lightning <= 0.1,
            limit=0.1),
    ]  # fmt: skip


def bench_reachability(quick: bool) -> list[Row]:
    rows = []
    torch.manual_seed(0)
    resnet, _, make = resnet_net(32 if quick else 128)
    batch = 4 if quick else 32
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(128 if quick else 512, 8, batch_first=True),
        num_layers=2 if quick else 12,
        enable_nested_tensor=False,
    )
    tokens = torch.randn(batch, 32 if quick else 128, 128 if quick else 512)
    cases = {
        f"ResNet-18, {batch} images": (resnet, lambda: resnet(make(batch)).square().mean()),
        "Transformer encoder": (encoder, lambda: encoder(tokens).square().mean()),
    }
    for label, (model, loss_fn) in cases.items():
        walks, backwards = [], []
        for _ in range(2 if quick else 3):
            loss = loss_fn()
            walks.append(
                _median(lambda: reachable_parameters(loss, model), warmup=1, repeat=5)  # noqa: B023
            )
            start = time.perf_counter()
            loss.backward()
            backwards.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        c, b = statistics.median(walks), statistics.median(backwards)
        rows.append(Row(f"reachable_parameters ({label})", "graph walk", "one backward pass",
                        c, b, "<= 0.02", c / b <= 0.02, limit=0.02))  # fmt: skip
    return rows


def bench_report(quick: bool) -> list[Row]:
    torch.manual_seed(0)
    trunk, head, make = mnist_net()
    aux = [nn.Linear(128, 10) for _ in range(3)]
    model = nn.ModuleDict({"trunk": trunk, "head": head, "aux": nn.ModuleList(aux)})
    x, y = make(64), torch.randint(0, 10, (64,))
    params = [p for p in model.parameters() if p.requires_grad]

    def losses() -> dict[str, torch.Tensor]:
        features = trunk(x)
        out = {"main": nn.functional.cross_entropy(head(features), y)}
        for i, branch in enumerate(aux):
            out[f"aux{i}"] = nn.functional.cross_entropy(branch(features), y)
        return out

    def with_report() -> None:
        gradient_report(losses(), model)

    def by_hand() -> None:
        named = losses()
        for loss in named.values():
            torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)

    c, b = _median_pair(with_report, by_hand, warmup=1, repeat=5 if quick else 15)
    return [Row("gradient_report, K=4 losses (MNIST CNN)", "gradient_report",
                "K autograd.grad passes", c, b, "<= 1.1", c / b <= 1.1, limit=1.1)]  # fmt: skip


def _saved_bytes(fn: Callable[[], object]) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def bench_frozen(quick: bool) -> list[Row]:
    from pytorch_lightning.callbacks import BaseFinetuning

    torch.manual_seed(0)
    trunk, head, make = resnet_net(32 if quick else 64)
    batch = 4 if quick else 16
    x, y = make(batch), torch.randint(0, 10, (batch,))
    trunk.train()
    everything = torch.optim.SGD([*trunk.parameters(), *head.parameters()], lr=1e-4)
    head_only = torch.optim.SGD(head.parameters(), lr=1e-4)

    def by_hand_on() -> None:
        for p in trunk.parameters():
            p.requires_grad_(False)

    def by_hand_off() -> None:
        for p in trunk.parameters():
            p.requires_grad_(True)

    wrapped: list[isolate.Frozen] = []
    # name -> (set up, the module to call, the optimizer, tear down)
    variants: dict[
        str, tuple[Callable[[], object], Callable[[], nn.Module], Any, Callable[..., Any]]
    ]
    variants = {
        "trained trunk": (lambda: None, lambda: trunk, everything, lambda: None),
        "requires_grad=False by hand": (by_hand_on, lambda: trunk, head_only, by_hand_off),
        "BaseFinetuning.freeze": (
            lambda: BaseFinetuning.freeze(trunk, train_bn=False),
            lambda: trunk,
            head_only,
            lambda: BaseFinetuning.make_trainable(trunk),
        ),
        "Frozen": (
            lambda: wrapped.append(isolate.Frozen(trunk)),
            lambda: wrapped[-1],
            head_only,
            lambda: wrapped.pop().unwrap(),
        ),
    }  # fmt: skip

    def step(module: nn.Module, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(head(module(x)), y).backward()
        optimizer.step()

    memory: dict[str, int] = {}
    times: dict[str, list[float]] = {name: [] for name in variants}
    rounds = 3 if quick else 9
    for r in range(rounds + 1):  # round 0 warms up and measures memory
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            setup, module, optimizer, teardown = variants[name]
            setup()
            if r == 0:
                called = module()
                memory[name] = _saved_bytes(lambda m=called, o=optimizer: step(m, o))
            else:
                start = time.perf_counter()
                step(module(), optimizer)
                times[name].append(time.perf_counter() - start)
            teardown()
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    others = [n for n in variants if n != "Frozen"]
    per_round = [times["Frozen"][i] / min(times[n][i] for n in others) for i in range(rounds)]
    ratio = statistics.median(per_round)
    extra = {"saved activation bytes": memory, "step seconds (median)": medians}
    best = min(medians[n] for n in others)
    by_hand = memory["requires_grad=False by hand"]
    return [Row("Frozen(trunk) step, ResNet-18 trunk", "Frozen", "best of trained / by hand / "
                "BaseFinetuning", medians["Frozen"], best, "<= 1.03", ratio <= 1.03,
                extra, paired_ratio=ratio, limit=1.03),
            Row("Frozen(trunk) saved activations, ResNet-18 trunk", "Frozen",
                "requires_grad=False by hand", memory["Frozen"], by_hand, "<= 1.0",
                memory["Frozen"] <= by_hand, limit=1.0, unit="bytes")]  # fmt: skip


def _fit_seconds(with_callback: bool, steps: int, root: Path) -> float:
    """Wall time of ``steps`` training steps of the MNIST CNN with a detached linear probe."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from isolate.lightning import IsolationCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.trunk, self.head, _ = mnist_net()
            self.probe = nn.Linear(128, 10)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            features = self.trunk(x)
            main = nn.functional.cross_entropy(self.head(features), y)
            aux = nn.functional.cross_entropy(self.probe(features), y)
            self.isolation_losses = {"probe": aux}
            return main + aux

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64 * steps, 1, 28, 28, generator=generator),
        torch.randint(0, 10, (64 * steps,), generator=generator),
    )
    callbacks = [IsolationCallback(detach=["probe"], verify_every_n_steps=50)]
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks if with_callback else [],
    )
    start = time.perf_counter()
    trainer.fit(Module(), DataLoader(data, batch_size=64))
    return time.perf_counter() - start


def bench_callback(quick: bool) -> list[Row]:
    import logging
    import tempfile
    import warnings

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    steps = 60 if quick else 200
    with_cb: list[float] = []
    without: list[float] = []
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit_seconds(True, 5, Path(root))  # warm-up: imports, first-call overheads
        for i in range(2 if quick else 5):
            order = [(True, with_cb), (False, without)]
            for flag, bucket in order if i % 2 == 0 else reversed(order):
                bucket.append(_fit_seconds(flag, steps, Path(root)))
    c, b = statistics.median(with_cb), statistics.median(without)
    # Throughput is steps/time, so throughput ratio = baseline time / candidate time.
    return [Row(f"IsolationCallback (detach + checks every 50 steps), {steps} MNIST steps",
                "with callback", "without", c, b, "throughput >= 0.97 (time ratio <= 1.031)",
                b / c >= 0.97, {"throughput ratio": b / c}, limit=1 / 0.97)]  # fmt: skip


# --- scale: the checks on a large model -------------------------------------------------------


@dataclass
class ScaleConfig:
    """Sizes of the ``scale`` section (``--scale-*`` options); the default is a 302M-parameter
    transformer encoder, 1.2 GB in fp32."""

    layers: int = 24
    width: int = 1024
    heads: int = 16
    batch: int = 2
    tokens: int = 64
    check_every: int = 50  # the callback's verify_every_n_steps, to amortise a check
    report_layers: int = 4  # gradient_report runs K backward passes: a smaller model
    repeat: int = 5


QUICK_SCALE = ScaleConfig(layers=2, width=64, heads=4, batch=2, tokens=8, report_layers=2, repeat=2)
scale_config = ScaleConfig()


def transformer(layers: int, width: int, heads: int) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc, else the peak from getrusage)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakResident:
    """The highest resident memory while the block runs: the kernel's own high-water mark
    (``VmHWM``, reset on entry through ``/proc/self/clear_refs``) where Linux allows it, else
    a sample every millisecond (which can miss a short peak on a busy machine)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._kernel = False

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.001)

    @staticmethod
    def _high_water() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise OSError("no VmHWM in /proc/self/status")

    def __enter__(self) -> PeakResident:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
            self._high_water()
            self._kernel = True
        except OSError:
            self._kernel = False
        self.peak = resident_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())
        if self._kernel:
            self.peak = max(self.peak, self._high_water())


def read_weights(model: nn.Module) -> Callable[[], None]:
    """One read of the weights: a sum over every parameter and buffer (the baseline)."""
    tensors = [t.detach() for t in [*model.parameters(), *model.buffers()]]

    def read() -> None:
        for t in tensors:
            t.sum()

    return read


def device_scheme(model: nn.Module) -> Callable[[], None]:
    """For reference: the fingerprints an accelerator computes (weighted int32 sums on the
    device, no copy to the host), run here on the CPU's integer ``mv``."""
    tensors = [t.detach() for t in [*model.parameters(), *model.buffers()]]
    forced: dict[int, Scheme] = {id(t): "device" for t in tensors}

    def read() -> None:
        fingerprints(tensors, forced)

    return read


def callback_verification(model: nn.Module, frozen: list[str]) -> Callable[[torch.Tensor], None]:
    """What the callback does at a check step: the engine's ``verify`` of a spec freezing
    ``frozen`` (drift by fingerprints, the loss's reach both ways, the flags)."""
    handle = isolate.IsolationSpec(freeze=frozen).apply(model)

    def verify(loss: torch.Tensor) -> None:
        handle.verify({"loss": loss}, total=loss)

    return verify


def _scale_checks(model: nn.Module, cfg: ScaleConfig, label: str) -> list[Row]:
    params = sum(p.numel() for p in model.parameters())
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    read = read_weights(model)
    rows = []
    tiny = cfg.repeat < 3  # a test run: no garbage collection between timings
    c, b, ratio = _paired(
        lambda: isolate.snapshot(model, copy=False),
        read,
        warmup=1,
        repeat=cfg.repeat,
        collect=not tiny,
    )
    rows.append(Row(f"fingerprint snapshot, {label}", "snapshot(copy=False)",
                    "one read of the weights (sum)", c, b, "<= 1.5", False, paired_ratio=ratio,
                    limit=1.5))  # fmt: skip
    snap = isolate.snapshot(model, copy=False)
    c, b, ratio = _paired(
        snap.assert_unchanged, read, warmup=1, repeat=cfg.repeat, collect=not tiny
    )
    # For reference, in the same run: the accelerator scheme, run on this CPU.
    dev_c, _, dev_ratio = _paired(
        device_scheme(model), read, warmup=1, repeat=cfg.repeat, collect=not tiny
    )
    rows.append(Row(f"fingerprint check, {label}", "assert_unchanged()",
                    "one read of the weights (sum)", c, b, "<= 1.5", False,
                    {"device scheme on this CPU / one read": dev_ratio,
                     "device scheme on this CPU (ms)": 1e3 * dev_c},
                    paired_ratio=ratio, limit=1.5))  # fmt: skip
    del snap
    gc.collect()
    before = resident_bytes()
    snap = isolate.snapshot(model, copy=False)
    extra = max(resident_bytes() - before, 0)
    del snap
    gc.collect()
    before = resident_bytes()
    copied = isolate.snapshot(model)  # for scale: what a copy costs
    copy_extra = resident_bytes() - before
    del copied
    gc.collect()
    rows.append(Row(f"fingerprint snapshot extra resident memory, {label}",
                    "snapshot(copy=False)", "model size", max(extra, 1), size, "<= 1 MB", False,
                    {"extra MB": extra / 2**20, "model MB": size / 2**20,
                     "snapshot(copy=True) extra MB": copy_extra / 2**20, "parameters": params},
                    limit=1.0, metric_name="extra MB", unit="bytes"))  # fmt: skip
    return rows


def _scale_training(model: nn.Module, cfg: ScaleConfig, label: str) -> list[Row]:
    """The callback's check against a training step of the same model, half of it frozen."""
    blocks = model.layers  # type: ignore[union-attr]
    frozen_modules = list(blocks)[: len(blocks) // 2]
    frozen = [
        name
        for name, p in model.named_parameters()
        if any(p is q for m in frozen_modules for q in m.parameters())
    ]
    for m in frozen_modules:
        m.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1e-4)
    x = torch.randn(cfg.batch, cfg.tokens, cfg.width)
    verify = callback_verification(model, frozen)
    steps: list[float] = []
    checks: list[float] = []
    walks: list[float] = []
    backwards: list[float] = []
    try:
        for i in range(cfg.repeat + 1):  # the first round warms up
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            step = time.perf_counter() - start
            loss = model(x).square().mean()
            start = time.perf_counter()
            verify(loss)
            check = time.perf_counter() - start
            start = time.perf_counter()
            reachable_parameters(loss, model)
            walk = time.perf_counter() - start
            start = time.perf_counter()
            loss.backward()
            backward = time.perf_counter() - start
            optimizer.zero_grad(set_to_none=True)
            if i:
                steps.append(step)
                checks.append(check)
                walks.append(walk)
                backwards.append(backward)
    finally:
        model.requires_grad_(True)
    step_s, check_s = statistics.median(steps), statistics.median(checks)
    every = cfg.check_every
    return [
        Row(f"callback verification vs training step, {label}, checks every {every} steps "
            "(amortised)", "handle.verify (drift, reach, flags)",
            f"{every} training steps", check_s, every * step_s, "<= 0.01", False,
            {"check / one step": check_s / step_s, "frozen tensors": len(frozen)},
            limit=0.01),
        Row(f"reachable_parameters vs one backward, {label}", "graph walk", "one backward pass",
            statistics.median(walks), statistics.median(backwards), "<= 0.02", False,
            limit=0.02),
    ]  # fmt: skip


def _return_freed_memory() -> None:
    """Make glibc hand every block of 128 KiB or more back to the system when it is freed, so
    that resident memory tracks live tensors (by default, freed blocks below a threshold that
    grows up to 32 MiB stay resident and a later run reuses them unseen)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _settle() -> int:
    """Collect garbage and hand free heap memory back (glibc ``malloc_trim``): freed memory
    that stays resident would be reused unseen by the next measurement. Returns resident
    memory after."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return resident_bytes()


def _scale_report(cfg: ScaleConfig) -> list[Row]:
    """gradient_report's peak memory against K plain backward passes over the same graph."""
    _return_freed_memory()
    model = transformer(cfg.report_layers, cfg.width, cfg.heads)
    heads = nn.ModuleList(nn.Linear(cfg.width, 1) for _ in range(4))
    full = nn.ModuleDict({"trunk": model, "heads": heads})
    params = [p for p in full.parameters() if p.requires_grad]
    x = torch.randn(cfg.batch, cfg.tokens, cfg.width)

    def losses() -> dict[str, torch.Tensor]:
        features = model(x)
        return {f"loss{k}": head(features).square().mean() for k, head in enumerate(heads)}

    def by_hand() -> None:
        for loss in losses().values():
            torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)

    def with_report() -> None:
        gradient_report(losses(), full)

    peaks: dict[str, list[int]] = {"report": [], "by hand": []}
    for i in range(2 if cfg.repeat < 3 else 3):
        order = [("report", with_report), ("by hand", by_hand)]
        for name, fn in order if i % 2 == 0 else reversed(order):
            base = _settle()
            with PeakResident() as peak:
                fn()
            peaks[name].append(max(peak.peak - base, 1))
    c, b = statistics.median(peaks["report"]), statistics.median(peaks["by hand"])
    n = sum(p.numel() for p in params)
    return [Row(f"gradient_report peak extra memory, K=4 losses, {n / 1e6:.0f}M-parameter "
                "transformer", "gradient_report", "K autograd.grad passes", c, b, "(measured)",
                None, {"parameters": n}, unit="bytes")]  # fmt: skip


def _scale_wrappers(cfg: ScaleConfig) -> list[Row]:
    """The wrappers' own cost per call (forward + backward of a small branch)."""
    torch.manual_seed(0)
    # A small branch on small features: the wrappers' cost does not grow with the tensors,
    # and a short step keeps the machine's noise below the microseconds being measured.
    side = nn.Linear(64, 10)
    # Features as a trunk hands them over: not a leaf (a leaf that requires grad, such as a
    # parameter, is copied by GradientScale so that an in-place op cannot write into it).
    leaf = torch.randn(8, 64, requires_grad=True)
    features = leaf.view_as(leaf)
    detached, cloned, reverse = (
        isolate.Detached(side),
        isolate.Cloned(side),
        isolate.GradientScale(-1),
    )
    Branch = Callable[[torch.Tensor], torch.Tensor]
    pairs: dict[str, tuple[Branch, Branch]] = {
        "Detached": (detached, lambda f: side(f.detach())),
        "Cloned": (cloned, lambda f: side(f.clone())),
        "GradientScale(-1)": (lambda f: side(reverse(f)), lambda f: side(_ReverseByHand.apply(f))),
    }
    rows = []
    try:
        for name, (wrapped, by_hand) in pairs.items():
            c, b = _median_pair(
                lambda w=wrapped: w(features).sum().backward(),
                lambda h=by_hand: h(features).sum().backward(),
                warmup=5 if cfg.repeat < 3 else 20,
                repeat=20 if cfg.repeat < 3 else 400,
                collect=False,
            )
            overhead = 1e6 * (c - b)
            rows.append(Row(f"{name} per-call overhead", name, "the same by hand", c, b,
                            "overhead <= 12 us", False, {"overhead per call (us)": overhead},
                            limit=12.0, metric_name="overhead per call (us)"))  # fmt: skip
    finally:
        detached.unwrap()
        cloned.unwrap()
    return rows


def _scale_resolved_freeze(cfg: ScaleConfig) -> list[Row]:
    """Applying and restoring an already resolved selection against the bare flag loop:
    freezing a trainable model, and thawing a frozen one (what a thaw step does)."""
    from isolate.freezing import FreezeHandle

    count = 100 if cfg.repeat < 3 else 5000  # two tensors per layer
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(count))  # type: ignore[assignment]
    resolved = dict(model.named_parameters())
    norms: dict[str, nn.Module] = {}
    tensors = list(resolved.values())
    tiny = cfg.repeat < 3
    rows = []
    for thaw in (False, True):
        model.requires_grad_(thaw)  # thawing starts from a frozen model
        start = not thaw

        def apply_restore(thaw: bool = thaw) -> None:
            FreezeHandle(model, "freeze()", resolved, norms, thaw, "eval").restore()

        def by_hand(start: bool = start) -> None:
            flags = [p.requires_grad for p in tensors]
            for p in tensors:
                p.requires_grad_(not start)
            for p, flag in zip(tensors, flags, strict=True):
                p.requires_grad_(flag)

        c, b, ratio = _paired(
            apply_restore, by_hand, warmup=2, repeat=6 if tiny else 30, collect=not tiny
        )
        what = "thaw" if thaw else "apply"
        rows.append(Row(f"{what} + restore of a resolved selection, {len(tensors)} tensors",
                        "FreezeHandle(...).restore()", "bare requires_grad loop", c, b, "<= 1.5",
                        False, paired_ratio=ratio, limit=1.5))  # fmt: skip
    model.requires_grad_(True)
    return rows


def _scale_resolution(cfg: ScaleConfig) -> list[Row]:
    """Resolving glob selectors from scratch against the least any resolver does: one
    ``named_parameters()`` walk and ``fnmatch`` over the names."""
    from isolate._selectors import select

    count = 100 if cfg.repeat < 3 else 5000  # two tensors per layer
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(count))  # type: ignore[assignment]
    selectors = ("blocks.*.weight", "blocks.*.bias")

    def resolve() -> None:
        select(model, selectors, "bench")

    def walk_and_match() -> None:
        patterns = [re.compile(fnmatch.translate(s)) for s in selectors]
        names = [name for name, _ in model.named_parameters()]
        [name for name in names if any(p.match(name) for p in patterns)]

    tiny = cfg.repeat < 3
    c, b, ratio = _paired(
        resolve, walk_and_match, warmup=2, repeat=6 if tiny else 30, collect=not tiny
    )
    return [Row(f"resolving 2 glob selectors from scratch, {2 * count} tensors", "select()",
                "named_parameters() walk + fnmatch", c, b, "<= 1.0", False,
                paired_ratio=ratio, limit=1.0)]  # fmt: skip


def bench_scale(quick: bool) -> list[Row]:
    cfg = QUICK_SCALE if quick else scale_config
    _return_freed_memory()
    model = transformer(cfg.layers, cfg.width, cfg.heads)
    params = sum(p.numel() for p in model.parameters())
    label = f"{params / 1e6:.0f}M-parameter transformer ({cfg.layers}x{cfg.width})"
    rows = _scale_checks(model, cfg, label)
    rows += _scale_training(model, cfg, label)
    del model
    gc.collect()
    rows += _scale_report(cfg)
    rows += _scale_wrappers(cfg)
    rows += _scale_resolved_freeze(cfg)
    rows += _scale_resolution(cfg)
    return rows


# --- sharded: the verification under 2-process FSDP2 ------------------------------------------


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
sharded_config = ShardedConfig()
SHARDED_WORLD = 2
# Left over from an enclosing distributed run, these would make the workers join it.
_RENDEZVOUS = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What the callback checks at the end of a check step (no graph needed).
_END_OF_STEP_CHECKS = ("drift", "flags", "optimizers", "ranks")


def _sharded_run(cfg: ShardedConfig) -> dict[str, Any]:
    """One rank's part: train the sharded model, timing plain steps against the engine's
    ``verify`` (every check, the ``ranks`` collective included) run before backward in a step
    of its own; then move one element of a frozen shard on rank 1 and verify again."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = transformer(cfg.layers, cfg.width, cfg.heads)  # seeded: the same on every rank
    params = sum(p.numel() for p in model.parameters())
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    frozen = tuple(f"layers.{i}" for i in range(cfg.layers // 2))  # the first half
    handle = isolate.IsolationSpec(freeze=frozen).apply(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    handle.attach(optimizer)  # searched by the "optimizers" check
    x = torch.randn(cfg.batch, cfg.tokens, cfg.width, generator=torch.Generator().manual_seed(rank))
    verifications: list[Verification] = []

    def timed(fn: Callable[[], object]) -> float:
        gc.collect()
        dist.barrier()  # both ranks start together: neither time holds the other's lag
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def finish(loss: torch.Tensor) -> None:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step() -> None:
        finish(model(x).square().mean())

    def check_step() -> float:
        loss = model(x).square().mean()
        check = timed(lambda: verifications.append(handle.verify({"loss": loss}, total=loss)))
        finish(loss)
        return check

    steps: list[float] = []
    checks: list[float] = []
    try:
        for i in range(cfg.warmup + cfg.repeat):
            # Alternate which goes first so neither always runs on a warmer cache.
            if i % 2 == 0:
                s = timed(step)
                c = check_step()
            else:
                c = check_step()
                s = timed(step)
            if i >= cfg.warmup:
                steps.append(s)
                checks.append(c)
        # The ranks check is a collective of its own (one all_gather_object of fingerprints
        # and of what each rank found): count it in one more check step, outside the timings.
        gathers: list[int] = []
        plain = dist.all_gather_object

        def counted(*args: Any, **kwargs: Any) -> Any:
            gathers.append(1)
            return plain(*args, **kwargs)

        dist.all_gather_object = counted
        try:
            check_step()
        finally:
            dist.all_gather_object = plain
        # The checks are real: one element of a frozen tensor's shard moves on rank 1 only.
        nudged = "layers.0.linear1.weight"
        if rank == 1:
            local = model.get_parameter(nudged).to_local()  # type: ignore[attr-defined]
            with torch.no_grad():
                local[(0,) * local.dim()] += 1e-3
        try:
            handle.verify(checks=_END_OF_STEP_CHECKS)  # every rank: "ranks" is a collective
            caught = ""
        except isolate.IsolationError as error:
            caught = f"{type(error).__name__}: {error}"
    finally:
        optimizer.zero_grad(set_to_none=True)  # no gradient left on a DTensor at teardown
        handle.restore()
    last = verifications[-1]
    return {
        "rank": rank,
        "parameters": params,
        "frozen tensors": len(handle.plan.frozen),
        "steps": steps,
        "checks": checks,
        "verification": asdict(last),
        "gathers per verify": len(gathers),
        "nudged": nudged,
        "caught": caught,
    }


def _sharded_worker(rank: int, world: int, port: int, cfg: ShardedConfig, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),  # a rank left waiting fails instead of hanging
    )
    try:
        result = _sharded_run(cfg)
        Path(out, f"sharded-rank{rank}.json").write_text(json.dumps(result))
    finally:
        gc.collect()  # the sharded model and its pending collectives go first
        dist.barrier()
        dist.destroy_process_group()


@contextmanager
def _worker_env() -> Iterator[None]:
    """One thread per worker and no inherited rendezvous, for the workers spawned inside."""
    saved = {key: os.environ.get(key) for key in (*_RENDEZVOUS, "OMP_NUM_THREADS")}
    for key in _RENDEZVOUS:
        os.environ.pop(key, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def sharded_ranks(cfg: ShardedConfig) -> list[dict[str, Any]]:
    """What each of the :data:`SHARDED_WORLD` processes measured, by rank."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="isolate-bench-") as out, _worker_env():
        mp.spawn(_sharded_worker, args=(SHARDED_WORLD, port, cfg, out), nprocs=SHARDED_WORLD)
        return [
            json.loads(Path(out, f"sharded-rank{r}.json").read_text()) for r in range(SHARDED_WORLD)
        ]


def bench_sharded(quick: bool) -> list[Row]:
    cfg = QUICK_SHARDED if quick else sharded_config
    ranks = sharded_ranks(cfg)
    lead = ranks[0]  # the timings of rank 0; the ranks wait for each other at every collective

    def per_check(rank: dict[str, Any]) -> float:
        # The check and the step of one round ran back to back: the geometric mean of their
        # ratios cancels slow phases of the machine.
        pairs = zip(rank["checks"], rank["steps"], strict=True)
        return math.exp(statistics.fmean(math.log(c / s) for c, s in pairs))

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


SECTIONS: dict[str, Callable[[bool], list[Row]]] = {
    "wrappers": bench_wrappers,
    "freeze": bench_freeze,
    "reachability": bench_reachability,
    "report": bench_report,
    "frozen": bench_frozen,
    "callback": bench_callback,
    "scale": bench_scale,
    "sharded": bench_sharded,
}


def _amount(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / 2**20:.3f} MB"
    return f"{1e3 * value:.3f} ms"


def table(rows: list[Row]) -> str:
    lines = [
        "| benchmark | candidate | baseline | candidate | baseline | ratio | target | met |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        met = "-" if r.limit is None else ("yes" if r.ok else "NO")
        lines.append(
            f"| {r.name} | {r.candidate} | {r.baseline} | {_amount(r.candidate_s, r.unit)} | "
            f"{_amount(r.baseline_s, r.unit)} | {r.ratio:.4g} | {r.target} | {met} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--output", default="outputs/bench", help="folder for bench.json/md")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="sections to run")
    for section, config in (("scale", ScaleConfig()), ("sharded", ShardedConfig())):
        for name, default in vars(config).items():
            parser.add_argument(f"--{section}-{name.replace('_', '-')}", type=int,
                                default=default,
                                help=f"{section} section: {name} (default {default})")  # fmt: skip
    args = parser.parse_args(argv)
    global scale_config, sharded_config
    scale_config = ScaleConfig(**{n: getattr(args, f"scale_{n}") for n in vars(ScaleConfig())})
    sharded_config = ShardedConfig(
        **{n: getattr(args, f"sharded_{n}") for n in vars(ShardedConfig())}
    )
    torch.manual_seed(0)
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "quick": args.quick,
        "scale": vars(QUICK_SCALE if args.quick else scale_config),
        "sharded": vars(QUICK_SHARDED if args.quick else sharded_config),
    }
    rows: list[Row] = []
    for name in args.only or SECTIONS:
        print(f"[bench] {name} ...", flush=True)
        rows.extend(SECTIONS[name](args.quick))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    text = table(rows)
    header = ", ".join(f"{k} {v}" for k, v in env.items())
    (out / "bench.md").write_text(f"{header}\n\n{text}\n")
    payload = {
        "env": env,
        "rows": [asdict(r) | {"ratio": r.ratio, "metric": r.metric} for r in rows],
    }
    (out / "bench.json").write_text(json.dumps(payload, indent=2))
    print(header)
    print(text)
    for r in rows:
        if r.extra:
            print(f"\n{r.name}: {json.dumps(r.extra, indent=1)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
