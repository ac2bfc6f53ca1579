"""The check schedule of a loop: which checks are due at each call, and how messages say when."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from isolate import IsolationSpec, Thaw
from isolate.errors import ContractError, IsolationTypeError, SpecError
from isolate.spec.cadence import Cadence, Due
from tests.spec._models import two_layers

AFTER_STEP = ("params", "drift", "flags", "optimizers", "contracts", "ranks")


def loss() -> torch.Tensor:
    weight = torch.ones(2, requires_grad=True)
    return (weight * 2).sum()


def test_a_check_step_checks_the_named_losses_then_everything_after_the_step() -> None:
    cadence = Cadence(every=2)
    total = loss()
    cadence.begin(4, [], epoch=1)
    assert cadence.checking
    assert cadence.before_backward(total, None) == Due((), "")
    due = cadence.before_backward(total, {"aux": total})
    assert due == Due(("losses", "contracts"), "at step 4")
    end = cadence.end({"aux": ["trunk"]}, "caller")
    assert end.checks == ("reach", *AFTER_STEP)
    assert end.when == "at step 4"
    assert len(end.total) == 2 and all(t is total for t in end.total)
    assert end.kept == {}
    assert cadence.checking is False
    # The step's state is cleared: a loss given before the next begin is not kept.
    assert cadence.before_backward(loss(), {"aux": total}) == Due((), "")
    assert cadence.end(None, "caller") == Due((), "at step 4")
    # The step's state is cleared: the next step that is not a check step has nothing due.
    cadence.begin(5, [], epoch=1)
    assert not cadence.checking
    assert cadence.before_backward(loss(), {"aux": total}) == Due((), "")
    assert cadence.end({"aux": ["trunk"]}, "caller") == Due((), "at step 5")


def test_every_zero_checks_only_what_a_thaw_needs() -> None:
    cadence = Cadence(every=0)
    cadence.begin(0, [], epoch=0)
    assert not cadence.checking
    cadence.before_backward(loss(), None)
    assert cadence.end(None, "caller") == Due((), "at step 0")


def test_the_step_a_group_thaws_is_reached_and_the_ranks_agree_after_it() -> None:
    cadence = Cadence(every=3)
    total = loss()
    cadence.begin(7, ["g", "h"], epoch=2)
    assert not cadence.checking
    assert cadence.before_backward(total, {"aux": total}) == Due((), "")
    due = cadence.end(None, "caller")
    assert due.checks == ("reach", "ranks")
    assert due.when == "at step 7"
    assert len(due.total) == 1 and due.total[0] is total
    # Without a loss to walk, the thaw's ranks check says which thaw it follows.
    cadence.begin(8, ["k"], epoch=3)
    assert cadence.end(None, "caller") == Due(("ranks",), "after thawing ['k'] (epoch 3, step 8)")
    # Once said, the thaw is not repeated on the next step.
    cadence.begin(10, [], epoch=3)
    assert cadence.end(None, "caller") == Due((), "at step 10")


def test_a_thaw_on_a_check_step_adds_nothing_to_the_checks() -> None:
    cadence = Cadence(every=1)
    cadence.begin(2, ["g"], epoch=0)
    cadence.before_backward(loss(), None)
    due = cadence.end(None, "caller")
    assert due.checks == ("reach", *AFTER_STEP)
    assert due.when == "at step 2"


@pytest.mark.parametrize(
    ("protect", "contracts", "what", "names"),
    [
        ({"aux": ["trunk"]}, ("main",), "protect names", "['aux', 'main']"),
        (None, ("main", "aux"), "the contracts read", "['aux', 'main']"),
    ],
)
def test_a_check_step_without_named_losses_is_refused_with_the_hint(
    protect: Any, contracts: tuple[str, ...], what: str, names: str
) -> None:
    cadence = Cadence(every=2, losses_hint="none at step {step}; pass them")
    cadence.begin(6, [], epoch=0)
    cadence.before_backward(loss(), None)
    with pytest.raises(SpecError) as caught:
        cadence.end(protect, "fit()", contracts)
    assert str(caught.value) == f"fit(): {what} the losses {names}, but none at step 6; pass them"


def test_the_default_hint_says_how_to_pass_the_losses() -> None:
    cadence = Cadence(every=1)
    cadence.begin(3, [], epoch=0)
    with pytest.raises(SpecError) as caught:
        cadence.end({"aux": []}, "fit()")
    assert str(caught.value) == (
        "fit(): protect names the losses ['aux'], but no named losses were given at step 3; "
        "pass them to before_backward(loss, losses={'name': loss_tensor})"
    )


def test_named_losses_seen_once_on_a_check_step_count_for_its_repeated_begins() -> None:
    # Accumulated micro-batches begin the same optimizer step again: the losses given on the
    # first still count, and a later check step needs its own.
    cadence = Cadence(every=2)
    cadence.begin(2, [], epoch=0)
    total = loss()
    cadence.before_backward(total, {"aux": total})
    cadence.end({"aux": []}, "fit()")
    cadence.begin(2, [], epoch=0)
    cadence.before_backward(loss(), None)
    assert cadence.end({"aux": []}, "fit()").when == "at step 2"
    cadence.begin(4, [], epoch=0)
    with pytest.raises(SpecError, match="at step 4"):
        cadence.end({"aux": []}, "fit()")
    # Nothing named and no contracts: nothing to refuse.
    cadence.begin(4, [], epoch=0)
    assert cadence.end({}, "fit()", ()).checks == AFTER_STEP


@pytest.mark.parametrize(
    ("every", "on_violation", "message"),
    [
        (True, "raise", "got True"),
        (1.0, "raise", "got 1.0"),
        ("2", "raise", "got '2'"),
        (-1, "raise", "got -1"),
        (1, "log", "on_violation must be 'raise' or 'warn', got 'log'"),
    ],
)
def test_a_schedule_that_cannot_work_is_refused_naming_the_option(
    every: Any, on_violation: Any, message: str
) -> None:
    with pytest.raises(SpecError) as caught:
        Cadence.checked(every, None, on_violation, "fit()")
    text = str(caught.value)
    assert text.startswith("fit(): ") and text.endswith(message)
    if "on_violation" not in message:
        assert "verify_every_n_steps must be an integer >= 0 (0 turns checks off)" in text


def test_a_checked_cadence_keeps_its_options() -> None:
    cadence = Cadence.checked(0, "head", "warn", "fit()")
    assert (cadence.every, cadence.expected_unused, cadence.on_violation) == (0, ("head",), "warn")
    cadence = Cadence.checked(5, ["a", "b"], "raise", "fit()")
    assert (cadence.expected_unused, cadence.on_violation) == (("a", "b"), "raise")
    with pytest.raises(SpecError, match=r"^fit\(\): expected_unused must be a list"):
        Cadence.checked(1, [3], "raise", "fit()")


class Recorder:
    """The handle's verify, recorded on the way through."""

    def __init__(self, handle: Any) -> None:
        self.calls: list[dict[str, Any]] = []
        self.verify = handle.verify

    def __call__(self, losses: Any = None, **kwargs: Any) -> Any:
        self.calls.append({"losses": losses, **kwargs})
        return self.verify(losses, **kwargs)


def handle_with_a_recorder(**spec: Any) -> tuple[Any, Any, torch.nn.Module, Recorder]:
    model = two_layers()
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)  # layer 0 is frozen by every spec
    handle = IsolationSpec(**spec).apply(model, opt)
    recorder = Recorder(handle)
    handle.verify = recorder
    return handle, opt, model, recorder


def test_a_loop_verifies_before_a_thaw_on_the_step_and_at_the_end() -> None:
    handle, opt, model, recorder = handle_with_a_recorder(
        freeze=["0"], thaw=[Thaw("0", step=1, lr=0.1)], detach=[]
    )
    loop = handle.check_every(2, expected_unused=["1.bias"], on_violation="warn")
    seen = []
    for step in range(3):
        thawed = loop.begin_step(epoch=0, step=step)
        seen.append((thawed, loop.checking))
        total = model(torch.randn(4, 2)).sum()
        loop.before_backward(total)
        total.backward()
        opt.step()
        opt.zero_grad()
        loop.end_step()
    loop.finish()
    assert seen == [([], True), (["0"], False), ([], True)]
    said = [(c["checks"], c["when"]) for c in recorder.calls]
    assert said == [
        (("reach", *AFTER_STEP), "at step 0"),
        (("params", "drift", "ranks"), "before thawing ['0'] (epoch 0, step 1)"),
        (("reach", "ranks"), "at step 1"),
        (("reach", *AFTER_STEP), "at step 2"),
        (("params", "drift", "contracts", "ranks"), "at the end of training"),
    ]
    for call in recorder.calls:
        assert call["expected_unused"] == ("1.bias",)
        assert call["on_violation"] == "warn"
        assert call["losses"] is None
    assert [c["total"] is None for c in recorder.calls] == [False, True, False, False, True]
    assert all(len(c["total"]) == 1 for c in recorder.calls if c["total"] is not None)
    assert handle.position["global_step"] == 2
    handle.restore()


def test_groups_thawed_before_an_armed_step_are_reached_on_it() -> None:
    # At an epoch's start (arm=False) a group thaws; the step armed next reaches it.
    thaw = Thaw("0", epoch=1, lr=0.1)
    handle, _, model, recorder = handle_with_a_recorder(freeze=["0"], thaw=[thaw])
    loop = handle.check_every(0)
    assert loop.begin_step(epoch=1, step=0, arm=False) == ["0"]
    assert not loop.checking
    assert loop.begin_step(epoch=1, step=0) == []
    total = model(torch.randn(4, 2)).sum()
    loop.before_backward(total)
    total.backward()
    loop.end_step()
    said = [(c["checks"], c["when"]) for c in recorder.calls]
    assert said == [
        (("params", "drift", "ranks"), "before thawing ['0'] (epoch 1, step 0)"),
        (("reach", "ranks"), "at step 0"),
    ]
    # The next armed step has no thaw left to reach.
    loop.begin_step(epoch=1, step=1)
    loop.end_step()
    assert len(recorder.calls) == 2
    handle.restore()


def test_a_thaw_on_a_step_without_a_loss_says_which_thaw_the_ranks_check_follows() -> None:
    thaws = [Thaw("0", epoch=2, lr=0.1)]
    handle, _, _, recorder = handle_with_a_recorder(freeze=["0"], thaw=thaws)
    loop = handle.check_every(0)
    loop.begin_step(epoch=2, step=5, arm=False)
    loop.begin_step(epoch=2, step=5)
    loop.end_step()
    assert [(c["checks"], c["when"]) for c in recorder.calls] == [
        (("params", "drift", "ranks"), "before thawing ['0'] (epoch 2, step 5)"),
        (("ranks",), "after thawing ['0'] (epoch 2, step 5)"),
    ]
    handle.restore()


def train_steps(loop: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` training steps of epoch 0 through the handle's loop, no named losses."""
    for step in range(steps):
        loop.begin_step(epoch=0, step=step)
        total = model(torch.randn(4, 2)).sum()
        loop.before_backward(total, {})
        total.backward()
        opt.step()
        loop.end_step()


def test_windows_closed_at_the_start_of_a_step_are_reported_after_the_step_before() -> None:
    contract = {"kind": "trains", "select": "1", "within": 1}
    handle, opt, model, recorder = handle_with_a_recorder(contracts=[contract])
    loop = handle.check_every(2)
    train_steps(loop, model, opt, 2)
    # The window opened at step 0 closed as step 1 began: reported then, about step 0.
    assert [(c["checks"], c["when"]) for c in recorder.calls] == [
        (("reach", *AFTER_STEP), "at step 0"),
        (("contracts",), "after step 0"),
    ]
    assert handle.contracts.verdicts["trains:1"]["clauses"]["changes within 1 step(s)"] == {
        "checked": 1,
        "violated": 0,
        "first": None,
    }
    handle.restore()


def test_named_losses_are_checked_before_backward_on_a_check_step_only() -> None:
    handle, _, model, recorder = handle_with_a_recorder(freeze=["0"], protect={"aux": ["0"]})
    loop = handle.check_every(2)
    for step in range(2):
        loop.begin_step(epoch=0, step=step)
        total = model(torch.randn(4, 2)).sum()
        losses = {"aux": total}
        loop.before_backward(total, losses)
        if step == 0:
            assert recorder.calls[-1]["checks"] == ("losses", "contracts")
            assert recorder.calls[-1]["when"] == "at step 0"
            assert recorder.calls[-1]["losses"] is losses
            assert recorder.calls[-1]["total"] is None
        total.backward()
        loop.end_step()
    assert [c["checks"][0] for c in recorder.calls] == ["losses", "reach"]
    # A check step whose named losses never came is refused in the handle's name.
    loop.begin_step(epoch=0, step=2)
    with pytest.raises(SpecError) as caught:
        loop.end_step()
    assert str(caught.value).startswith(
        f"{handle.caller}: protect names the losses ['aux'], but no named losses were given "
        "at step 2"
    )
    handle.restore()


@pytest.mark.parametrize(
    ("loss", "losses", "wrong"),
    [
        ("zero", "lone", "losses must be a mapping of loss name -> loss tensor, got Tensor"),
        ("sum", "vector", "losses must be a mapping of loss name -> loss tensor, got Tensor"),
        ("sum", "metric", "losses must be a mapping of loss name -> loss tensor, got dict"),
        ("float", None, "loss must be the loss tensor about to be backpropagated, got float"),
    ],
)
def test_a_loss_or_losses_of_the_wrong_kind_are_refused_whatever_their_value(
    loss: str, losses: str | None, wrong: str
) -> None:
    """A lone tensor in place of the mapping was read for its truth: a loss of 0 skipped the
    check of named losses, a per-sample vector raised inside torch."""
    handle, _, model, recorder = handle_with_a_recorder(freeze=["0"], protect={"aux": ["0"]})
    loop = handle.check_every(1)
    loop.begin_step(epoch=0, step=0)
    out = model(torch.randn(4, 2))
    total = {"zero": out.sum() * 0, "sum": out.sum(), "float": 1.0}[loss]
    given = {
        None: None,
        "lone": total,
        "vector": out.squeeze(-1),
        "metric": {"aux": out.sum(), "accuracy": 0.5},
    }[losses]
    with pytest.raises(IsolationTypeError) as caught:
        loop.before_backward(total, given)  # type: ignore[arg-type]
    assert str(caught.value).startswith(
        f"{handle.caller}: loop.before_backward(loss, losses): {wrong}"
    )
    assert recorder.calls == []
    handle.restore()


def test_a_check_step_without_the_losses_a_contract_reads_is_refused() -> None:
    contract = {"kind": "stop_gradient", "loss": "probe", "blocked": "0"}
    handle, _, model, _ = handle_with_a_recorder(contracts=[contract])
    loop = handle.check_every(1)
    loop.begin_step(epoch=0, step=0)
    loop.before_backward(model(torch.randn(4, 2)).sum())
    with pytest.raises(SpecError) as caught:
        loop.end_step()
    assert str(caught.value).startswith(
        f"{handle.caller}: the contracts read the losses ['probe'], but no named losses"
    )
    handle.restore()


@pytest.mark.parametrize(("steps", "fails"), [(1, False), (2, True)])
def test_the_end_of_training_closes_the_windows_due_after_the_last_step(
    steps: int, fails: bool
) -> None:
    # A window of 2 steps opened at step 0 is due once 2 steps are taken, not after 1.
    model = two_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # nothing moves
    spec = IsolationSpec(contracts=[{"kind": "trains", "select": "1", "within": 2}])
    with spec.applied(model, opt) as handle:
        loop = handle.check_every(1)
        train_steps(loop, model, opt, steps)
        if not fails:
            loop.finish()
            return
        with pytest.raises(ContractError) as caught:
            loop.finish()
    assert "at the end of training" in str(caught.value)
    assert "did not change from step 0 to step 2" in str(caught.value)


def test_the_step_guard_watches_each_optimizer_once_and_leaves_with_the_handle() -> None:
    model = two_layers()
    other = torch.nn.Parameter(torch.ones(1))
    opts = [torch.optim.SGD(model[1].parameters(), lr=0.1), torch.optim.SGD([other], lr=0.1)]
    thaw = Thaw("0", step=1, lr=0.1, optimizer_idx=0)
    handle = IsolationSpec(freeze=["0"], thaw=[thaw]).apply(model)
    handle.attach(opts)
    handle.attach(opts)  # the same optimizers again: nothing more to watch
    try:
        assert [len(o._optimizer_step_pre_hooks) for o in opts] == [1, 1]
        for opt in opts:
            with pytest.raises(SpecError, match=r"^IsolationSpec: SGD\.step\(\) with thaw groups"):
                opt.step()
    finally:
        handle.restore()
    assert [len(o._optimizer_step_pre_hooks) for o in opts] == [0, 0]
    for opt in opts:
        opt.step()  # the guard left with the handle
