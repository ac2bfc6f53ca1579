"""Under the Trainer's gradient checkpointing, reentrant or not, the reach check sees through
the segments: every LoRA tensor is reached, and exactly those move."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch
from transformers import Trainer, TrainingArguments

from examples.trainer_peft import Tokens, lora_model, spec
from isolate.transformers import IsolationTrainerCallback

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


def checkpointed(root: Path, *, reentrant: bool) -> Trainer:
    args = TrainingArguments(
        output_dir=str(root),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=4,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
    )
    return Trainer(model=lora_model(), args=args, train_dataset=Tokens())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_segments_are_seen_through(tmp_path: Path, reentrant: bool) -> None:
    # A reentrant segment is re-run from the inputs the loop keeps from compute_loss to the
    # end of the check step (backward frees the checkpoint's own copy).
    t = checkpointed(tmp_path, reentrant=reentrant)
    start = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    callback = IsolationTrainerCallback(t, spec(t.model), verify_every_n_steps=1)
    t.train()
    assert "reach (2x): the loss backpropagated reached each of 8 trainable" in str(callback.tally)
    moved = {n for n, p in t.model.named_parameters() if not torch.equal(p, start[n])}
    assert moved == {n for n in start if "lora_" in n}
