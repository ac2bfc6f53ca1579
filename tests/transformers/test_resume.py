"""A Trainer run resumed from its checkpoint equals the uninterrupted one, bit for bit,
whether the thaw came before or after the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from safetensors.torch import load_file

from isolate import IsolationSpec, Thaw
from isolate.errors import CheckpointMismatchError
from isolate.transformers import IsolationTrainerCallback
from tests.transformers._models import Net, trainer

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

STEPS, SAVED = 6, 3  # 4 steps an epoch


def spec(**thaw: Any) -> IsolationSpec:
    return IsolationSpec(freeze=["a"], thaw=[Thaw("a", lr=0.5, **thaw)])


def run(root: Path, thaw: dict[str, Any], *, saved: int = SAVED, resume: Path | None = None) -> Net:
    model = Net()
    t = trainer(root, model, steps=STEPS, save_steps=saved, evaluate="monitor" in thaw)
    IsolationTrainerCallback(t, spec(**thaw), verify_every_n_steps=1)
    t.train(resume_from_checkpoint=None if resume is None else str(resume))
    return model


@pytest.mark.parametrize(
    ("thaw", "saved", "thawed_at"),
    [
        ({"step": 2}, 3, (0, 2)),
        ({"step": 4}, 3, (0, 4)),
        ({"epoch": 1}, 3, (1, 4)),
        ({"epoch": 1}, 4, (1, 4)),
        # eval_loss falls: in mode "max" the 3rd evaluation (after step 3) makes it due.
        ({"monitor": "eval_loss", "mode": "max", "patience": 2}, 2, (0, 3)),
    ],
    ids=[
        "thawed-before-the-checkpoint",
        "thawed-after-it",
        "by-epoch-after-a-checkpoint-within-the-epoch-before",
        "by-epoch-after-a-checkpoint-at-the-epochs-end",
        "by-monitor-after-a-checkpoint-half-way-through-its-patience",
    ],
)
def test_a_resumed_run_equals_the_uninterrupted_one(
    tmp_path: Path, thaw: dict[str, Any], saved: int, thawed_at: tuple[int, int]
) -> None:
    whole = run(tmp_path / "whole", thaw, saved=saved)
    checkpoint = tmp_path / "whole" / f"checkpoint-{saved}"
    stateful = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]
    state = stateful["IsolationTrainerCallback"]["attributes"]["isolation"]
    epoch, step = thawed_at
    before = step < saved
    assert state["thawed"] == (
        [{"name": "a", "epoch": epoch, "global_step": step}] if before else []
    )
    assert state["frozen"] == ([] if before else ["a.weight", "a.bias"])
    resumed = run(tmp_path / "resumed", thaw, saved=saved, resume=checkpoint)
    for key, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    # Not vacuous: the thawed layer moved after the checkpoint.
    at_checkpoint = load_file(str(checkpoint / "model.safetensors"))
    assert not torch.equal(at_checkpoint["a.weight"], whole.a.weight)


def test_a_resume_under_another_spec_is_refused(tmp_path: Path) -> None:
    run(tmp_path / "whole", {"step": 2})
    model = Net()
    t = trainer(tmp_path / "other", model, steps=STEPS, save_steps=SAVED)
    IsolationTrainerCallback(t, IsolationSpec(freeze=["b"]), verify_every_n_steps=1)
    with pytest.raises(CheckpointMismatchError, match=r"written under a different isolation spec"):
        t.train(resume_from_checkpoint=str(tmp_path / "whole" / f"checkpoint-{SAVED}"))
    assert all(p.requires_grad for p in model.parameters())


def test_a_resume_from_a_checkpoint_without_the_callback_is_refused(tmp_path: Path) -> None:
    trainer(tmp_path / "plain", Net(), steps=SAVED, save_steps=SAVED).train()
    model = Net()
    t = trainer(tmp_path / "resumed", model, steps=STEPS, save_steps=SAVED)
    IsolationTrainerCallback(t, spec(step=2), verify_every_n_steps=1)
    with pytest.raises(CheckpointMismatchError, match=r"written without this callback"):
        t.train(resume_from_checkpoint=str(tmp_path / "plain" / f"checkpoint-{SAVED}"))
    assert all(p.requires_grad for p in model.parameters())
