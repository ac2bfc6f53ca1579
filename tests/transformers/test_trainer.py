"""What the Trainer adapter asks of a ``transformers.Trainer``, function by function, without
training: the setups refused and their words, the method wrappers, the optimizer, and the
state a checkpoint holds."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from transformers import Trainer, TrainingArguments

from isolate import IsolationSpec, Thaw
from isolate.errors import (
    CheckpointMismatchError,
    IsolationTypeError,
    IsolationWarning,
    SpecError,
    UnsupportedStrategyError,
)
from isolate.transformers.trainer import (
    check_evaluation,
    check_trainer,
    saved_state,
    torch_optimizer,
    unwrap_methods,
    warn_on_norm_clipping,
    wrap_methods,
)
from tests.transformers._models import Net, trainer

pytestmark = [pytest.mark.usefixtures("one_thread")]

ADVICE = (
    "train on one process and one device, or use isolate.lightning.IsolationCallback, which "
    "supports DDP and FSDP"
)


def test_a_trainer_of_one_process_and_device_is_returned_as_it_is(tmp_path: Path) -> None:
    t = trainer(tmp_path, Net())
    assert check_trainer(t, "caller") is t


def test_what_is_no_trainer_is_refused_with_its_type() -> None:
    with pytest.raises(IsolationTypeError) as e:
        check_trainer(Net(), "caller")
    assert str(e.value) == "caller: expected a transformers.Trainer, got Net"


@pytest.mark.parametrize(
    ("setting", "what", "why"),
    [
        ("is_deepspeed_enabled", "DeepSpeed", "it builds and shards its own optimizer"),
        ("is_fsdp_enabled", "FSDP", "it shards parameters"),
        ("is_fsdp_xla_enabled", "FSDP", "it shards parameters"),
        (
            "world_size",
            "2 processes",
            "DDP synchronises only the parameters that required grad when it was built, and a "
            "thaw cannot rebuild it inside Trainer",
        ),
        ("n_gpu", "2 GPUs", "nn.DataParallel replicates the model each step"),
    ],
)
def test_each_unsupported_setup_is_refused_word_for_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, what: str, why: str
) -> None:
    t = trainer(tmp_path, Net())
    if setting in ("world_size", "n_gpu"):  # properties of the arguments, read-only
        monkeypatch.setattr(TrainingArguments, setting, property(lambda self: 2))
    else:
        setattr(t, setting, True)
    with pytest.raises(UnsupportedStrategyError) as e:
        check_trainer(t, "caller")
    assert str(e.value) == f"caller: training with {what} is not supported ({why}); {ADVICE}"


def test_one_process_and_one_gpu_are_supported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = trainer(tmp_path, Net())
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 1))
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 1))
    assert check_trainer(t, "caller") is t


def test_restoring_callback_states_is_refused_word_for_word(tmp_path: Path) -> None:
    t = trainer(tmp_path, Net(), restore_callback_states_from_checkpoint=True)
    with pytest.raises(SpecError) as e:
        check_trainer(t, "caller")
    assert str(e.value) == (
        "caller: restore_callback_states_from_checkpoint=True would replace this callback by "
        "a new instance built from the checkpoint, without its Trainer; it restores its own "
        "state from the checkpoint. Set "
        "TrainingArguments(restore_callback_states_from_checkpoint=False)"
    )


def test_monitor_thaws_in_a_trainer_that_never_evaluates_are_named_word_for_word(
    tmp_path: Path,
) -> None:
    thaw = [
        Thaw("b", name="late", monitor="eval_loss"),
        Thaw("a", name="early", monitor="eval_loss"),
        Thaw("a.bias", name="fixed", step=3),
    ]
    spec = IsolationSpec(freeze=["a", "b"], thaw=thaw)
    with pytest.raises(SpecError) as e:
        check_evaluation(trainer(tmp_path, Net()), spec, "caller")
    assert str(e.value) == (
        "caller: thaw groups ['early', 'late'] wait for ['eval_loss'] to stop improving, but "
        "this Trainer never evaluates (eval_strategy='no'), so they would never thaw; set "
        "TrainingArguments(eval_strategy='steps') and an eval_dataset, or give them epoch= or "
        "step="
    )
    check_evaluation(trainer(tmp_path, Net(), evaluate=True), spec, "caller")
    fixed = IsolationSpec(freeze=["a"], thaw=[Thaw("a", step=3)])
    check_evaluation(trainer(tmp_path, Net()), fixed, "caller")


def test_an_evaluation_strategy_set_as_a_string_after_the_arguments_is_read(
    tmp_path: Path,
) -> None:
    """TrainingArguments turns ``eval_strategy`` into an ``IntervalStrategy``; one set later as
    a plain string still counts (the Trainer compares it to the enum's string value): a monitor
    thaw is accepted under ``"steps"`` (it was refused as "never evaluates") and refused under
    ``"no"``."""
    spec = IsolationSpec(freeze=["a"], thaw=[Thaw("a", monitor="eval_loss")])
    t = trainer(tmp_path, Net(), evaluate=True)
    t.args.eval_strategy = "steps"
    check_evaluation(t, spec, "caller")
    t.args.eval_strategy = "no"
    with pytest.raises(SpecError, match=r"^caller: thaw groups \['a'\] wait for"):
        check_evaluation(t, spec, "caller")


def test_global_norm_clipping_is_warned_only_across_a_detached_branch(tmp_path: Path) -> None:
    with pytest.warns(IsolationWarning) as caught:
        warn_on_norm_clipping(trainer(tmp_path, Net(), max_grad_norm=0.5), ("b", "a"))
    assert [str(w.message) for w in caught] == [
        "IsolationTrainerCallback: max_grad_norm=0.5 clips by the global norm, which includes "
        "the gradients of the detached branches ['b', 'a']: their gradient changes the factor "
        "applied to every other parameter, so isolation does not hold for the update. Set "
        "TrainingArguments(max_grad_norm=0) and clip per group, if at all"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", IsolationWarning)
        warn_on_norm_clipping(trainer(tmp_path, Net(), max_grad_norm=0.5), ())
        warn_on_norm_clipping(trainer(tmp_path, Net(), max_grad_norm=0.0), ("b",))
        warn_on_norm_clipping(trainer(tmp_path, Net(), max_grad_norm=-1.0), ("b",))
        warn_on_norm_clipping(trainer(tmp_path, Net(), max_grad_norm=None), ("b",))


class _Calls(Trainer):
    """A Trainer whose three wrapped methods only record their calls."""

    def __init__(self, root: Path) -> None:
        super().__init__(model=Net(), args=TrainingArguments(str(root), use_cpu=True, report_to=[]))
        self.calls: list[Any] = []

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("create_optimizer", args, kwargs))
        return "optimizer"

    def create_scheduler(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("create_scheduler", args, kwargs))
        return "scheduler"

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        assert model is self.model
        self.calls.append(("compute_loss", args, kwargs))
        return inputs


def test_the_wrapped_methods_call_the_spec_around_the_trainers_and_are_removed(
    tmp_path: Path,
) -> None:
    t = _Calls(tmp_path)
    wrap_methods(
        t,
        before_optimizer=lambda: t.calls.append("before_optimizer"),
        after_scheduler=lambda: t.calls.append("after_scheduler"),
        on_loss=lambda loss: t.calls.append(("loss", loss)),
    )
    assert t.create_optimizer(1, k=2) == "optimizer"
    assert t.create_scheduler(10, optimizer="o") == "scheduler"
    loss = torch.tensor(1.0)
    assert t.compute_loss(t.model, loss, True, num_items_in_batch=4) is loss
    outputs = (torch.tensor(2.0), {"logits": 0})
    assert t.compute_loss(t.model, outputs) is outputs
    with torch.no_grad():  # an evaluation: no step's loss
        t.compute_loss(t.model, torch.tensor(3.0))
    assert t.calls == [
        "before_optimizer",
        ("create_optimizer", (1,), {"k": 2}),
        ("create_scheduler", (10,), {"optimizer": "o"}),
        "after_scheduler",
        ("compute_loss", (True,), {"num_items_in_batch": 4}),
        ("loss", loss),
        ("compute_loss", (), {}),
        ("loss", outputs[0]),
        ("compute_loss", (), {}),
    ]
    unwrap_methods(t)
    assert not {"create_optimizer", "create_scheduler", "compute_loss"} & set(vars(t))
    t.calls.clear()
    t.create_optimizer()
    assert t.calls == [("create_optimizer", (), {})]
    unwrap_methods(t)  # nothing left to remove


def test_a_trainer_without_optimizer_is_refused_word_for_word(tmp_path: Path) -> None:
    t = trainer(tmp_path, Net())
    with pytest.raises(SpecError) as e:
        torch_optimizer(t, "caller")
    assert str(e.value) == (
        "caller: the Trainer built no optimizer, so thawed groups have nowhere to go and frozen "
        "parameters cannot be checked out of it; let Trainer build it (create_optimizer) or pass "
        "optimizers=(optimizer, scheduler)"
    )
    optimizer = torch.optim.SGD(t.model.parameters(), lr=0.1)
    t.optimizer = optimizer
    assert torch_optimizer(t, "caller") is optimizer
    t.optimizer = object()  # type: ignore[assignment]
    with pytest.raises(IsolationTypeError) as e:
        torch_optimizer(t, "caller")
    assert str(e.value) == (
        "caller: optimizer must be a torch.optim.Optimizer, got object; pass the torch "
        "optimizer itself, or a wrapper that holds it in .optimizer"
    )


def test_a_checkpoints_state_is_read_and_copied() -> None:
    state = {"thawed": ["a"]}
    stateful = {"key": {"args": {}, "attributes": {"isolation": state}}}
    read = saved_state(stateful, "key")
    assert read == state and read is not state
    assert saved_state({"key": {"args": {}, "attributes": {"isolation": None}}}, "key") is None


@pytest.mark.parametrize("stateful", [{}, {"other": {}}, None, [("key", {})]])
def test_a_checkpoint_written_without_the_callback_is_refused_word_for_word(
    stateful: Any,
) -> None:
    with pytest.raises(CheckpointMismatchError) as e:
        saved_state(stateful, "key")
    assert str(e.value) == (
        "key: the checkpoint holds no key state in trainer_state.json (stateful_callbacks): it "
        "was written without this callback, so it is unknown what was frozen or thawed. To "
        "start a new isolation schedule from its weights, load them into the model and call "
        "train() without resume_from_checkpoint"
    )


@pytest.mark.parametrize(
    "entry", [{"args": {}}, {"attributes": {"other": 1}}, {"attributes": [1]}, ["isolation"]]
)
def test_a_malformed_checkpoint_state_is_refused_word_for_word(entry: Any) -> None:
    with pytest.raises(CheckpointMismatchError) as e:
        saved_state({"key": entry}, "key")
    assert str(e.value) == (
        "key: the checkpoint's key state is malformed: expected "
        f"{{'args': {{}}, 'attributes': {{'isolation': ...}}}}, got {entry!r}"
    )
