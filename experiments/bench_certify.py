"""Benchmark of ``isolate certify``: its time against one sequential read of both files, its
peak resident memory, and the five planted corruptions, all measured in one run.

Run ``python -m experiments.bench_certify`` (``--params 3e9`` for the full target: a 3B
parameter bf16 pair of about 6 GB each; the default, 5e8, takes a few minutes on 2 cores).

What is measured, and how:

* The pair is generated into a temporary folder (not the repo): safetensors files of bf16
  tensors of ``--tensor-mb`` each, written one tensor at a time. The spec freezes every
  layer but the last ``--trainable`` ones, which the tuned file moves.
* Time: the page cache cannot be dropped without root, so both files are first read once
  to warm it; then a sequential read of both files (``readinto`` an 8 MiB buffer, one
  thread) and ``certify`` are timed alternately (read, certify, read, certify, ...) and
  each figure is the median of ``--repeats``. ``ratio`` is certify / read in wall-clock
  time; ``cpu_ratio`` the same in CPU time summed over threads (certify reads the two
  files on two threads: on a busy machine its wall-clock time follows its CPU time). The
  1-minute load average is recorded with them. Certify runs twice per repeat: with the
  files' XXH3 hashes (the default) and without (``--hash none``).
* Memory: in a fresh process, after imports: ``VmHWM`` (the kernel's peak resident set,
  reset through ``/proc/self/clear_refs``) minus ``VmRSS`` before certify, and the peak of
  ``RssAnon`` (anonymous memory, sampled every 2 ms) minus its value before. ``VmHWM``
  counts the mapped file pages certify touches while they are mapped; ``RssAnon`` does not.
* Corruptions: five small pairs, one per planted corruption (one base row changed, a tie
  broken, a merge scale off by alpha/r, a stale shard, a drifted buffer); each is caught
  when the certificate fails on exactly the planted key with the expected finding. The
  large pair itself must be certified clean.

Results are printed and written as JSON to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

WIDTH = 4096
LAYER = "model.layers.{}.weight"


# --------------------------------------------------------------------------------------------
# the synthetic pair


def _write_safetensors(path: Path, tensors: list[tuple[str, int]], make: Any) -> None:
    """A safetensors file of bf16 ``(rows, WIDTH)`` tensors, produced one at a time by
    ``make(index)``, so that memory holds one tensor whatever the file's size."""
    header: dict[str, Any] = {}
    offset = 0
    for name, rows in tensors:
        size = rows * WIDTH * 2
        header[name] = {
            "dtype": "BF16",
            "shape": [rows, WIDTH],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for index in range(len(tensors)):
            f.write(make(index).contiguous().view(torch.uint8).numpy().tobytes())


def make_pair(folder: Path, params: float, tensor_mb: int, trainable: int) -> dict[str, Any]:
    rows = max(1, tensor_mb * (1 << 20) // (WIDTH * 2))
    count = max(trainable + 1, math.ceil(params / (rows * WIDTH)))
    tensors = [(LAYER.format(i), rows) for i in range(count)]

    def base(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randn(rows, WIDTH, generator=g).bfloat16()

    def tuned(i: int) -> torch.Tensor:
        t = base(i)
        return t + 0.01 if i >= count - trainable else t

    _write_safetensors(folder / "base.safetensors", tensors, base)
    _write_safetensors(folder / "tuned.safetensors", tensors, tuned)
    frozen = ["model", *(f"!model.layers.{i}" for i in range(count - trainable, count))]
    return {
        "tensors": count,
        "params": count * rows * WIDTH,
        "bytes_per_file": (folder / "base.safetensors").stat().st_size,
        "spec": {"freeze": frozen},
    }


# --------------------------------------------------------------------------------------------
# the timed child: read vs certify, and memory


def _read(paths: list[Path]) -> None:
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while f.readinto(view):
                pass


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(folder: Path, spec: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Run in a fresh process: memory first (one certify), then the timings."""
    import threading

    from isolate.certificates import certify

    paths = [folder / "base.safetensors", folder / "tuned.safetensors"]
    _read(paths)  # warm the page cache
    anon_before, peak_anon, done = _status("RssAnon"), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
            time.sleep(0.002)

    rss_before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cert = certify(*paths, spec=spec)
    done.set()
    sampler.join()
    memory = {
        "peak_rss_delta_mb": (_status("VmHWM") - rss_before) / 2**20,
        "peak_anon_delta_mb": (max(peak_anon[0], _status("RssAnon")) - anon_before) / 2**20,
        "clean": cert.clean,
        "verdicts": len(cert.verdicts),
    }
    times: dict[str, list[float]] = {"read": [], "certify": [], "certify_no_hash": []}
    cpu: dict[str, list[float]] = {name: [] for name in times}
    for _ in range(repeats):
        for name, run in (
            ("read", lambda: _read(paths)),
            ("certify", lambda: certify(*paths, spec=spec)),
            ("certify_no_hash", lambda: certify(*paths, spec=spec, file_hash="none")),
        ):
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)  # all threads of the process
    medians = {name: statistics.median(values) for name, values in times.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
    return {
        **memory,
        "seconds": medians,
        "all_seconds": times,
        "cpu_seconds": cpu_medians,
        "ratio": medians["certify"] / medians["read"],
        "ratio_no_hash": medians["certify_no_hash"] / medians["read"],
        "cpu_ratio": cpu_medians["certify"] / cpu_medians["read"],
        "load_average": os.getloadavg()[0],
        "threads": torch.get_num_threads(),
    }


# --------------------------------------------------------------------------------------------
# the five planted corruptions


def _small() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": torch.randn(10, 6, generator=g),
        "trunk.0.weight": torch.randn(6, 6, generator=g),
        "trunk.1.running_mean": torch.randn(6, generator=g),
        "head.weight": torch.randn(3, 6, generator=g),
    }
    state["out.weight"] = state["embed.weight"].clone()
    return state


def _trained(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in state.items()}
    out["head.weight"] += 0.25
    out["embed.weight"] -= 0.125
    out["out.weight"] = out["embed.weight"].clone()
    return out


def _dcp(state: dict[str, torch.Tensor], path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": state}, storage_writer=FileSystemWriter(path, single_file_per_rank=False)
        )


def _failures(cert: Any) -> list[tuple[str, str]]:
    return [(v.key, v.finding) for v in cert.failures]


def _planted_in_state_dicts(folder: Path) -> dict[str, list[tuple[str, str]]]:
    """A base row changed, a tie broken, a drifted buffer: torch.save pairs."""
    from isolate.certificates import certify

    out = {}
    for name, plant in (
        ("base row changed", lambda t: t["trunk.0.weight"][3].add_(1e-6)),
        ("tie broken", lambda t: t["out.weight"].add_(0.5)),
        ("drifted buffer", lambda t: t["trunk.1.running_mean"][2].add_(0.01)),
    ):
        tuned = _trained(_small())
        plant(tuned)
        torch.save(_small(), folder / "base.pt")
        torch.save(tuned, folder / "tuned.pt")
        cert = certify(folder / "base.pt", folder / "tuned.pt", spec={"freeze": ["trunk"]})
        out[name] = _failures(cert)
    return out


def _stale_shard(folder: Path) -> list[tuple[str, str]]:
    """The shard holding a trained tensor, left from the base checkpoint."""
    from isolate.certificates import certify
    from isolate.certificates.dcp_folder import DcpCheckpoint

    _dcp(_small(), folder / "dcp-base")
    _dcp(_trained(_small()), folder / "dcp-tuned")
    with DcpCheckpoint(folder / "dcp-tuned") as reader:
        shard = reader.sources("head.weight")[0].file
    shutil.copy(folder / "dcp-base" / shard, folder / "dcp-tuned" / shard)
    cert = certify(folder / "dcp-base", folder / "dcp-tuned", spec={"freeze": ["trunk"]})
    return _failures(cert)


def _merge_scale_off(folder: Path) -> list[tuple[str, str]]:
    """A LoRA merged without its scale lora_alpha / r (= 2)."""
    from safetensors.torch import save_file

    from isolate.certificates import certify

    g = torch.Generator().manual_seed(1)
    base = {"q.weight": torch.randn(16, 8, generator=g).bfloat16()}
    base["k.weight"] = torch.randn(16, 8, generator=g).bfloat16()
    a = (0.3 * torch.randn(4, 8, generator=g)).bfloat16()
    b = (0.3 * torch.randn(16, 4, generator=g)).bfloat16()
    adapter = {"base_model.model.q.lora_A.weight": a, "base_model.model.q.lora_B.weight": b}
    merged = {**base, "q.weight": base["q.weight"] + (b @ a) * 1.0}
    save_file(base, str(folder / "lora-base.safetensors"))
    save_file(merged, str(folder / "lora-merged.safetensors"))
    save_file(adapter, str(folder / "adapter_model.safetensors"))
    cert = certify(
        folder / "lora-base.safetensors",
        folder / "lora-merged.safetensors",
        adapter_config={"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q"]},
        adapter=folder / "adapter_model.safetensors",
    )
    return _failures(cert)


def corruptions(folder: Path) -> dict[str, Any]:
    """Plant each corruption in a small pair; caught = the certificate fails on exactly the
    planted key, with the expected finding."""
    expected = {
        "base row changed": [("trunk.0.weight", "changed")],
        "tie broken": [("embed.weight = out.weight", "tie broken")],
        "drifted buffer": [("trunk.1.running_mean", "changed")],
        "stale shard": [("head.weight", "did not move")],
        "merge scale off by alpha/r": [("q.weight", "merge off")],
    }
    found = {
        **_planted_in_state_dicts(folder),
        "stale shard": _stale_shard(folder),
        "merge scale off by alpha/r": _merge_scale_off(folder),
    }
    return {k: {"caught": found[k] == v, "failures": found[k]} for k, v in expected.items()}


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--params", type=float, default=5e8, help="parameters per checkpoint (3e9: the full target)"
    )
    parser.add_argument("--tensor-mb", type=int, default=64, help="size of each tensor in MiB")
    parser.add_argument(
        "--trainable", type=int, default=2, help="how many tensors (the last) the run trains"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repeats (the median is reported)"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to generate the pair (default: a temporary folder)",
    )
    parser.add_argument(
        "--output", type=Path, default=Path("outputs/bench/certify.json"), help="JSON results"
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:  # the fresh process that measures
        job = json.loads((args.child / "job.json").read_text())
        result = child(args.child, job["spec"], job["repeats"])
        (args.child / "result.json").write_text(json.dumps(result))
        return 0
    report = run(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    show(report)
    print(f"written to {args.output}")
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Generate the pair, measure in a fresh process, plant the corruptions; the report."""
    folder = Path(tempfile.mkdtemp(prefix="certify-bench-", dir=args.dir))
    try:
        start = time.perf_counter()
        pair = make_pair(folder, args.params, args.tensor_mb, args.trainable)
        generated = time.perf_counter() - start
        (folder / "job.json").write_text(
            json.dumps({"spec": pair["spec"], "repeats": args.repeats})
        )
        subprocess.run(
            [sys.executable, "-m", "experiments.bench_certify", "--child", str(folder)], check=True
        )
        measured = json.loads((folder / "result.json").read_text())
        (folder / "small").mkdir()
        planted = corruptions(folder / "small")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    caught = sum(r["caught"] for r in planted.values())
    return {
        "pair": {k: v for k, v in pair.items() if k != "spec"},
        "generate_seconds": generated,
        **measured,
        "corruptions": planted,
        "caught": f"{caught} of {len(planted)}",
        "targets": {
            "ratio <= 1.2": measured["ratio"] <= 1.2,
            "peak_rss_delta_mb <= 100": measured["peak_rss_delta_mb"] <= 100,
            "5 of 5 caught": caught == 5,
            "large pair clean": measured["clean"],
        },
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }


def show(report: dict[str, Any]) -> None:
    pair, s = report["pair"], report["seconds"]
    gb = pair["bytes_per_file"] / 1e9
    size = f"{pair['params'] / 1e9:.2f}B bf16 params, {pair['tensors']} tensors"
    print(f"pair: {size}, {gb:.2f} GB per file")
    load = report["load_average"]
    print(f"sequential read of both files: {s['read']:.3f} s (page cache warm; load {load:.1f})")
    print(f"certify, files hashed (xxh3): {s['certify']:.3f} s, ratio {report['ratio']:.2f}")
    print(f"  CPU time (all threads) over the read's: {report['cpu_ratio']:.2f}")
    bare = report["ratio_no_hash"]
    print(f"certify, no file hashes:      {s['certify_no_hash']:.3f} s, ratio {bare:.2f}")
    print(
        f"peak RSS over baseline: {report['peak_rss_delta_mb']:.1f} MB (VmHWM), anonymous "
        f"{report['peak_anon_delta_mb']:.1f} MB"
    )
    print(f"large pair certified clean: {report['clean']}; corruptions caught: {report['caught']}")
    for name, result in report["corruptions"].items():
        print(f"  {'caught' if result['caught'] else 'MISSED'}: {name}: {result['failures']}")
    print(
        "targets: "
        + ", ".join(f"{k}: {'ok' if v else 'MISSED'}" for k, v in report["targets"].items())
    )


if __name__ == "__main__":
    raise SystemExit(main())
