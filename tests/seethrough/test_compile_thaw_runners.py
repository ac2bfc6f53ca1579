"""The fault matrix's thaw under torch.compile under each Lightning and transformers' Trainer.

A tiny Llama with LoRA, its forward compiled with ``aot_eager`` under a guard filter that
hides ``requires_grad`` from dynamo; the spec freezes the LoRA of layer 1 and thaws it at
step 1. Clean, the thawed LoRA trains; planted (the spec's recompile on thaw switched off), the
check on the thaw's step names the compiled region and the four LoRA tensors.

The runners get the plain model (so the spec names its parameters as usual) and a loss that
calls the compiled forward. The guard filter must be the process's first compile, so each
case runs in a process of its own; the clean case trains its 5 seeds in one process, with
dynamo reset before each, since only the planted case depends on what was compiled before.
(``TrainingArguments(torch_compile=True)`` compiles on CPU but passes no compile options, so
the guard filter cannot be set through it.)
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from isolate.errors import StaleCompileError
from tests._launch import launch

RUNNERS = ["pytorch_lightning", "lightning.pytorch", "transformers.Trainer"]
SEEDS = [0, 1, 2, 3, 4]
LAYER1 = "*layers.1.*lora_*"


def _through(forward: Callable[..., Any]) -> Callable[[nn.Module, dict[str, torch.Tensor]], Any]:
    """The loss of a batch through the compiled ``forward``, whichever module the runner
    passes (the plain model, or Lightning's or the Trainer's hold of it)."""
    return lambda model, data: forward(**data).loss


def _runner_thaw(runner: str, planted: bool, seeds: list[int]) -> dict[str, Any]:
    """Train under ``runner`` once per seed; the error, or per seed the thawed LoRA tensors
    and those that moved."""
    import isolate.spec.thawing
    from isolate.spec import IsolationSpec, Thaw
    from tests._llama import lora_llama
    from tests.peft._matrix import RUNNERS as ALL
    from tests.peft._matrix import Fault
    from tests.seethrough.test_compile_thaw import UNGUARDED

    if planted:
        isolate.spec.thawing.forget_compiled = lambda: 0  # type: ignore[attr-defined]
    run = ALL[runner]()
    options: dict[str, Any] = UNGUARDED
    out: dict[str, Any] = {"error": None, "runs": []}
    for seed in seeds:
        torch._dynamo.reset()
        model = lora_llama(seed=seed)
        forward = torch.compile(model, backend="aot_eager", options=options)
        fault = Fault(
            build=lambda s: lora_llama(seed=s),
            spec=lambda m: IsolationSpec(freeze=(LAYER1,), thaw=(Thaw(LAYER1, step=1, lr=1e-2),)),
            loss=_through(forward),
        )
        thawed = {n: p for n, p in model.named_parameters() if ".layers.1." in n and "lora_" in n}
        before = {n: p.detach().clone() for n, p in thawed.items()}
        try:
            run(model, fault, seed, Path.cwd() / f"seed{seed}")
        except StaleCompileError as error:
            out["error"] = f"{type(error).__name__}: {error}"
            return out
        moved = sorted(n for n, p in thawed.items() if not torch.equal(p.detach(), before[n]))
        out["runs"].append({"thawed": sorted(thawed), "moved": moved})
    return out


def _in_child(runner: str, planted: bool, seeds: list[int], tmp_path: Path) -> Any:
    module = "tests.seethrough.test_compile_thaw_runners"
    call = f"_runner_thaw({runner!r}, {planted}, {seeds!r})"
    code = f"import json; from {module} import _runner_thaw; print(json.dumps({call}))"
    done = launch([sys.executable, "-c", code], cwd=tmp_path, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_thaw_under_compile_trains_under_each_runner(runner: str, tmp_path: Path) -> None:
    """Clean over 5 seeds: nothing raised, and all four thawed LoRA tensors move."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip(runner.removesuffix(".Trainer"))
    out = _in_child(runner, False, SEEDS, tmp_path)
    assert out["error"] is None
    assert len(out["runs"]) == len(SEEDS)
    for run in out["runs"]:
        assert len(run["thawed"]) == 4 and run["moved"] == run["thawed"]


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_thaw_that_would_not_train_under_compile_is_named_under_each_runner(
    runner: str, tmp_path: Path
) -> None:
    """Planted: the check on the thaw's step names the compiled region and the four LoRA
    tensors."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip(runner.removesuffix(".Trainer"))
    out = _in_child(runner, True, [0], tmp_path)
    who = "IsolationTrainerCallback" if runner == "transformers.Trainer" else "IsolationCallback"
    prefix = "" if runner == "transformers.Trainer" else r"model\."
    lora = rf"'{prefix}base_model\.model\.model\.layers\.1\.self_attn\.[qv]_proj\.lora_[AB]"
    lora += r"\.default\.weight'"
    assert re.match(
        rf"^StaleCompileError: {who}: at step 1, \[{lora}, {lora}, {lora}, {lora}\] get no "
        r"gradient: cut_off_parameters\(\): the torch\.compile region PeftModel\.forward "
        r"\(.*\), graph \d+/\d+ was compiled while 4 of its inputs .* did not require grad",
        out["error"],
    ), out["error"]
