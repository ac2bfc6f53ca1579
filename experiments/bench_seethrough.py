"""What seeing through checkpoints and torch.compile costs, against one backward.

A reentrant checkpoint hides the parameters its segment uses; the audits re-run each segment
once (as backward does) to see them. This measures, on a random-initialised Llama with LoRA
adapters (r=8) behind transformers' ``gradient_checkpointing_enable(use_reentrant=True)`` (the
standard PEFT setup), the walk (``cut_off_parameters``) and a gradient audit
(``gradient_report``) against one forward and one backward of the same step, and the memory
the walk holds while it runs (the activations its re-run segments save) against the
activations a forward without checkpointing saves. A second section does the same under
``torch.compile`` (aot_eager), where the walk reads each region's backward graph once.
Memory: the walk keeps none of what its re-run segments save for backward (it needs only
the graph's structure); ``walk_peak_rss_growth_bytes`` is how far it raises the process's
peak resident memory, next to what a forward without checkpointing saves.

Run ``python -m experiments.bench_seethrough`` (``--quick`` for tiny sizes); needs
``transformers`` and ``peft`` (the ``peft`` extra). Prints a table and writes
``seethrough.json`` to ``--output``. Every time is the median of interleaved repeats
(candidate, baseline, candidate, ...) after warm-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from isolate.cutoff import cut_off_parameters
from isolate.gradients import gradient_report


@dataclass
class Size:
    hidden: int = 256
    layers: int = 4
    vocab: int = 1024
    batch: int = 4
    length: int = 128
    repeat: int = 7


QUICK = Size(hidden=64, layers=2, vocab=128, batch=2, length=32, repeat=3)


@dataclass
class Row:
    name: str
    candidate: str
    baseline: str
    candidate_s: float
    baseline_s: float

    @property
    def ratio(self) -> float:
        return self.candidate_s / self.baseline_s


def _pair(
    candidate: Callable[[], object], baseline: Callable[[], object], repeat: int
) -> tuple[float, float]:
    """Medians of interleaved runs, after one warm-up run of each."""
    candidate()
    baseline()
    times_c, times_b = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        candidate()
        times_c.append(time.perf_counter() - start)
        start = time.perf_counter()
        baseline()
        times_b.append(time.perf_counter() - start)
    return statistics.median(times_c), statistics.median(times_b)


def _llama(size: Size, *, reentrant: bool | None) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.hidden * 8 // 3,
        num_hidden_layers=size.layers,
        num_attention_heads=max(size.hidden // 32, 1),
        max_position_embeddings=size.length,
        use_cache=False,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    if reentrant is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
    logging.getLogger("peft").setLevel(logging.ERROR)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    model.train()
    return model


def _peak_rss_growth(size: Size) -> int:
    """In a fresh process: how far the walk raises the peak resident memory above that of
    the checkpointed forward before it (bytes)."""
    code = (
        "import resource, sys, torch; "
        "from experiments.bench_seethrough import Size, _llama; "
        "from isolate.cutoff import cut_off_parameters; "
        f"size = Size(**{asdict(size)!r}); "
        "torch.manual_seed(0); "
        "ids = torch.randint(0, size.vocab, (size.batch, size.length)); "
        "model = _llama(size, reentrant=True); "
        "loss = model(input_ids=ids, labels=ids).loss; "
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "cut_off_parameters(loss, model); "
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "print((after - before) * 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return int(out.strip().splitlines()[-1])


@contextmanager
def _saved_bytes() -> Iterator[list[int]]:
    """Count the bytes of the tensors autograd saves for backward inside the block."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def _checkpointing(size: Size) -> tuple[list[Row], dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, size.vocab, (size.batch, size.length), generator=generator)
    rows: list[Row] = []
    extra: dict[str, Any] = {}
    for reentrant in (True, False):
        label = "reentrant" if reentrant else "non-reentrant"
        model = _llama(size, reentrant=reentrant)

        def forward(model: nn.Module = model) -> torch.Tensor:
            return model(input_ids=ids, labels=ids).loss

        loss = forward()

        def backward(model: nn.Module = model, loss: torch.Tensor = loss) -> None:
            loss.backward(retain_graph=True)
            model.zero_grad(set_to_none=True)

        def walk(model: nn.Module = model, loss: torch.Tensor = loss) -> None:
            cut = cut_off_parameters(loss, model)
            assert cut.clean, cut

        def report(model: nn.Module = model, loss: torch.Tensor = loss) -> None:
            gradient_report({"loss": loss}, model)

        walk_s, backward_s = _pair(walk, backward, size.repeat)
        rows.append(
            Row(f"walk ({label})", "cut_off_parameters", "one backward", walk_s, backward_s)
        )
        walk_s, forward_s = _pair(walk, forward, size.repeat)
        rows.append(Row(f"walk ({label})", "cut_off_parameters", "one forward", walk_s, forward_s))
        report_s, backward_s = _pair(report, backward, size.repeat)
        rows.append(
            Row(f"gradients ({label})", "gradient_report", "one backward", report_s, backward_s)
        )
        if reentrant:
            with _saved_bytes() as step:
                forward()
            extra["checkpointed_forward_saved_bytes"] = step[0]
    plain = _llama(size, reentrant=None)
    with _saved_bytes() as full:
        plain(input_ids=ids, labels=ids)
    extra["forward_saved_bytes_without_checkpointing"] = full[0]
    extra["walk_peak_rss_growth_bytes"] = _peak_rss_growth(size)
    return rows, extra


class _Stack(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.side = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x + self.side(x).detach()


def _compiled(size: Size) -> list[Row]:
    torch.manual_seed(0)
    model = _Stack(size.hidden, size.layers * 4)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(size.batch * size.length, size.hidden)
    rows = []
    for label, run in (("eager", model), ("compiled", compiled)):
        loss = run(x).pow(2).mean()

        def backward(loss: torch.Tensor = loss) -> None:
            loss.backward(retain_graph=True)
            model.zero_grad(set_to_none=True)

        def walk(loss: torch.Tensor = loss) -> None:
            cut = cut_off_parameters(loss, model)
            assert list(cut.parameters) == ["side.weight", "side.bias"], cut

        walk_s, backward_s = _pair(walk, backward, size.repeat)
        rows.append(
            Row(f"walk ({label})", "cut_off_parameters", "one backward", walk_s, backward_s)
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--output", default="outputs/bench", help="folder for seethrough.json")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else Size()
    rows, extra = _checkpointing(size)
    rows += _compiled(size)
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "size": asdict(size),
    }
    lines = [
        "| row | candidate | baseline | candidate s | baseline s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.candidate} | {r.baseline} | {r.candidate_s:.4f} | "
            f"{r.baseline_s:.4f} | {r.ratio:.3f} |"
        )
    print(json.dumps(env))
    print("\n".join(lines))
    print(json.dumps(extra, indent=1))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"env": env, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows], "memory": extra}
    (out / "seethrough.json").write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
