"""Under the Trainer's gradient checkpointing the reach check sees through the segments, or
refuses: it never passes without having seen."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers import Trainer, TrainingArguments

from examples.trainer_peft import SPEC, Tokens, lora_model
from isolate.errors import BlindSpotError
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


def test_non_reentrant_checkpointing_is_seen_through(tmp_path: Path) -> None:
    t = checkpointed(tmp_path, reentrant=False)
    callback = IsolationTrainerCallback(t, SPEC, verify_every_n_steps=1)
    t.train()
    assert "reach (2x): the loss backpropagated reached each of 8 trainable" in str(callback.tally)


def test_reentrant_checkpointing_is_a_blind_spot_at_the_steps_end(tmp_path: Path) -> None:
    # The walk re-runs each reentrant segment from its saved inputs, which the backward
    # Trainer has run by the end of the step has freed: the check refuses instead of passing.
    t = checkpointed(tmp_path, reentrant=True)
    IsolationTrainerCallback(t, SPEC, verify_every_n_steps=1)
    with pytest.raises(BlindSpotError, match=r"reentrant checkpoint of LlamaDecoderLayer\.forward"):
        t.train()
    assert not any(p.requires_grad for n, p in t.model.named_parameters() if "lora_" not in n)
