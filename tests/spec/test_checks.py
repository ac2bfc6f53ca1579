"""handle.verify: what each check looked at, and each violation found (a leak, drift, flags,
optimizers), also for replaced buffers, a second backward, and branches run too often."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import isolate
import isolate.spec.checks as checks_module
from isolate import IsolationSpec
from isolate._text import shown
from isolate.drift import snapshot
from isolate.errors import (
    CutOffError,
    DriftError,
    GradientLeakError,
    SpecError,
    StaleCompileError,
)
from isolate.spec.cadence import CHECKS
from isolate.spec.checks import Tally, Verification, check_drift, check_optimizers, check_reach
from tests.spec._models import SPEC, Net

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def test_verify_reports_what_it_checked_and_raises_on_a_leak() -> None:
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    handle.step(epoch=0, step=0)
    _, aux = model(torch.randn(5, 4))
    checked = handle.verify({"aux": aux.sum()})
    assert checked == Verification(
        params=6, losses={"aux": 6}, drift=9, flags=6, optimizers=1, ranks=1
    )
    # The head's loss is not isolated from the (trainable) parts upstream of the branch...
    spec = IsolationSpec(detach=["aux"], protect={"head": ["trunk"]})
    other = Net()
    with spec.applied(other) as h:
        h.step(epoch=0, step=0)
        head, _ = other(torch.randn(5, 4))
        with pytest.raises(
            GradientLeakError,
            match=r"loss 'head' reaches 6 protected parameters \(protect\['head'\]\)",
        ):
            h.verify({"head": head.sum()})
        found = h.verify({"head": head.sum()}, on_violation="warn")
        assert len(found.violations) == 1
    handle.restore()


def test_verify_sees_drift_flags_and_optimizers() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    handle = IsolationSpec(freeze=["trunk"]).apply(model, optimizer=opt)
    with torch.no_grad():
        model.trunk[0].bias[0] += 1.0
    with pytest.raises(
        DriftError, match=r"(?s)frozen tensors moved \(at the check\).*trunk.0.bias"
    ):
        handle.verify(checks=("drift",), when="at the check")
    handle.verify(checks=("drift",))  # reported once, then watched from the new value
    model.trunk[0].weight.requires_grad_(True)
    with pytest.raises(
        DriftError, match=r"1 frozen parameters require grad again: \['trunk.0.weight'\]"
    ):
        handle.verify(checks=("flags",))
    model.trunk[0].weight.requires_grad_(False)
    opt.add_param_group({"params": [model.trunk[0].weight], "weight_decay": 0.1})
    with pytest.raises(
        DriftError, match=r"back in an optimizer that can move them: \['trunk.0.weight"
    ):
        handle.verify(checks=("optimizers",))
    opt.param_groups.pop()
    with pytest.raises(SpecError, match=r"unknown checks \['grads'\]"):
        handle.verify(checks=("grads",))
    handle.restore()


def test_a_replaced_buffer_is_checked_by_its_new_values() -> None:
    # What Lightning's StochasticWeightAveraging does to BatchNorm statistics.
    model = Net()
    with torch.no_grad():
        model.trunk[1].running_mean.fill_(0.5)
    handle = IsolationSpec(freeze=["trunk"]).apply(model)
    model.trunk[1].running_mean = torch.zeros(8)
    with pytest.raises(DriftError, match=r"trunk.1.running_mean  \(buffer\) changed \(size unkn"):
        handle.verify(checks=("drift",))
    handle.restore()
    # With copies, the report also gives the size of the change.
    with torch.no_grad():
        model.trunk[1].running_mean.fill_(0.5)
    handle = IsolationSpec(freeze=["trunk"]).apply(model, drift="copy")
    model.trunk[1].running_mean = torch.zeros(8)
    with pytest.raises(DriftError, match=r"trunk.1.running_mean  \(buffer\) max\|Δ\|=5.000e-01"):
        handle.verify(checks=("drift",))
    handle.restore()


def test_a_second_backward_is_checked_against_the_same_forward() -> None:
    # Manual optimization: backward of the main loss, then verify the auxiliary loss.
    model = Net()
    handle = IsolationSpec(detach=["aux"]).apply(model)
    handle.step(epoch=0, step=0)
    main, aux = model(torch.randn(5, 4))
    main.sum().backward(retain_graph=True)
    checked = handle.verify({"aux": aux.sum()})
    assert checked.losses == {"aux": 6} and not checked.violations
    handle.restore()


def test_a_branch_called_past_the_record_limit_refuses_to_guess() -> None:
    model = Net()
    handle = IsolationSpec(detach=["aux"]).apply(model)
    x = torch.randn(2, 4)
    for _ in range(70):
        _, aux = model(x)
    with pytest.raises(SpecError, match=r"ran more than 64 times since the last step\(\)"):
        handle.verify({"aux": aux.sum()})
    handle.step(epoch=0, step=1)
    _, aux = model(x)
    assert handle.verify({"aux": aux.sum()}).losses == {"aux": 6}
    handle.restore()


def test_the_record_limit_is_64_calls_of_a_branch_per_step() -> None:
    model = Net()
    handle = IsolationSpec(detach=["aux"]).apply(model)
    x = torch.randn(2, 4)
    try:
        for calls in (64, 65):
            handle.step(epoch=0, step=calls)
            for _ in range(calls):
                _, aux = model(x)
            if calls == 64:
                assert handle.verify({"aux": aux.sum()}).losses == {"aux": 6}
            else:
                with pytest.raises(SpecError, match=r"\['aux'\] ran more than 64 times"):
                    handle.verify({"aux": aux.sum()})
    finally:
        handle.restore()


def test_a_check_step_without_the_losses_protect_names_is_refused() -> None:
    model = Net()
    handle = IsolationSpec(detach=["aux"], protect={"aux": ["trunk"]}).apply(model)
    loop = handle.check_every(1)
    try:
        loop.begin_step(epoch=0, step=0)
        main, aux = model(torch.randn(2, 4))
        loop.before_backward(main.sum() + aux.sum())  # no named losses
        with pytest.raises(
            SpecError,
            match=r"protect names the losses \['aux'\], but no named losses were given at step 0",
        ):
            loop.end_step()
    finally:
        handle.restore()


class _Averaging(torch.nn.Module):
    """A layer whose forward in train mode keeps a running average of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.register_buffer("average", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.average.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.linear(x)


class _Counting(torch.nn.Module):
    """A layer without parameters that counts its calls: no part of a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def _stateful() -> torch.nn.Sequential:
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3)
    with torch.no_grad():  # two close singular values: each power iteration still moves u, v
        linear.weight.copy_(torch.diag(torch.tensor([1.0, 0.999, 0.5])))
    spectral = torch.nn.utils.parametrizations.spectral_norm(linear)
    return torch.nn.Sequential(
        spectral, _Averaging(), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1), _Counting()
    )


def _trained(model: torch.nn.Module, spec: IsolationSpec) -> tuple[dict[str, bool], str]:
    """Train two steps under ``spec``: which buffers moved (by brute force: their values
    before and after), and what verify said first ("" if it passed)."""
    before = {n: b.clone() for n, b in model.named_buffers()}
    said = ""
    with spec.applied(model, optimizer=torch.optim.SGD(model[3].parameters(), lr=0.1)) as h:
        for step in range(2):
            h.step(epoch=0, step=step)
            loss = model(torch.randn(8, 3)).sum()
            try:
                h.verify(total=loss)
            except DriftError as error:
                said = said or str(error)
            loss.backward()
    moved = {n: not torch.equal(b, before[n]) for n, b in model.named_buffers()}
    return moved, said


def test_a_buffer_a_frozen_layer_updates_in_train_mode_is_drift() -> None:
    stateful = ["0.parametrizations.weight.0._u", "0.parametrizations.weight.0._v", "1.average"]
    # Held in eval mode by the default: BatchNorm; the spectral norm and the average move.
    # The counter moves too, but it is no part of the frozen layers.
    moved, said = _trained(_stateful(), IsolationSpec(freeze=["0", "1", "2"]))
    assert [n for n, m in moved.items() if m] == [*stateful, "4.calls"]
    assert f"frozen tensors moved (at epoch 0, step 0): {stateful}" in said
    assert "Fix: hold the frozen part in eval mode with mode='eval'" in said
    # bn='train' lets BatchNorm alone train: its statistics move and are not drift.
    moved, said = _trained(_stateful(), IsolationSpec(freeze=["0", "1", "2"], bn="train"))
    assert moved["2.running_mean"] and moved["1.average"]
    assert f"moved (at epoch 0, step 0): {stateful}" in said
    # mode='eval' holds every layer of the frozen part: nothing moves, verify passes.
    moved, said = _trained(_stateful(), IsolationSpec(freeze=["0", "1", "2"], mode="eval"))
    assert [n for n, m in moved.items() if m] == ["4.calls"] and said == ""
    # mode='train' declares that they train: everything moves, nothing is drift.
    moved, said = _trained(_stateful(), IsolationSpec(freeze=["0", "1", "2"], mode="train"))
    assert all(moved.values()) and said == ""
    # A layer with a trainable parameter is not frozen: its buffers may move.
    moved, said = _trained(_stateful(), IsolationSpec(freeze=["0", "1.linear.weight", "2"]))
    assert moved["1.average"] and "1.average" not in said


def test_a_loss_with_nothing_to_be_kept_from_is_refused() -> None:
    model = Net()
    spec = IsolationSpec(detach=["aux"])  # nothing frozen, no protect
    with spec.applied(model) as handle:
        handle.step(epoch=0, step=0)
        features = model.trunk(torch.randn(5, 4))
        # Computed beside the branch, not through it: it reaches the trunk, and no check
        # would know what it must not reach.
        beside = features.pow(2).mean()
        assert beside.grad_fn is not None
        with pytest.raises(
            SpecError,
            match=r"at epoch 0, step 0, loss 'aux' has no parameter to be kept from: the detach "
            r"branches \['aux'\] did not run with inputs that require grad, nothing is frozen",
        ):
            handle.verify({"aux": beside})
        # Through the branch, the trunk is upstream of its input: checked, and isolated.
        _, aux = model(torch.randn(5, 4))
        assert handle.verify({"aux": aux.sum()}).losses == {"aux": 6}  # the trunk's 6 tensors


def test_a_branch_called_around_its_wrapper_is_found_from_the_total_loss() -> None:
    model = Net()
    with IsolationSpec(detach=["aux"]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        features = model.trunk(torch.randn(5, 4))
        main, aux = model.head(features).sum(), model.aux.module(features).sum()
        # No named loss: the total is the one sign that the branch's input was not detached.
        with pytest.raises(
            GradientLeakError,
            match=r"step 0, the total loss reaches the parameters of the detach branch 'aux' "
            r"\['aux.weight', 'aux.bias'\], but its Detached wrapper did not run",
        ):
            handle.verify(total=main + aux)
        # Named as well, it is reported once, by the named loss.
        found = handle.verify({"aux": aux}, total=main + aux, on_violation="warn")
        assert len(found.violations) == 1
        assert "step 0, loss 'aux' reaches the parameters of the detach" in found.violations[0]
        # On a step that does not record the branches, a wrapper that ran is no false alarm.
        handle.step(epoch=0, step=1, record=False)
        features = model.trunk(torch.randn(5, 4))
        handle.verify(total=model.head(features).sum() + model.aux(features).sum())
        # Through the wrapper, the total loss is fine.
        handle.step(epoch=0, step=2)
        features = model.trunk(torch.randn(5, 4))
        handle.verify(total=model.head(features).sum() + model.aux(features).sum())


def test_the_tally_says_each_loss_each_contract_and_a_check_of_its_own() -> None:
    tally = Tally()
    tally.add(Verification(losses={"probe": 4, "aux": 2}, contracts={"t": 3, "p": 1}), CHECKS)
    tally.add(Verification(flags=6), ("flags", "mine"))
    tally.add(Verification(reach=1, ranks=2), ("reach", "ranks"))
    assert str(tally) == (
        "verify ran 3 times; every check passed:\n"
        "  params (1x): 0 parameters of the spec were still the objects the model holds (none "
        "replaced)\n"
        "  losses (1x): 'probe' reached none of the 4 parameters it must not reach; 'aux' "
        "reached none of the 2 parameters it must not reach\n"
        "  drift (1x): 0 frozen tensors (parameters, buffers of the frozen part) unchanged "
        "since frozen\n"
        "  flags (2x): 6 frozen parameters still had requires_grad=False\n"
        "  optimizers (1x): 0 optimizer(s) held no frozen parameter\n"
        "  contracts (1x): contract 't' held (3 clause checks); contract 'p' held (1 clause "
        "checks)\n"
        "  mine (1x): passed\n"
        "  reach (1x): the loss backpropagated reached each of 1 trainable parameters\n"
        "  ranks (1x): 2 process(es) held the same frozen tensors"
    )


def test_a_parameter_expected_unused_is_not_reported_as_cut_off() -> None:
    model = Net()
    handle = IsolationSpec(freeze=["trunk"]).apply(model)
    try:
        handle.step(epoch=0, step=0)
        head, _ = model(torch.randn(5, 4))
        with pytest.raises(
            CutOffError,
            match=r"^IsolationSpec: at epoch 0, step 0, 2 of 4 trainable parameters get no "
            r"gradient from any loss:\n  aux\.weight, aux\.bias: .*\nFix: connect them to the loss",
        ):
            handle.verify(total=head.sum(), checks=("reach",))
        head, _ = model(torch.randn(5, 4))
        checked = handle.verify(total=head.sum(), expected_unused=["aux"], checks=("reach",))
        assert checked.reach == 4 and checked.violations == ()  # the head's and aux's
    finally:
        handle.restore()


def test_a_stale_compiled_region_is_reported_with_the_parameters_it_hides_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = Net()
    hidden = (model.trunk[3].weight, "not a tensor", model.trunk[3].bias)

    def stale(*args: object, **kwargs: object) -> None:
        error = StaleCompileError("the region was compiled before the thaw")
        error.tensors = hidden
        raise error

    monkeypatch.setattr(checks_module, "cut_off_parameters", stale)
    reached, found = check_reach(model, torch.zeros(()), (), "at step 3", "C")
    assert reached == 0 and [type(e) for e in found] == [StaleCompileError]
    assert str(found[0]) == (
        "C: at step 3, ['trunk.3.weight', 'trunk.3.bias'] get no gradient: the region was "
        "compiled before the thaw"
    )
    assert found[0].tensors is hidden  # type: ignore[attr-defined]


def test_frozen_parameters_back_in_any_optimizer_are_named_with_every_reason() -> None:
    model = Net()
    weight, bias = model.trunk[0].weight, model.trunk[0].bias
    weight.requires_grad_(False)
    model.head.weight.requires_grad_(False)  # frozen by someone else: not the spec's business
    clean = torch.optim.SGD(model.aux.parameters(), lr=0.1)
    back = torch.optim.ASGD([weight, model.head.weight, bias], lr=0.1, weight_decay=0.1)
    bias.requires_grad_(False)
    found = check_optimizers(
        {"trunk.0.weight": weight, "trunk.0.bias": bias}, [clean, back], "at step 2", "C"
    )
    reasons = (
        "weight_decay=0.1 shrinks it on every step; lambd=0.0001 (ASGD) shrinks it on every step"
    )
    assert [type(e) for e in found] == [DriftError]
    assert str(found[0]) == (
        "C: at step 2, frozen parameters are back in an optimizer that can move them: "
        f"['trunk.0.weight (optimizer 1, group 0: {reasons})', 'trunk.0.bias (optimizer 1, "
        f"group 0: {reasons})']; something added them after the spec was applied. Thaw them "
        "with a Thaw step instead"
    )


def test_drift_names_eight_moves_says_why_a_buffer_moves_and_reports_each_move_once() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1, 1) for _ in range(4)), torch.nn.BatchNorm1d(1))
    names = [n for n, _ in model.named_parameters()] + ["4.running_mean"]
    watched = snapshot(model, names=names, drift="copy")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model[4].running_mean.add_(0.5)
    found, renewed = check_drift(watched, "at step 1", "C")
    lines = [f"  {n:<14}  (parameter) max|Δ|=1.000e+00" for n in names[:8]]
    assert str(found[0]) == (
        f"C: frozen tensors moved (at step 1): {shown(names)}\n"
        + "\n".join(lines)
        + "\nA frozen layer's forward in train mode updates its buffers (BatchNorm's running "
        "statistics, spectral norm's vectors, a running average). Fix: hold the frozen part "
        "in eval mode with mode='eval', or let its layers train with mode='train' "
        "(bn='train' for BatchNorm alone). A buffer that moves in either mode (a step counter, "
        "a quantization observer) means its layer is not frozen: leave the layer out of freeze"
    )
    assert check_drift(renewed, "at step 2", "C") == ([], renewed)  # each move once
    with torch.no_grad():
        model[0].bias.add_(1.0)
    again, _ = check_drift(renewed, "at step 3", "C")
    assert str(again[0]).startswith("C: frozen tensors moved (at step 3): ['0.bias']\n")


class _Contracts:
    """A stand-in for the handle's contracts: records what each check hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def check(self, *args: object, **kwargs: object) -> tuple[dict[str, int], list[object]]:
        self.calls.append((*args, kwargs))
        return {"t": 1}, []


def test_the_contracts_get_the_losses_as_a_list_and_the_state_clauses_unless_before_a_step() -> (
    None
):
    loss, other = torch.ones(()), torch.zeros(())
    optimizers = [torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)]
    contracts = _Contracts()
    for total, checks in [
        (loss, ("losses",)),  # the check before backward: the step has not moved anything yet
        ([loss, other], ("losses", "drift")),
        (None, ("contracts",)),
    ]:
        kept, found = checks_module._check_contracts(  # type: ignore[arg-type]
            contracts, {"aux": loss}, total, optimizers, checks, "at step 1"
        )
        assert (kept, found) == ({"t": 1}, [])
    assert contracts.calls == [
        ({"aux": loss}, [loss], optimizers, "at step 1", {"state": False}),
        ({"aux": loss}, [loss, other], optimizers, "at step 1", {"state": True}),
        ({"aux": loss}, None, optimizers, "at step 1", {"state": True}),
    ]


def test_verify_counts_only_the_checks_it_ran() -> None:
    model = Net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    handle = IsolationSpec(freeze=["trunk"]).apply(model, optimizer=opt)
    try:
        assert handle.verify(checks=("flags",)) == Verification(flags=6)
    finally:
        handle.restore()


def test_a_replaced_parameter_stops_every_check_but_the_ranks_exchange(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exchanged: list[tuple[object, ...]] = []
    other_rank = DriftError("rank 1: trunk.0.weight differs")

    def exchange(names: Any, when: str, caller: str, found: list[object]) -> list[object]:
        exchanged.append((list(names)[:2], when, caller, [type(e).__name__ for e in found]))
        return [other_rank]

    world = [1]
    monkeypatch.setattr(checks_module, "world_size", lambda: world[0])
    monkeypatch.setattr(checks_module, "check_ranks", exchange)
    model = Net()
    handle = IsolationSpec(freeze=["trunk"]).apply(model)
    try:
        assert handle.verify(checks=("ranks",)).ranks == 1  # one process: nothing to exchange
        world[0] = 2  # as on each of two ranks
        assert handle.verify(checks=("flags",)).ranks == 1  # the exchange was not asked for
        assert exchanged == []
        model.trunk[0].weight = torch.nn.Parameter(model.trunk[0].weight.detach().clone())
        with pytest.warns(isolate.IsolationWarning):
            checked = handle.verify(checks=("params", "flags", "ranks"), on_violation="warn")
        assert checked.ranks == 2 and checked.flags == 0  # flags not checked after params
        assert [v.split(",")[0] for v in checked.violations] == [
            "IsolationSpec: at epoch 0",
            "rank 1: trunk.0.weight differs",
        ]
        assert exchanged == [
            (
                ["trunk.0.weight", "trunk.0.bias"],
                "at epoch 0, step 0",
                "IsolationSpec",
                ["ReplacedParameterError"],  # the other ranks learn of it
            )
        ]
    finally:
        handle.restore()


@pytest.mark.parametrize(
    ("check", "start"),
    [
        ("drift", "IsolationSpec: frozen tensors moved (at epoch 0, step 0): ['trunk.0.weight']"),
        ("flags", "IsolationSpec: at epoch 0, step 0, 1 frozen parameters require grad again"),
        ("optimizers", "IsolationSpec: at epoch 0, step 0, frozen parameters are back in an"),
    ],
)
def test_each_violation_of_verify_says_who_checked_and_when(check: str, start: str) -> None:
    model = Net()
    handle = IsolationSpec(freeze=["trunk"]).apply(model)
    weight = model.trunk[0].weight
    try:
        handle.step(epoch=0, step=0)
        if check == "drift":
            with torch.no_grad():
                weight.add_(1.0)
        elif check == "flags":
            weight.requires_grad_(True)
        else:
            opt = torch.optim.SGD(model.head.parameters(), lr=0.1, weight_decay=0.1)
            handle.attach(opt)
            opt.add_param_group({"params": [weight]})
        with pytest.raises(DriftError) as caught:
            handle.verify(checks=(check,))
        assert str(caught.value).startswith(start)
    finally:
        weight.requires_grad_(False)
        handle.restore()


class _Counter(torch.nn.Module):
    """A layer without parameters whose buffer counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def test_the_buffers_of_a_layer_without_parameters_outside_the_frozen_part_may_move() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), _Counter(), torch.nn.Linear(2, 1))
    handle = IsolationSpec(freeze=["0"]).apply(model)
    try:
        handle.step(epoch=0, step=0)
        model(torch.randn(3, 2))
        assert handle.verify(checks=("drift",)) == Verification(drift=2)  # 0.weight, 0.bias
    finally:
        handle.restore()


class _Block(torch.nn.Module):
    """A layer that reads its mode, around a Linear with a buffer of its own (that does not)."""

    isolate_reads_training = True

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)
        self.inner.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.inner.scale


def test_under_mode_train_the_buffers_of_what_a_held_layer_holds_stay_watched() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), torch.nn.Linear(2, 1))
    handle = IsolationSpec(freeze=["0"], mode="train").apply(model)
    try:
        handle.step(epoch=0, step=0)
        with torch.no_grad():
            model[0].inner.scale.mul_(2.0)
        with pytest.raises(
            DriftError, match=r"frozen tensors moved \(at epoch 0, step 0\): \['0\.inner\.scale'\]"
        ):
            handle.verify(checks=("drift",))
    finally:
        handle.restore()
