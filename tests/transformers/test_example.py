"""examples/trainer_peft.py trains only what its spec says, and resumes bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch

from examples import trainer_peft

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


def test_the_example_trains_the_adapters_and_the_thawed_norm_only(tmp_path: Path) -> None:
    model, tally = trainer_peft.train(tmp_path, steps=4)
    start = dict(trainer_peft.lora_model().named_parameters())
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, start[n])}
    lora = {n for n in start if "lora_" in n}
    assert lora and moved == lora | {"base_model.model.model.norm.weight"}
    assert trainer_peft.base_unchanged(model)
    assert "reach (3x): the loss backpropagated reached each of 9 trainable parameters" in tally
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


@pytest.mark.slow
def test_the_example_resumed_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    whole, _ = trainer_peft.train(tmp_path / "whole", steps=6)
    trainer_peft.train(tmp_path / "part", steps=6, stop_after=3)
    resumed, _ = trainer_peft.train(tmp_path / "part", steps=6, resume=True)
    assert trainer_peft.adapters_checksum(resumed) == trainer_peft.adapters_checksum(whole)
    for (name, p), q in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_the_spec_peft_derives_holds_under_the_trainer(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from isolate.peft import spec_for
    from isolate.transformers import IsolationTrainerCallback

    model = trainer_peft.lora_model()
    args = TrainingArguments(
        str(tmp_path), max_steps=2, use_cpu=True, report_to=[], save_strategy="no"
    )
    t = Trainer(model=model, args=args, train_dataset=trainer_peft.Tokens())
    callback = IsolationTrainerCallback(t, spec_for(model), verify_every_n_steps=1)
    t.train()
    tally = str(callback.tally)
    assert "reach (2x): the loss backpropagated reached each of 8 trainable parameters" in tally
    assert "contract 'peft:default' held" in tally
    assert trainer_peft.base_unchanged(model)
