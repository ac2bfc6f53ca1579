"""The checks on a large model: fingerprints against one read of the weights, the callback's
verification and the graph walk against a training step, ``gradient_report``'s peak memory,
the wrappers' cost per call, and applying and resolving selections against bare loops.

Its size is set by ``--scale-*`` (:class:`ScaleConfig`; the default is a 302M-parameter
transformer encoder, 1.2 GB in fp32).
"""

from __future__ import annotations

import fnmatch
import gc
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import isolate
from experiments.bench._rows import Row
from experiments.bench._timing import (
    PeakResident,
    median_pair,
    paired,
    resident_bytes,
    return_freed_memory,
    settle,
)
from experiments.bench.networks import ReverseByHand, transformer
from isolate.fingerprints import Scheme, fingerprints
from isolate.freezing import FreezeHandle, is_frozen
from isolate.gradients import gradient_report
from isolate.reachability import reachable_parameters

__all__ = [
    "QUICK_SCALE",
    "ScaleConfig",
    "callback_verification",
    "device_scheme",
    "read_weights",
    "run",
]


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


def _fingerprint_times(model: nn.Module, cfg: ScaleConfig, label: str) -> list[Row]:
    read = read_weights(model)
    tiny = cfg.repeat < 3  # a test run: no garbage collection between timings
    c, b, ratio = paired(
        lambda: isolate.snapshot(model, drift="fingerprint"),
        read,
        warmup=1,
        repeat=cfg.repeat,
        collect=not tiny,
    )
    rows = [Row(f"fingerprint snapshot, {label}", "snapshot(drift='fingerprint')",
                "one read of the weights (sum)", c, b, "<= 1.5", False, paired_ratio=ratio,
                limit=1.5)]  # fmt: skip
    snap = isolate.snapshot(model, drift="fingerprint")
    c, b, ratio = paired(snap.assert_unchanged, read, warmup=1, repeat=cfg.repeat, collect=not tiny)
    # For reference, in the same run: the accelerator scheme, run on this CPU.
    dev_c, _, dev_ratio = paired(
        device_scheme(model), read, warmup=1, repeat=cfg.repeat, collect=not tiny
    )
    rows.append(Row(f"fingerprint check, {label}", "assert_unchanged()",
                    "one read of the weights (sum)", c, b, "<= 1.5", False,
                    {"device scheme on this CPU / one read": dev_ratio,
                     "device scheme on this CPU (ms)": 1e3 * dev_c},
                    paired_ratio=ratio, limit=1.5))  # fmt: skip
    del snap
    gc.collect()
    return rows


def _fingerprint_memory(model: nn.Module, label: str) -> Row:
    params = sum(p.numel() for p in model.parameters())
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    before = resident_bytes()
    snap = isolate.snapshot(model, drift="fingerprint")
    extra = max(resident_bytes() - before, 0)
    del snap
    gc.collect()
    before = resident_bytes()
    copied = isolate.snapshot(model)  # for scale: what a copy costs
    copy_extra = resident_bytes() - before
    del copied
    gc.collect()
    return Row(f"fingerprint snapshot extra resident memory, {label}",
               "snapshot(drift='fingerprint')", "model size", max(extra, 1), size, "<= 1 MB", False,
               {"extra MB": extra / 2**20, "model MB": size / 2**20,
                "snapshot(drift='copy') extra MB": copy_extra / 2**20, "parameters": params},
               limit=1.0, metric_name="extra MB", unit="bytes")  # fmt: skip


def _freeze_first_half(model: nn.Module) -> list[str]:
    """Freeze the first half of the encoder layers; returns their parameters' names."""
    blocks = model.layers  # type: ignore[union-attr]
    frozen_modules = list(blocks)[: len(blocks) // 2]
    frozen = [
        name
        for name, p in model.named_parameters()
        if any(p is q for m in frozen_modules for q in m.parameters())
    ]
    for m in frozen_modules:
        m.requires_grad_(False)
    return frozen


def _training(model: nn.Module, cfg: ScaleConfig, label: str) -> list[Row]:
    """The callback's check against a training step of the same model, half of it frozen."""
    frozen = _freeze_first_half(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1e-4)
    x = torch.randn(cfg.batch, cfg.tokens, cfg.width)
    verify = callback_verification(model, frozen)
    times: dict[str, list[float]] = {"step": [], "check": [], "walk": [], "backward": []}

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    try:
        for i in range(cfg.repeat + 1):  # the first round warms up
            round_times = {"step": timed(step)}
            loss = model(x).square().mean()
            round_times["check"] = timed(lambda: verify(loss))  # noqa: B023
            round_times["walk"] = timed(lambda: reachable_parameters(loss, model))  # noqa: B023
            round_times["backward"] = timed(loss.backward)
            optimizer.zero_grad(set_to_none=True)
            if i:
                for key, seconds in round_times.items():
                    times[key].append(seconds)
    finally:
        model.requires_grad_(True)
    step_s, check_s = statistics.median(times["step"]), statistics.median(times["check"])
    every = cfg.check_every
    return [
        Row(f"callback verification vs training step, {label}, checks every {every} steps "
            "(amortised)", "handle.verify (drift, reach, flags)",
            f"{every} training steps", check_s, every * step_s, "<= 0.01", False,
            {"check / one step": check_s / step_s, "frozen tensors": len(frozen)},
            limit=0.01),
        Row(f"reachable_parameters vs one backward, {label}", "graph walk", "one backward pass",
            statistics.median(times["walk"]), statistics.median(times["backward"]), "<= 0.02",
            False, limit=0.02),
    ]  # fmt: skip


def _report_memory(cfg: ScaleConfig) -> list[Row]:
    """gradient_report's peak memory against K plain backward passes over the same graph."""
    return_freed_memory()
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
            base = settle()
            with PeakResident() as peak:
                fn()
            peaks[name].append(max(peak.peak - base, 1))
    c, b = statistics.median(peaks["report"]), statistics.median(peaks["by hand"])
    n = sum(p.numel() for p in params)
    return [Row(f"gradient_report peak extra memory, K=4 losses, {n / 1e6:.0f}M-parameter "
                "transformer", "gradient_report", "K autograd.grad passes", c, b, "(measured)",
                None, {"parameters": n}, unit="bytes")]  # fmt: skip


def _wrapper_overheads(cfg: ScaleConfig) -> list[Row]:
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
        "GradientScale(-1)": (lambda f: side(reverse(f)), lambda f: side(ReverseByHand.apply(f))),
    }
    rows = []
    try:
        for name, (wrapped, by_hand) in pairs.items():
            c, b = median_pair(
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


def _blocks(count: int) -> nn.Module:
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(count))  # type: ignore[assignment]
    return model


def _resolved_freeze(cfg: ScaleConfig) -> list[Row]:
    """Applying and restoring an already resolved selection against the bare flag loop:
    freezing a trainable model, and thawing a frozen one (what a thaw step does)."""
    model = _blocks(100 if cfg.repeat < 3 else 5000)  # two tensors per layer
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

        c, b, ratio = paired(
            apply_restore, by_hand, warmup=2, repeat=6 if tiny else 30, collect=not tiny
        )
        what = "thaw" if thaw else "apply"
        rows.append(Row(f"{what} + restore of a resolved selection, {len(tensors)} tensors",
                        "FreezeHandle(...).restore()", "bare requires_grad loop", c, b, "<= 1.5",
                        False, paired_ratio=ratio, limit=1.5))  # fmt: skip
    model.requires_grad_(True)
    return rows


def _resolution(cfg: ScaleConfig) -> list[Row]:
    """Resolving glob selectors from scratch against the least any resolver does: one
    ``named_parameters()`` walk and ``fnmatch`` over the names. ``is_frozen`` is the public
    way to resolve selectors without changing anything (its read of the flags stops at the
    first trainable tensor)."""
    count = 100 if cfg.repeat < 3 else 5000  # two tensors per layer
    model = _blocks(count)
    selectors = ("blocks.*.weight", "blocks.*.bias")

    def resolve() -> None:
        is_frozen(model, *selectors)

    def walk_and_match() -> None:
        patterns = [re.compile(fnmatch.translate(s)) for s in selectors]
        names = [name for name, _ in model.named_parameters()]
        [name for name in names if any(p.match(name) for p in patterns)]

    tiny = cfg.repeat < 3
    c, b, ratio = paired(
        resolve, walk_and_match, warmup=2, repeat=6 if tiny else 30, collect=not tiny
    )
    return [Row(f"resolving 2 glob selectors from scratch, {2 * count} tensors", "is_frozen()",
                "named_parameters() walk + fnmatch", c, b, "<= 1.0", False,
                paired_ratio=ratio, limit=1.0)]  # fmt: skip


def run(cfg: ScaleConfig) -> list[Row]:
    """Every row of the section, on models of ``cfg``'s sizes."""
    return_freed_memory()
    model = transformer(cfg.layers, cfg.width, cfg.heads)
    params = sum(p.numel() for p in model.parameters())
    label = f"{params / 1e6:.0f}M-parameter transformer ({cfg.layers}x{cfg.width})"
    rows = _fingerprint_times(model, cfg, label)
    rows.append(_fingerprint_memory(model, label))
    rows += _training(model, cfg, label)
    del model
    gc.collect()
    rows += _report_memory(cfg)
    rows += _wrapper_overheads(cfg)
    rows += _resolved_freeze(cfg)
    rows += _resolution(cfg)
    return rows
