"""``isolate certify`` against one sequential read of both files of a synthetic bf16
checkpoint pair, its peak resident memory, and five planted corruptions, in one run.

Its size is set by ``--certify-*`` (:class:`CertifyConfig`; the default is a 0.5B-parameter
pair, 1 GB per file; ``--certify-params 3000000000`` is the issue's 3B target, about 6 GB
per file). The pair is written to a temporary folder (``TMPDIR``), removed afterwards.

How it is measured:

* The pair: safetensors files of bf16 ``(rows, 4096)`` tensors of ``tensor_mb`` MiB each,
  written one tensor at a time; the spec freezes every tensor but the last ``trainable``,
  which the tuned file moves. The large pair must be certified clean.
* Time, page cache warm, in a fresh process: both files are read once before anything is
  timed (the pair must fit in memory; the rows record the machine's memory and, by
  ``mincore``, the fraction of the pair's pages in the page cache before and after the
  timings). Then the sequential read of both files (``readinto`` an 8 MiB buffer, one
  thread) and ``certify`` (files hashed, XXH3) run back to back in alternating order,
  ``repeat`` pairs after one warm-up pair; the ratio is the geometric mean of the per-pair
  ratios. CPU time (all threads) is recorded beside it, and the 1-minute load average
  before and after: certify reads the two files on two threads, so on a machine busy with
  other work its wall-clock time follows its CPU time. ``certify`` without the files'
  hashes is timed the same way, for reference.
* The floor, timed the same way against the read and against certify: what certify's
  answer costs with no isolate code at all. Two threads, one per file, each reads its file
  into one buffer of a piece (256 KiB) and feeds every piece to two XXH3-128 hashers (the
  file's own hash and the tensor's fingerprint, the two hashes a byte needs).
* The same, page cache cold: before each timed run, both files leave the page cache
  (``POSIX_FADV_DONTNEED`` on the pair's own files: no root needed, nothing else dropped;
  the fraction left cached is recorded), so both sides read from the disk.
* Memory, in the same process before the timings: the kernel's peak resident set
  (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the resident set before one
  certify; it counts the file pages certify maps while they are mapped. The peak of
  anonymous memory (``RssAnon``, sampled every 2 ms) is recorded beside it.
* Corruptions (:mod:`~experiments.bench.corruptions`): five small pairs, each certified clean
  as saved and failing on exactly the planted key once corrupted.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from experiments.bench._rows import Row
from experiments.bench._timing import (
    PeakResident,
    alternating,
    geometric_mean_ratio,
    paired,
    resident_bytes,
)
from experiments.bench.corruptions import plant_all
from isolate.certificates.streaming import PIECE

__all__ = [
    "QUICK_CERTIFY",
    "CertifyConfig",
    "cached_fraction",
    "drop_cached",
    "make_pair",
    "measure",
    "run",
]

WIDTH = 4096
LAYER = "model.layers.{}.weight"


@dataclass
class CertifyConfig:
    """Sizes of the ``certify`` section (``--certify-*`` options); the default is a pair of
    0.5B bf16 parameters, 1 GB per file."""

    params: int = 500_000_000
    tensor_mb: int = 64
    trainable: int = 2  # the last tensors, moved in the tuned file
    repeat: int = 9


QUICK_CERTIFY = CertifyConfig(params=2_000_000, tensor_mb=1, repeat=2)


def _write_safetensors(
    path: Path, rows: int, count: int, make: Callable[[int], torch.Tensor]
) -> None:
    """A safetensors file of ``count`` bf16 ``(rows, WIDTH)`` tensors made one at a time by
    ``make(index)``, so that memory holds one tensor whatever the file's size."""
    size = rows * WIDTH * 2
    header = {
        LAYER.format(i): {"dtype": "BF16", "shape": [rows, WIDTH],
                          "data_offsets": [i * size, (i + 1) * size]}
        for i in range(count)
    }  # fmt: skip
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for index in range(count):
            f.write(make(index).contiguous().view(torch.uint8).numpy().tobytes())


def make_pair(folder: Path, cfg: CertifyConfig) -> dict[str, Any]:
    """``base.safetensors`` and ``tuned.safetensors`` in ``folder``, and the spec they keep."""
    rows = max(1, cfg.tensor_mb * (1 << 20) // (WIDTH * 2))
    count = max(cfg.trainable + 1, math.ceil(cfg.params / (rows * WIDTH)))
    trained = range(count - cfg.trainable, count)

    def base(i: int) -> torch.Tensor:
        return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(i)).bfloat16()

    def tuned(i: int) -> torch.Tensor:
        return base(i) + 0.01 if i in trained else base(i)

    _write_safetensors(folder / "base.safetensors", rows, count, base)
    _write_safetensors(folder / "tuned.safetensors", rows, count, tuned)
    return {
        "tensors": count,
        "params": count * rows * WIDTH,
        "bytes_per_file": (folder / "base.safetensors").stat().st_size,
        "spec": {"freeze": ["model", *(f"!model.layers.{i}" for i in trained)]},
    }


def _floor(paths: list[Path]) -> None:
    """Every byte of both files read once and hashed twice, a thread per file (see above)."""

    def one(path: Path) -> None:
        view = memoryview(bytearray(PIECE))
        hashers = (xxhash.xxh3_128(), xxhash.xxh3_128())
        with path.open("rb", buffering=0) as f:
            while got := f.readinto(view):
                for hasher in hashers:
                    hasher.update(view[:got])

    threads = [threading.Thread(target=one, args=(path,)) for path in paths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _read(paths: list[Path]) -> None:
    view = memoryview(bytearray(8 << 20))
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while f.readinto(view):
                pass


def cached_fraction(paths: list[Path]) -> float | None:
    """The fraction of the files' pages in the page cache (Linux ``mincore``), else None."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    pages = cached = 0
    for path in paths:
        with path.open("rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable: an address
        try:
            count = (len(mapped) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            flags = (ctypes.c_ubyte * count)()
            start = ctypes.addressof(ctypes.c_char.from_buffer(mapped))  # the view goes at once
            if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(len(mapped)), flags) != 0:
                return None
            pages += count
            cached += sum(1 for flag in bytes(flags) if flag & 1)
        finally:
            mapped.close()
    return cached / pages if pages else None


def drop_cached(paths: list[Path]) -> None:
    """Evict these files' clean pages from the page cache (``POSIX_FADV_DONTNEED``: no root
    needed, and nothing else is dropped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cold(fn: Callable[[], object], paths: list[Path]) -> Callable[[], float]:
    """``fn`` timed right after the files left the page cache."""

    def run() -> float:
        drop_cached(paths)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _memory(paths: list[Path], spec: dict[str, Any]) -> dict[str, Any]:
    """One certify: its peak resident memory over the start, and its peak anonymous memory."""
    from isolate.certificates import certify

    anon_before, peak_anon, done = _status("RssAnon"), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    before = resident_bytes()
    sampler.start()
    with PeakResident() as peak:
        cert = certify(*paths, spec=spec)
    done.set()
    sampler.join()
    return {
        "peak MB": (peak.peak - before) / 2**20,
        "anonymous peak MB": (max(peak_anon[0], _status("RssAnon")) - anon_before) / 2**20,
        "large pair clean": cert.clean,
        "verdicts": len(cert.verdicts),
    }


def _cpu_timed(fn: Callable[[], object], bucket: list[float]) -> Callable[[], None]:
    def run() -> None:
        start = time.process_time()  # every thread of the process
        fn()
        bucket.append(time.process_time() - start)

    return run


def measure(folder: Path, spec: dict[str, Any], repeat: int) -> dict[str, Any]:
    """In a fresh process: memory first (one certify), then the timings, cache warm."""
    from isolate.certificates import certify

    paths = [folder / "base.safetensors", folder / "tuned.safetensors"]
    _read(paths)  # warm the page cache: both sides are timed on warm pages
    warm = cached_fraction(paths)
    memory = _memory(paths, spec)
    load_before = os.getloadavg()[0]
    out: dict[str, Any] = {**memory}
    for name, kind in (("certify", "xxh3"), ("certify without file hashes", "none")):
        cpu: dict[str, list[float]] = {"certify": [], "read": []}

        def certifying(kind: Any = kind) -> object:
            return certify(*paths, spec=spec, file_hash=kind)

        c, b, ratio = paired(
            _cpu_timed(certifying, cpu["certify"]),
            _cpu_timed(lambda: _read(paths), cpu["read"]),
            warmup=1,
            repeat=repeat,
        )
        out[name] = {
            "seconds": c,
            "read seconds": b,
            "ratio": ratio,
            "cpu ratio": statistics.median(cpu["certify"]) / statistics.median(cpu["read"]),
        }
    floor, b, ratio = paired(lambda: _floor(paths), lambda: _read(paths), warmup=1, repeat=repeat)
    c, f, over = paired(lambda: certify(*paths, spec=spec), lambda: _floor(paths), warmup=1,
                        repeat=repeat)  # fmt: skip
    out["floor"] = {
        "seconds": floor,
        "read seconds": b,
        "ratio": ratio,
        "certify seconds": c,
        "floor seconds": f,
        "certify over floor": over,
    }
    out["cached"] = [warm, cached_fraction(paths)]
    cold_c, cold_b = alternating(
        _cold(lambda: certify(*paths, spec=spec), paths), _cold(lambda: _read(paths), paths), repeat
    )
    drop_cached(paths)
    out["cold"] = {
        "seconds": statistics.median(cold_c),
        "read seconds": statistics.median(cold_b),
        "ratio": geometric_mean_ratio(cold_c, cold_b),
        "cached after a drop": cached_fraction(paths),
    }
    out["load average"] = [load_before, os.getloadavg()[0]]
    out["threads"] = torch.get_num_threads()
    return out


def _child(folder: Path, pair: dict[str, Any], repeat: int) -> dict[str, Any]:
    """:func:`measure` in a fresh interpreter (its memory starts clean), from this checkout."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    (folder / "job.json").write_text(json.dumps({"spec": pair["spec"], "repeat": repeat}))
    command = [sys.executable, "-m", "experiments.bench.certify", str(folder)]
    subprocess.run(command, check=True, cwd=root, env=env)
    result: dict[str, Any] = json.loads((folder / "result.json").read_text())
    return result


def _memory_total() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        return float("nan")


def run(cfg: CertifyConfig) -> list[Row]:
    """Generate the pair, measure in a fresh process, plant the corruptions: the rows."""
    folder = Path(tempfile.mkdtemp(prefix="isolate-certify-bench-"))
    try:
        start = time.perf_counter()
        pair = make_pair(folder, cfg)
        generated = time.perf_counter() - start
        measured = _child(folder, pair, cfg.repeat)
        (folder / "small").mkdir()
        planted = plant_all(folder / "small")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    gb, params = pair["bytes_per_file"] / 1e9, pair["params"]
    size = f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"
    label = f"{size} bf16 parameters, {gb:.3g} GB per file"
    hashed, bare = measured["certify"], measured["certify without file hashes"]
    cold, floor = measured["cold"], measured["floor"]
    extra = {
        "cpu ratio (all threads)": hashed["cpu ratio"],
        "without file hashes: ratio": bare["ratio"],
        "load average (1 min) before, after": measured["load average"],
        "page cache": f"warm for both sides (each file read once before timing; pair "
        f"{2 * gb:.3g} GB, machine {_memory_total():.3g} GB)",
        "fraction of the pair in the page cache, before and after the timings": measured["cached"],
        "large pair clean": measured["large pair clean"],
        "tensors per file": pair["tensors"],
        "generate seconds": generated,
    }
    missed = [p.name for p in planted if not p.caught]
    return [
        Row(f"certify vs one sequential read of both files, {label}, page cache warm",
            "isolate.certify (XXH3 file hashes)", "sequential read of both files",
            hashed["seconds"], hashed["read seconds"], "<= 1.2", False, extra,
            paired_ratio=hashed["ratio"], limit=1.2),
        Row(f"certify without the files' hashes vs one sequential read, {label}",
            "isolate.certify(file_hash='none')", "sequential read of both files",
            bare["seconds"], bare["read seconds"], "(measured)", None,
            {"cpu ratio (all threads)": bare["cpu ratio"]}, paired_ratio=bare["ratio"]),
        Row(f"the floor (two threads, every byte read once and XXH3-hashed twice, no isolate "
            f"code) vs one sequential read of both files, {label}, page cache warm",
            "read + 2 x XXH3-128, a thread per file", "sequential read of both files",
            floor["seconds"], floor["read seconds"], "(measured)", None,
            {"certify over the floor (paired)": floor["certify over floor"],
             "certify seconds, floor seconds (paired)": [floor["certify seconds"],
                                                         floor["floor seconds"]]},
            paired_ratio=floor["ratio"]),
        Row(f"certify vs one sequential read of both files, {label}, page cache cold",
            "isolate.certify (XXH3 file hashes)", "sequential read of both files",
            cold["seconds"], cold["read seconds"], "<= 1.2", False,
            {"fraction of the pair in the page cache after a drop": cold["cached after a drop"]},
            paired_ratio=cold["ratio"], limit=1.2),
        Row(f"certify peak resident memory over its start, {label}", "isolate.certify",
            "one file", max(1.0, measured["peak MB"] * 2**20), pair["bytes_per_file"],
            "<= 100 MB", False, {"peak MB": measured["peak MB"],
                                 "anonymous peak MB": measured["anonymous peak MB"]},
            limit=100.0, metric_name="peak MB", unit="bytes"),
        Row("planted corruptions missed, of 5 (base row, tie, merge scale, stale shard, "
            "buffer), each pair also certified clean as saved; and the large pair not clean",
            "certify the corrupted pairs", "certify the pairs as saved",
            sum(p.seconds_corrupted for p in planted), sum(p.seconds_clean for p in planted),
            "missed <= 0", False,
            {"missed": len(missed) + (not measured["large pair clean"]), "missed names": missed,
             "caught": f"{len(planted) - len(missed)} of {len(planted)}",
             "corruptions": [asdict(p) | {"caught": p.caught} for p in planted]},
            limit=0.0, metric_name="missed"),
    ]  # fmt: skip


if __name__ == "__main__":  # the fresh process of _child
    job_folder = Path(sys.argv[1])
    job = json.loads((job_folder / "job.json").read_text())
    result = measure(job_folder, job["spec"], job["repeat"])
    (job_folder / "result.json").write_text(json.dumps(result))
