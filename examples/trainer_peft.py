"""A transformers ``Trainer`` fine-tuning LoRA adapters (PEFT) under an isolation spec.

Only the LoRA tensors train (the spec is read from the PEFT model); the final norm thaws at
step 3; the callback checks every 2 steps that the loss reaches every trainable tensor, that
each LoRA tensor moves and that the base did not, and saves where the spec stands in the
Trainer's checkpoints::

    python examples/trainer_peft.py --output-dir run --steps 6
    python examples/trainer_peft.py --output-dir run2 --steps 6 --stop-after 3
    python examples/trainer_peft.py --output-dir run2 --steps 6 --resume   # from checkpoint-3

The model is a tiny Llama built from a config with random weights (nothing is downloaded),
with LoRA (r=4) on the attention's q and v projections. At the end the script prints what
the checks verified, that the base weights are bit for bit where they started, and a
checksum of the adapters: a resumed run prints the same number as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from isolate import IsolationSpec, Thaw
from isolate.cli import Parser

VOCAB, LENGTH = 128, 16


def spec(model: nn.Module) -> IsolationSpec:
    """What PEFT froze stays still and every LoRA tensor trains (read from the model, no
    selectors to write); the final norm joins the optimizer at step 3 with its own lr."""
    from isolate.peft import spec_for

    return spec_for(model, thaw=[Thaw("base_model.model.model.norm", step=3, lr=1e-3)])


def lora_model(seed: int = 0) -> nn.Module:
    """A 2-layer ``LlamaForCausalLM`` from a config, random weights from ``seed``, with LoRA."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    torch.manual_seed(seed)
    base = LlamaForCausalLM(config)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(base, lora)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """32 random token sequences; the labels are the inputs (causal language modelling)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def train(
    output_dir: Path, *, steps: int = 6, stop_after: int | None = None, resume: bool = False
) -> tuple[nn.Module, str]:
    """Train ``steps`` optimizer steps, saving a checkpoint every 3; ``stop_after`` ends the
    run after that many steps (an interruption); ``resume`` continues from the last checkpoint
    in ``output_dir``.

    Returns:
        The model (the spec restored) and what the checks verified.
    """
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from isolate.transformers import IsolationTrainerCallback

    model = lora_model()
    args = TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to=[],
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=3,
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    callback = IsolationTrainerCallback(trainer, spec(model), verify_every_n_steps=2)
    if stop_after is not None:

        class Interrupt(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
                control.should_training_stop = state.global_step >= stop_after

        trainer.add_callback(Interrupt())
    trainer.train(resume_from_checkpoint=True if resume else None)
    return model, str(callback.tally)


def base_unchanged(model: nn.Module) -> bool:
    """Whether every base tensor but the thawed norm is bit for bit as built."""
    start = dict(lora_model().named_parameters())
    return all(
        torch.equal(p, start[name])
        for name, p in model.named_parameters()
        if "lora_" not in name and not name.endswith("model.norm.weight")
    )


def adapters_checksum(model: nn.Module) -> float:
    return float(
        sum(p.detach().double().sum() for n, p in model.named_parameters() if "lora_" in n)
    )


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python examples/trainer_peft.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output-dir", type=Path, required=True, help="checkpoints go here")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (default 6)")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    args = parser.parse_args(argv)
    model, tally = train(
        args.output_dir, steps=args.steps, stop_after=args.stop_after, resume=args.resume
    )
    print(tally)
    print(f"base weights unchanged: {base_unchanged(model)}")
    print(f"adapters checksum: {adapters_checksum(model):.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
