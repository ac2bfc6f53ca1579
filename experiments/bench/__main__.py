"""Benchmarks: what isolation costs and what it saves, each as a ratio against its baseline
measured in the same run.

``python -m experiments.bench [--quick] [--output outputs/bench] [--only SECTION ...]`` (see
:mod:`experiments.bench`).
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from experiments.bench import (
    callback,
    certify,
    contracts,
    freeze,
    frozen,
    imports,
    peft_llama,
    reachability,
    report,
    scale,
    seethrough,
    sharded,
    wrappers,
)
from experiments.bench._rows import Row, table

__all__ = ["SECTIONS", "Settings", "main"]


@dataclass(frozen=True)
class Settings:
    """What the command line asks of the sections: small sizes, and the sizes of those that
    have sizes (already the small ones under ``quick``)."""

    quick: bool
    scale: scale.ScaleConfig
    sharded: sharded.ShardedConfig
    peft: peft_llama.PeftConfig
    seethrough: seethrough.SeethroughConfig
    certify: certify.CertifyConfig
    contracts: contracts.ContractsConfig


SECTIONS: dict[str, Callable[[Settings], list[Row]]] = {
    "wrappers": lambda s: wrappers.run(s.quick),
    "freeze": lambda s: freeze.run(s.quick),
    "reachability": lambda s: reachability.run(s.quick),
    "report": lambda s: report.run(s.quick),
    "frozen": lambda s: frozen.run(s.quick),
    "callback": lambda s: callback.run(s.quick),
    "scale": lambda s: scale.run(s.scale),
    "sharded": lambda s: sharded.run(s.sharded),
    "imports": lambda s: imports.run(s.quick),
    "peft": lambda s: peft_llama.run(s.peft),
    "seethrough": lambda s: seethrough.run(s.seethrough),
    "certify": lambda s: certify.run(s.certify),
    "contracts": lambda s: contracts.run(s.contracts),
}
# section -> (its sizes, the small sizes of --quick)
_SIZED: dict[str, tuple[type, object]] = {
    "scale": (scale.ScaleConfig, scale.QUICK_SCALE),
    "sharded": (sharded.ShardedConfig, sharded.QUICK_SHARDED),
    "peft": (peft_llama.PeftConfig, peft_llama.QUICK_PEFT),
    "seethrough": (seethrough.SeethroughConfig, seethrough.QUICK_SEETHROUGH),
    "certify": (certify.CertifyConfig, certify.QUICK_CERTIFY),
    "contracts": (contracts.ContractsConfig, contracts.QUICK_CONTRACTS),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--output", default="outputs/bench", help="folder for bench.json/md")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="sections to run")
    for section, (config, _) in _SIZED.items():
        for name, default in vars(config()).items():
            parser.add_argument(f"--{section}-{name.replace('_', '-')}", type=int,
                                default=default,
                                help=f"{section} section: {name} (default {default})")  # fmt: skip
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    sizes = {
        section: quick
        if args.quick
        else config(**{n: getattr(args, f"{section}_{n}") for n in vars(config())})
        for section, (config, quick) in _SIZED.items()
    }
    return Settings(args.quick, **sizes)  # type: ignore[arg-type]


def _write(rows: list[Row], env: dict[str, object], out: Path) -> None:
    """``bench.md`` and ``bench.json`` into ``out``, and the table and extras to stdout."""
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


def main(argv: list[str] | None = None) -> int:
    """Run the sections asked for (all by default), print and write the rows; returns 0."""
    args = _parser().parse_args(argv)
    settings = _settings(args)
    torch.manual_seed(0)
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "quick": args.quick,
        **{section: vars(getattr(settings, section)) for section in _SIZED},
    }
    rows: list[Row] = []
    for name in args.only or SECTIONS:
        print(f"[bench] {name} ...", flush=True)
        rows.extend(SECTIONS[name](settings))
    _write(rows, env, Path(args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
