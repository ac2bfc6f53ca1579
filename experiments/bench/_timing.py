"""The timing harness and the memory probes every section shares.

Every figure is the median of interleaved repeats (A, B, A, B, ...) after warm-up, so slow
phases of a shared machine hit both sides alike; where the two sides of a pair run back to
back, the ratio is the geometric mean of the per-pair ratios.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "PeakResident",
    "alternating",
    "geometric_mean_ratio",
    "median",
    "median_pair",
    "paired",
    "resident_bytes",
    "return_freed_memory",
    "saved_bytes",
    "settle",
]


def alternating(
    candidate: Callable[[], float], baseline: Callable[[], float], repeat: int
) -> tuple[list[float], list[float]]:
    """``repeat`` pairs of measurements, each side's call returning its own number; which side
    goes first alternates, so neither always runs on a warmer cache."""
    times_c: list[float] = []
    times_b: list[float] = []
    for i in range(repeat):
        order = [(candidate, times_c), (baseline, times_b)]
        for fn, bucket in order if i % 2 == 0 else reversed(order):
            bucket.append(fn())
    return times_c, times_b


def geometric_mean_ratio(candidate: list[float], baseline: list[float]) -> float:
    """The geometric mean of the per-pair ratios ``candidate[i] / baseline[i]``.

    Which member of a pair runs first alternates, and the first one tends to run on colder
    caches: the geometric mean over an even number of pairs cancels that order effect, where
    a median of the (two-humped) ratios would land on either hump.
    """
    ratios = [c / b for c, b in zip(candidate, baseline, strict=True)]
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def _timed(fn: Callable[[], object], collect: bool) -> Callable[[], float]:
    def run() -> float:
        if collect:
            gc.collect()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def paired(
    candidate: Callable[[], object],
    baseline: Callable[[], object],
    *,
    warmup: int,
    repeat: int,
    collect: bool = True,
) -> tuple[float, float, float]:
    """Medians of both sides and the geometric mean of the ratios of back-to-back pairs: a
    slow phase of a shared machine hits both members of a pair, so the per-pair ratio cancels
    it."""
    for _ in range(warmup):
        candidate()
        baseline()
    times_c, times_b = alternating(_timed(candidate, collect), _timed(baseline, collect), repeat)
    ratio = geometric_mean_ratio(times_c, times_b)
    return statistics.median(times_c), statistics.median(times_b), ratio


def median_pair(
    candidate: Callable[[], object],
    baseline: Callable[[], object],
    *,
    warmup: int,
    repeat: int,
    collect: bool = True,
) -> tuple[float, float]:
    """The medians of :func:`paired`, without the ratio."""
    c, b, _ = paired(candidate, baseline, warmup=warmup, repeat=repeat, collect=collect)
    return c, b


def median(fn: Callable[[], object], *, warmup: int, repeat: int) -> float:
    """The median time of ``fn`` over ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def saved_bytes(fn: Callable[[], object]) -> int:
    """The bytes of the tensors autograd saves for backward while ``fn`` runs."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


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
    a sample every millisecond (which can miss a short peak on a busy machine); ``kernel``
    says which."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.kernel = False

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
            self.kernel = True
        except OSError:
            self.kernel = False
        self.peak = resident_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())
        if self.kernel:
            self.peak = max(self.peak, self._high_water())


def return_freed_memory() -> None:
    """Make glibc hand every block of 128 KiB or more back to the system when it is freed, so
    that resident memory tracks live tensors (by default, freed blocks below a threshold that
    grows up to 32 MiB stay resident and a later run reuses them unseen)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def settle() -> int:
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
