"""IsolationTrainerCallback in a real, tiny transformers Trainer: apply, thaw, check, undo."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerState

from isolate import IsolationSpec, Thaw
from isolate.errors import (
    BlindSpotError,
    CutOffError,
    DriftError,
    IsolationTypeError,
    IsolationWarning,
    SelectorError,
    SpecError,
    UnsupportedStrategyError,
)
from isolate.spec.checks import Tally
from isolate.transformers import IsolationTrainerCallback
from isolate.transformers.trainer import torch_optimizer
from tests.transformers._models import Data, Net, arguments, trainer

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


class Record(TrainerCallback):
    """What each optimizer step sees just before ``optimizer.step()``."""

    def __init__(self, model: Net) -> None:
        self.model = model
        self.steps: list[dict[str, Any]] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        groups = kwargs["optimizer"].param_groups
        weight = self.model.a.weight
        self.steps.append(
            {
                "step": state.global_step,
                "trainable": weight.requires_grad,
                "grad": None if weight.grad is None else weight.grad.abs().sum().item(),
                "groups": [len(g["params"]) for g in groups],
                "lr": groups[-1]["lr"],
                "weight": weight.detach().clone(),
            }
        )


def untouched(t: Trainer) -> bool:
    """No method of the Trainer is left wrapped but ``train``."""
    return not {"create_optimizer", "create_scheduler", "compute_loss"} & set(t.__dict__)


@pytest.mark.parametrize(
    ("thaw", "at", "accumulate"),
    [({"step": 2}, 2, 1), ({"epoch": 1}, 4, 1), ({"step": 2}, 2, 2), ({"epoch": 1}, 2, 2)],
    ids=["step-2", "epoch-1", "step-2-accumulating-2", "epoch-1-accumulating-2"],
)
def test_a_thaw_joins_trainers_optimizer_at_its_step_with_the_scheduled_lr(
    tmp_path: Path, thaw: dict[str, int], at: int, accumulate: int
) -> None:
    model = Net()
    start = model.a.weight.detach().clone()
    t = trainer(tmp_path, model, steps=6, gradient_accumulation_steps=accumulate)
    callback = IsolationTrainerCallback(
        t, IsolationSpec(freeze=["a"], thaw=[Thaw("a", lr=0.5, **thaw)]), verify_every_n_steps=1
    )
    record = Record(model)
    t.add_callback(record)
    t.train()
    for seen in record.steps:
        before = seen["step"] < at
        assert seen["trainable"] is not before, seen
        assert (seen["grad"] is None) is before, seen  # frozen: no gradient at all
        assert seen["groups"] == ([1, 1] if before else [1, 1, 2]), seen  # b.weight | b.bias | a
        assert torch.equal(seen["weight"], start) is (seen["step"] <= at), seen
    # The linear schedule (6 steps, from 1 down to 0) scales the group's own lr of 0.5.
    lrs = [s["lr"] for s in record.steps[at:]]
    assert lrs == pytest.approx([0.5 * (6 - s) / 6 for s in range(at, 6)])
    assert record.steps[at]["grad"] > 0
    assert callback.handle is None and model.a.weight.requires_grad  # restored after train()
    assert "reach" in str(callback.tally) and untouched(t)


def test_frozen_parameters_never_enter_the_optimizer_trainer_builds(tmp_path: Path) -> None:
    model = Net()
    t = trainer(tmp_path, model, steps=1)
    IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]), verify_every_n_steps=1)
    record = Record(model)
    t.add_callback(record)
    t.train()
    held = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert held == {id(model.b.weight), id(model.b.bias)}
    assert record.steps[0]["trainable"] is False


def test_an_optimizer_given_to_the_trainer_loses_its_frozen_parameters_without_a_warning(
    tmp_path: Path,
) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the spec froze anything
    args = arguments(tmp_path, steps=1)
    t = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None))
    IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]))
    record = Record(model)
    t.add_callback(record)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IsolationWarning)
        t.train()
    assert [step["groups"] for step in record.steps] == [[2]]  # a's two tensors taken out
    assert sum(len(g["params"]) for g in opt.param_groups) == 4  # and put back after train()


class Tamper(TrainerCallback):
    """Writes into the frozen ``a.weight`` after step ``at``."""

    def __init__(self, model: Net, at: int) -> None:
        self.model, self.at = model, at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            with torch.no_grad():
                self.model.a.weight[0, 0] += 1.0


def test_a_frozen_weight_changed_during_training_raises_by_name(tmp_path: Path) -> None:
    model = Net()
    t = trainer(tmp_path, model, steps=4)
    IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]), verify_every_n_steps=1)
    t.add_callback(Tamper(model, at=2))
    with pytest.raises(DriftError, match=r"^IsolationTrainerCallback.*'a\.weight'") as error:
        t.train()
    assert "at step 2" in str(error.value)
    # The model is as it was before train(): nothing frozen, nothing wrapped.
    assert all(p.requires_grad for p in model.parameters()) and untouched(t)


def test_a_trainable_layer_no_loss_reaches_raises_by_name(tmp_path: Path) -> None:
    model = Net(unused=True)
    t = trainer(tmp_path, model, steps=2)
    IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]), verify_every_n_steps=1)
    with pytest.raises(CutOffError, match=r"  c\.weight, c\.bias: no path from any loss") as error:
        t.train()
    assert "step 0" in str(error.value)
    assert all(p.requires_grad for p in model.parameters()) and untouched(t)


def test_expected_unused_lets_that_layer_go_unreached(tmp_path: Path) -> None:
    model = Net(unused=True)
    t = trainer(tmp_path, model, steps=2)
    callback = IsolationTrainerCallback(
        t, IsolationSpec(freeze=["a"]), verify_every_n_steps=1, expected_unused=["c"]
    )
    t.train()
    assert "reach (2x)" in str(callback.tally)


class NoComputeLoss(Trainer):
    """A training step that computes its loss without ``compute_loss``."""

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        model.train()
        loss = model(**inputs)["loss"]
        self.accelerator.backward(loss)
        return loss.detach()


def test_a_step_whose_loss_bypasses_compute_loss_is_a_blind_spot(tmp_path: Path) -> None:
    model = Net()
    t = trainer(tmp_path, model, steps=2)
    t.__class__ = NoComputeLoss
    IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]), verify_every_n_steps=1)
    with pytest.raises(
        BlindSpotError, match=r"no loss went through Trainer\.compute_loss at step 0"
    ):
        t.train()
    assert model.a.weight.requires_grad and untouched(t)


class OutputsToo(Trainer):
    """A training step that asks ``compute_loss`` for the outputs too, ``(loss, outputs)``."""

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        model.train()
        loss, _outputs = self.compute_loss(model, inputs, return_outputs=True)
        self.accelerator.backward(loss)
        return loss.detach()


def test_a_loss_returned_with_its_outputs_is_the_one_checked(tmp_path: Path) -> None:
    model = Net(unused=True)
    t = trainer(tmp_path, model, steps=2)
    t.__class__ = OutputsToo
    IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]), verify_every_n_steps=1)
    # The reach check walks the loss, the first item: the unused layer is named as cut off.
    with pytest.raises(CutOffError, match=r"  c\.weight, c\.bias: no path from any loss"):
        t.train()
    assert all(p.requires_grad for p in model.parameters()) and untouched(t)


def test_a_selector_matching_nothing_changes_nothing(tmp_path: Path) -> None:
    model = Net()
    t = trainer(tmp_path, model, steps=2)
    IsolationTrainerCallback(t, IsolationSpec(freeze=["encoder"]))
    with pytest.raises(SelectorError, match=r"'encoder'"):
        t.train()
    assert all(p.requires_grad for p in model.parameters()) and untouched(t)


@pytest.mark.parametrize(
    ("setting", "error", "says"),
    [
        ("is_deepspeed_enabled", UnsupportedStrategyError, r"training with DeepSpeed is not"),
        ("is_fsdp_enabled", UnsupportedStrategyError, r"training with FSDP is not supported"),
    ],
)
def test_an_unsupported_trainer_is_refused_before_anything_changes(
    tmp_path: Path, setting: str, error: type[Exception], says: str
) -> None:
    model = Net()
    t = trainer(tmp_path, model, steps=1)
    callbacks = list(t.callback_handler.callbacks)
    setattr(t, setting, True)
    with pytest.raises(error, match=rf"^IsolationTrainerCallback: {says}"):
        IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]))
    assert t.callback_handler.callbacks == callbacks and "train" not in t.__dict__


def test_bad_arguments_are_refused_naming_the_fix(tmp_path: Path) -> None:
    model = Net()
    spec = IsolationSpec(freeze=["a"])
    with pytest.raises(IsolationTypeError, match=r"expected a transformers\.Trainer, got Net"):
        IsolationTrainerCallback(model, spec)  # type: ignore[arg-type]
    t = trainer(tmp_path, model, steps=1, restore_callback_states_from_checkpoint=True)
    with pytest.raises(SpecError, match=r"restore_callback_states_from_checkpoint=False"):
        IsolationTrainerCallback(t, spec)
    t = trainer(tmp_path, model, steps=1)
    with pytest.raises(SpecError, match=r"protect names the losses \['probe'\]"):
        IsolationTrainerCallback(t, IsolationSpec(freeze=["a"], protect={"probe": ["a"]}))
    with pytest.raises(SpecError, match=r"verify_every_n_steps must be an integer >= 0"):
        IsolationTrainerCallback(t, spec, verify_every_n_steps=-1)
    assert "train" not in t.__dict__ and model.a.weight.requires_grad


def test_the_optimizer_is_the_torch_one_inside_accelerate(tmp_path: Path) -> None:
    t = trainer(tmp_path, Net(), steps=1)
    with pytest.raises(SpecError, match=r"the Trainer built no optimizer"):
        torch_optimizer(t, "caller")
    t.optimizer = object()  # type: ignore[assignment]
    with pytest.raises(IsolationTypeError, match=r"must be a torch.optim.Optimizer, got object"):
        torch_optimizer(t, "caller")


def test_a_removed_callback_leaves_train_alone(tmp_path: Path) -> None:
    model = Net()
    t = trainer(tmp_path, model, steps=1)
    callback = IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]))
    t.remove_callback(callback)
    before = model.a.weight.detach().clone()
    t.train()
    assert not torch.equal(model.a.weight, before)  # trained, not frozen


def test_a_monitor_thaw_follows_the_trainers_evaluations(tmp_path: Path) -> None:
    model = Net()
    t = trainer(tmp_path, model, steps=5, evaluate=True)
    # eval_loss falls, so in mode "max" it stops improving at the second evaluation (after
    # step 2), and the group thaws at the next step.
    thaw = Thaw("a", monitor="eval_loss", mode="max", patience=1, lr=0.5)
    IsolationTrainerCallback(t, IsolationSpec(freeze=["a"], thaw=[thaw]), verify_every_n_steps=1)
    record = Record(model)
    t.add_callback(record)
    t.train()
    assert [s["trainable"] for s in record.steps] == [False, False, True, True, True]
    assert [s["groups"] for s in record.steps][1:3] == [[1, 1], [1, 1, 2]]


def test_a_monitor_thaw_in_a_trainer_that_never_evaluates_is_refused(tmp_path: Path) -> None:
    t = trainer(tmp_path, Net(), steps=1)
    thaw = Thaw("a", monitor="eval_loss")
    with pytest.raises(SpecError, match=r"never evaluates \(eval_strategy='no'\)"):
        IsolationTrainerCallback(t, IsolationSpec(freeze=["a"], thaw=[thaw]))


def test_global_norm_clipping_across_a_detached_branch_is_warned(tmp_path: Path) -> None:
    t = trainer(tmp_path, Net(), steps=1)
    with pytest.warns(IsolationWarning, match=r"max_grad_norm=1\.0 clips by the global norm"):
        IsolationTrainerCallback(t, IsolationSpec(detach=["b"]))
    t = trainer(tmp_path, Net(), steps=1, max_grad_norm=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IsolationWarning)
        IsolationTrainerCallback(t, IsolationSpec(detach=["b"]))
        # No branch detached: clipping by the global norm mixes nothing in.
        IsolationTrainerCallback(trainer(tmp_path, Net(), steps=1), IsolationSpec(freeze=["a"]))


def test_the_callback_shows_as_its_spec_under_its_own_name_once(tmp_path: Path) -> None:
    """Only the spec's own name is replaced, not a selector that happens to spell it."""
    callback = IsolationTrainerCallback(
        trainer(tmp_path, Net()), IsolationSpec(freeze=["IsolationSpec"])
    )
    assert repr(callback) == "IsolationTrainerCallback(freeze=['IsolationSpec'])"


def test_an_evaluation_outside_train_leaves_a_monitor_thaw_alone(tmp_path: Path) -> None:
    t = trainer(tmp_path, Net(), evaluate=True)
    thaw = Thaw("a", monitor="eval_loss")
    callback = IsolationTrainerCallback(t, IsolationSpec(freeze=["a"], thaw=[thaw]))
    assert "eval_loss" in t.evaluate()  # no handle yet: nothing to observe
    assert callback.handle is None and callback._evaluations == 0


def test_a_monitor_thaw_with_no_evaluation_in_train_is_warned(tmp_path: Path) -> None:
    """eval_delay past the last step: a stock Trainer that evaluates nothing in train()."""
    model = Net()
    t = trainer(tmp_path, model, steps=2, evaluate=True, eval_delay=10)
    thaw = Thaw("a", monitor="eval_loss", lr=0.5)
    callback = IsolationTrainerCallback(t, IsolationSpec(freeze=["a"], thaw=[thaw]))
    with pytest.warns(IsolationWarning) as caught:
        t.train()
    said = [str(w.message) for w in caught if issubclass(w.category, IsolationWarning)]
    assert said == [
        "IsolationTrainerCallback: thaw group 'a' waited for 'eval_loss' to stop improving, "
        "but no evaluation ran during this train(), so it never thawed; evaluate more often "
        "(eval_steps) or give it epoch= or step="
    ]
    assert callback.handle is None and model.a.weight.requires_grad


def test_a_monitor_thaw_that_saw_evaluations_but_never_thawed_is_not_warned(
    tmp_path: Path,
) -> None:
    t = trainer(tmp_path, Net(), steps=2, evaluate=True)
    thaw = Thaw("a", monitor="eval_loss", patience=100, lr=0.5)
    callback = IsolationTrainerCallback(t, IsolationSpec(freeze=["a"], thaw=[thaw]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", IsolationWarning)
        t.train()
    assert callback._evaluations == 2 and callback.handle is None


def test_each_refusal_of_the_constructor_names_the_callback_and_the_fix(tmp_path: Path) -> None:
    t = trainer(tmp_path, Net(), steps=1)
    spec = IsolationSpec(freeze=["a"])
    with pytest.raises(
        SpecError,
        match=r"^IsolationTrainerCallback: spec must be an isolate\.IsolationSpec, got dict; "
        r"for a mapping use IsolationSpec\.from_dict",
    ):
        IsolationTrainerCallback(t, {"freeze": ["a"]})  # type: ignore[arg-type]
    with pytest.raises(
        SpecError,
        match=r"^IsolationTrainerCallback: drift must be 'fingerprint' or 'copy', got 'x'$",
    ):
        IsolationTrainerCallback(t, spec, drift="x")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"^IsolationTrainerCallback: verify_every_n_steps"):
        IsolationTrainerCallback(t, spec, verify_every_n_steps=-1)
    with pytest.raises(SpecError, match=r"^IsolationTrainerCallback: .*never evaluates"):
        IsolationTrainerCallback(t, IsolationSpec(freeze=["a"], thaw=[Thaw("a", monitor="m")]))
    callback = IsolationTrainerCallback(t, spec, drift="copy")
    assert callback.drift == "copy"
    with pytest.raises(
        SpecError,
        match=r"^IsolationTrainerCallback: the Trainer has an IsolationTrainerCallback already; "
        r"give one spec per Trainer \(its checkpoint state has a fixed key\)$",
    ):
        IsolationTrainerCallback(t, spec)


def test_train_begin_without_the_spec_applied_or_attached_is_refused(tmp_path: Path) -> None:
    """This transformers' loop always calls create_optimizer and create_scheduler; a loop
    that skips them (another version, an overridden training loop) meets these refusals."""
    model = Net()
    t = trainer(tmp_path, model, steps=1)
    callback = IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]))
    with pytest.raises(SpecError) as error:
        callback.on_train_begin(t.args, t.state, t.control)
    assert str(error.value) == (
        "IsolationTrainerCallback: the spec is not applied: this train() never called "
        "Trainer.create_optimizer and create_scheduler, where it is applied and attached; keep "
        "them in the training path (override, do not bypass them)"
    )
    callback._before_optimizer()  # applied, never attached
    with pytest.raises(SpecError) as error:
        callback.on_train_begin(t.args, t.state, t.control)
    assert str(error.value) == (
        "IsolationTrainerCallback: the Trainer built an optimizer but no LR scheduler through "
        "create_scheduler, so the optimizer was never attached; keep create_scheduler in the "
        "training path"
    )
    callback._restore()
    assert callback.handle is None and model.a.weight.requires_grad


def test_the_defaults_check_every_50_steps_and_start_with_an_empty_tally(tmp_path: Path) -> None:
    callback = IsolationTrainerCallback(trainer(tmp_path, Net()), IsolationSpec(freeze=["a"]))
    assert callback.cadence.every == 50 and callback.drift == "fingerprint"
    assert callback.tally == Tally()


def test_a_second_train_applies_attaches_and_thaws_as_the_first(tmp_path: Path) -> None:
    model = Net()
    t = trainer(tmp_path, model, steps=3)
    spec = IsolationSpec(freeze=["a"], thaw=[Thaw("a", lr=0.5, step=1)])
    IsolationTrainerCallback(t, spec, verify_every_n_steps=1)
    runs = []
    for _ in range(2):
        record = Record(model)
        t.add_callback(record)
        t.train()
        t.remove_callback(record)
        runs.append([(s["trainable"], s["groups"]) for s in record.steps])
    assert runs[0] == runs[1] == [(False, [1, 1]), (True, [1, 1, 2]), (True, [1, 1, 2])]


def test_an_epoch_thaw_of_a_layer_no_loss_reaches_raises_at_its_first_step(
    tmp_path: Path,
) -> None:
    """With no periodic check, reach is checked on a thaw's first step: epoch 1's step 4."""
    model = Net(unused=True)
    t = trainer(tmp_path, model, steps=6)
    spec = IsolationSpec(freeze=["c"], thaw=[Thaw("c", lr=0.5, epoch=1)])
    IsolationTrainerCallback(t, spec, verify_every_n_steps=0, expected_unused=[])
    with pytest.raises(CutOffError, match=r"  c\.weight, c\.bias: no path from any loss") as error:
        t.train()
    assert "step 4" in str(error.value)


def test_an_epoch_2_thaw_waits_for_the_third_epoch(tmp_path: Path) -> None:
    """4 steps an epoch: epoch 2 begins at step 8."""
    model = Net()
    t = trainer(tmp_path, model, steps=10)
    spec = IsolationSpec(freeze=["a"], thaw=[Thaw("a", lr=0.5, epoch=2)])
    IsolationTrainerCallback(t, spec, verify_every_n_steps=0)
    record = Record(model)
    t.add_callback(record)
    t.train()
    assert [s["trainable"] for s in record.steps] == [False] * 8 + [True] * 2


def test_with_on_violation_warn_a_drift_is_warned_and_training_goes_on(tmp_path: Path) -> None:
    """The handle warns through the user's channel and watches by ``drift="copy"``."""
    model = Net()
    t = trainer(tmp_path, model, steps=4)
    callback = IsolationTrainerCallback(
        t, IsolationSpec(freeze=["a"]), verify_every_n_steps=1, on_violation="warn", drift="copy"
    )
    seen: list[str] = []

    class Watch(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            assert callback.handle is not None
            seen.append(callback.handle.drift)

    t.add_callback(Watch())
    t.add_callback(Tamper(model, at=2))
    with pytest.warns(IsolationWarning, match=r"'a\.weight'") as caught:
        t.train()
    assert seen == ["copy"] and t.state.global_step == 4
    assert any("at step 2" in str(w.message) for w in caught)


def test_each_thaw_and_each_monitor_due_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = trainer(tmp_path, Net(), steps=4, evaluate=True)
    spec = IsolationSpec(
        freeze=["a"],
        thaw=[
            Thaw("a.weight", lr=0.5, step=1),
            Thaw("a.bias", monitor="eval_loss", mode="max", patience=1, lr=0.5),
        ],
    )
    IsolationTrainerCallback(t, spec, verify_every_n_steps=0)
    with caplog.at_level(logging.INFO, logger="isolate.transformers.callback"):
        t.train()
    said = [r.getMessage() for r in caplog.records if r.name == "isolate.transformers.callback"]
    assert said[:2] == [
        "IsolationTrainerCallback: thawed 'a.weight' (1 parameters) at epoch 0, step 1",
        "IsolationTrainerCallback: 'a.bias' is due: its metric stopped improving",
    ]


def test_applying_with_no_model_or_with_contracts_that_read_named_losses_is_refused(
    tmp_path: Path,
) -> None:
    model = Net()
    callback = IsolationTrainerCallback(trainer(tmp_path, model, steps=1), IsolationSpec())
    with pytest.raises(SpecError) as error:
        callback._apply(None)
    assert str(error.value) == (
        "IsolationTrainerCallback: the Trainer has no model to apply the spec to"
    )
    spec = IsolationSpec(
        freeze=["a"], contracts=[{"kind": "probe", "select": "a", "loss": "probe"}]
    )
    callback = IsolationTrainerCallback(trainer(tmp_path, model, steps=1), spec)
    with pytest.raises(SpecError) as error:
        callback._apply(model)
    assert str(error.value) == (
        "IsolationTrainerCallback: the contracts read the losses ['probe'], but Trainer's "
        "compute_loss returns one loss; check these contracts in a loop that names its losses "
        "(isolate.lightning.IsolationCallback, handle.loop)"
    )
    assert callback.handle is None and model.a.weight.requires_grad  # the spec undone


class Stream(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    """:class:`Data` as a stream of no length: 4 batches a pass."""

    def __iter__(self) -> Any:
        data = Data()
        return (data[i] for i in range(len(data)))


class Epochs(TrainerCallback):
    """``state.epoch`` at each epoch's start."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.starts.append(state.epoch)


def test_an_epoch_thaw_over_a_stream_counts_the_trainers_passes(tmp_path: Path) -> None:
    """With no length, the Trainer takes an epoch for ``max_steps`` batches; a 4-batch stream
    ends each pass early, so ``state.epoch`` is 0.4 when the second pass (epoch 1) begins. The
    thaw counts the Trainer's passes, not ``int(state.epoch)``."""
    model = Net()
    t = Trainer(model=model, args=arguments(tmp_path, steps=10), train_dataset=Stream())
    spec = IsolationSpec(freeze=["a"], thaw=[Thaw("a", lr=0.5, epoch=1)])
    IsolationTrainerCallback(t, spec, verify_every_n_steps=0)
    record, epochs = Record(model), Epochs()
    t.add_callback(record)
    t.add_callback(epochs)
    t.train()
    assert epochs.starts == pytest.approx([0, 0.4, 1.4])
    assert [s["trainable"] for s in record.steps] == [False] * 4 + [True] * 6


def test_attach_takes_a_missing_scheduler_as_none_and_names_itself_for_a_foreign_optimizer(
    tmp_path: Path,
) -> None:
    """A stock Trainer always builds a torch optimizer and a scheduler before
    ``create_scheduler`` returns (its loop steps both); an overridden ``create_scheduler`` may
    leave none, which is no scheduler, not a scheduler ``None``."""
    model = Net()
    t = trainer(tmp_path, model, steps=1)
    spec = IsolationSpec(freeze=["a"], thaw=[Thaw("a", lr=0.5, step=1)])
    callback = IsolationTrainerCallback(t, spec)
    t.state = TrainerState(stateful_callbacks=[callback])  # a fresh run's: no saved state
    try:
        callback._before_optimizer()
        t.create_optimizer()
        held = t.optimizer
        t.optimizer = object()
        with pytest.raises(IsolationTypeError) as error:
            callback._attach(t)
        assert str(error.value) == (
            "IsolationTrainerCallback: optimizer must be a torch.optim.Optimizer, got object; "
            "pass the torch optimizer itself, or a wrapper that holds it in .optimizer"
        )
        t.optimizer = held
        assert t.lr_scheduler is None
        callback._attach(t)
        assert callback._attached
        assert callback._handle().step(epoch=0, step=1) == ["a"]
        assert [len(g["params"]) for g in held.param_groups] == [1, 1, 2]
    finally:
        callback._restore()
    assert model.a.weight.requires_grad


def test_a_scheduler_built_before_the_spec_is_applied_attaches_nothing(tmp_path: Path) -> None:
    """``create_scheduler`` before ``create_optimizer`` (an overridden loop) finds no handle:
    nothing to attach yet, and ``on_train_begin`` then names what was never attached."""
    model = Net()
    t = trainer(tmp_path, model, steps=1)
    callback = IsolationTrainerCallback(t, IsolationSpec(freeze=["a"]))
    callback._after_scheduler()
    assert callback.handle is None and not callback._attached
    assert model.a.weight.requires_grad
