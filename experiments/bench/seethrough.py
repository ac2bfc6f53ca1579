"""What seeing through checkpoints and ``torch.compile`` costs, against one backward.

A reentrant checkpoint hides the parameters its segment uses; the audits re-run each segment
once (as backward does) to see them. On a random-initialised Llama with LoRA adapters (r=8)
behind transformers' ``gradient_checkpointing_enable`` (reentrant, the setup of PEFT's
``prepare_model_for_kbit_training``, and not), this times the walk (``cut_off_parameters``)
and a gradient audit (``gradient_report``) against one forward and one backward of the same
step, and measures how far the walk raises the process's peak resident memory (it keeps none
of what its re-run segments save for backward: it needs only the graph's structure) next to
what a forward without checkpointing saves for backward. Under ``torch.compile`` (aot_eager)
the walk reads each region's backward graph once: the same walk, eager and compiled.

Its size is set by ``--seethrough-*`` (:class:`SeethroughConfig`). Needs ``transformers`` and
``peft`` (the ``peft`` extra).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from experiments.bench._rows import Row
from experiments.bench._timing import (
    PeakResident,
    paired,
    return_freed_memory,
    saved_bytes,
    settle,
)
from experiments.bench.networks import LlamaShape, llama_lora
from isolate.cutoff import cut_off_parameters
from isolate.gradients import gradient_report

__all__ = ["QUICK_SEETHROUGH", "SeethroughConfig", "run"]


@dataclass
class SeethroughConfig:
    """Sizes of the ``seethrough`` section (``--seethrough-*`` options)."""

    hidden: int = 256
    layers: int = 4
    vocab: int = 1024
    batch: int = 4
    tokens: int = 128
    repeat: int = 7

    def shape(self) -> LlamaShape:
        heads = max(self.hidden // 32, 1)
        return LlamaShape(self.hidden, self.hidden * 8 // 3, self.layers, heads, heads,
                          self.vocab, self.tokens)  # fmt: skip


QUICK_SEETHROUGH = SeethroughConfig(hidden=64, layers=2, vocab=128, batch=2, tokens=32, repeat=2)
_MEASURED = "(measured)"


def _clean(loss: torch.Tensor, model: nn.Module) -> None:
    """The walk, which must find every adapter reached (a bench of a failing walk is void)."""
    cut = cut_off_parameters(loss, model)
    if not cut.clean:
        raise RuntimeError(f"seethrough section: the walk found parameters cut off: {cut}")


def _checkpointed(cfg: SeethroughConfig, reentrant: bool, ids: torch.Tensor) -> list[Row]:
    label = "reentrant" if reentrant else "non-reentrant"
    model = llama_lora(cfg.shape(), reentrant=reentrant)

    def forward() -> torch.Tensor:
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        return loss

    loss = forward()

    def backward() -> None:
        loss.backward(retain_graph=True)
        model.zero_grad(set_to_none=True)

    rows = []
    for name, candidate, baseline, base_name in (
        ("walk", lambda: _clean(loss, model), backward, "one backward"),
        ("walk", lambda: _clean(loss, model), forward, "one forward"),
        ("gradients", lambda: gradient_report({"loss": loss}, model), backward, "one backward"),
    ):
        what = "cut_off_parameters" if name == "walk" else "gradient_report"
        c, b, ratio = paired(candidate, baseline, warmup=1, repeat=cfg.repeat)
        rows.append(Row(f"{name} ({label} checkpointing, Llama + LoRA)", what, base_name, c, b,
                        _MEASURED, None, paired_ratio=ratio))  # fmt: skip
    if reentrant:
        rows.append(_walk_memory(cfg, model, loss, forward, ids))
    return rows


def _walk_memory(
    cfg: SeethroughConfig,
    model: nn.Module,
    loss: torch.Tensor,
    forward: object,
    ids: torch.Tensor,
) -> Row:
    """How far the walk raises the peak resident memory, next to the activations a forward
    without checkpointing saves for backward."""
    checkpointed = saved_bytes(forward)  # type: ignore[arg-type]
    full = _saved_without_checkpointing(cfg, ids)
    before = settle()
    with PeakResident() as peak:
        _clean(loss, model)
    grown = max(peak.peak - before, 1)
    extra = {
        "checkpointed forward saved MB": checkpointed / 2**20,
        "forward without checkpointing saved MB": full / 2**20,
        "kernel high-water mark": peak.kernel,
    }
    return Row("walk peak resident growth (reentrant, Llama + LoRA)", "cut_off_parameters",
               "activations a forward without checkpointing saves", grown, full, _MEASURED,
               None, extra, unit="bytes")  # fmt: skip


def _saved_without_checkpointing(cfg: SeethroughConfig, ids: torch.Tensor) -> int:
    plain = llama_lora(cfg.shape(), reentrant=None)
    return saved_bytes(lambda: plain(input_ids=ids, labels=ids))


class _Stack(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.side = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x + self.side(x).detach()


def _compiled(cfg: SeethroughConfig) -> list[Row]:
    torch.manual_seed(0)
    model = _Stack(cfg.hidden, cfg.layers * 4)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(cfg.batch * cfg.tokens, cfg.hidden)
    rows = []
    for label, module in (("eager", model), ("compiled", compiled)):
        loss = module(x).pow(2).mean()

        def backward(loss: torch.Tensor = loss) -> None:
            loss.backward(retain_graph=True)
            model.zero_grad(set_to_none=True)

        def walk(loss: torch.Tensor = loss) -> None:
            cut = cut_off_parameters(loss, model)
            if list(cut.parameters) != ["side.weight", "side.bias"]:
                raise RuntimeError(f"seethrough section: the walk missed the detached side: {cut}")

        c, b, ratio = paired(walk, backward, warmup=1, repeat=cfg.repeat)
        rows.append(Row(f"walk ({label}, aot_eager; a side branch read through .detach())",
                        "cut_off_parameters", "one backward", c, b, _MEASURED, None,
                        paired_ratio=ratio))  # fmt: skip
    return rows


def run(cfg: SeethroughConfig) -> list[Row]:
    """The rows of the section (see the module's docstring)."""
    return_freed_memory()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.tokens), generator=generator)
    rows: list[Row] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
        for reentrant in (True, False):
            rows += _checkpointed(cfg, reentrant, ids)
        rows += _compiled(cfg)
    return rows
