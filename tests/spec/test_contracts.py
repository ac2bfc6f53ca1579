"""Contracts in the spec: validated as data, and each clause checked against what a real
backward, a real optimizer step or autograd says."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import isolate
from isolate.errors import BlindSpotError, ContractError, IsolationError, SpecError
from isolate.spec import IsolationSpec
from isolate.spec.contracts import Contract, contracts_of


def net() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "trunk": nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.2)),
            "head": nn.Linear(8, 3),
            "probe": isolate.Detached(nn.Linear(8, 3)),
        }
    )


def step(
    model: nn.ModuleDict, loop: object, opt: torch.optim.Optimizer, i: int, **kw: object
) -> None:
    """One step of the loop on ``net()``: main and probe losses."""
    loop.begin_step(epoch=0, step=i)  # type: ignore[attr-defined]
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    features = model["trunk"](x)
    main = F.cross_entropy(model["head"](features), y)
    probe = F.cross_entropy(model["probe"](features), y)
    loop.before_backward(main + probe, {"main": main, "probe": probe})  # type: ignore[attr-defined]
    (main + probe).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loop.end_step()  # type: ignore[attr-defined]


# -- data ------------------------------------------------------------------------------------


def test_contracts_are_plain_data_that_round_trips() -> None:
    spec = IsolationSpec.from_dict(
        {
            "freeze": ["trunk"],
            "mode": "eval",
            "contracts": [
                {"kind": "teacher", "select": "trunk"},
                {"kind": "probe", "select": ["probe"], "loss": "probe", "within": 2},
                {"kind": "ema", "target": "t", "online": "o", "decay": 0.99, "integers": "keep"},
            ],
        }
    )
    assert [c.name for c in spec.contracts] == ["teacher:trunk", "probe:probe", "ema:t"]
    assert spec.contracts[1].select == ("probe",) and spec.contracts[1].steps == 2
    assert IsolationSpec.from_dict(spec.to_dict()) == spec
    moved = spec.prefixed("net")
    assert moved.contracts[0].select == ("net.trunk",) and moved.contracts[2].online == "net.o"
    trains = Contract("trains", select=("trunk", "!trunk.1", "type:BatchNorm1d"), within=1)
    assert trains.prefixed("net").select == ("net.trunk", "!net.trunk.1", "net/type:BatchNorm1d")
    assert repr(spec).endswith("mode='eval', contracts=['teacher:trunk', 'probe:probe', 'ema:t'])")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"kind": "teachr", "select": "a"}, r"unknown kind 'teachr' \(did you mean 'teacher'\?\)"),
        ({"kind": "probe", "selct": "a", "loss": "p"},
         r"unknown keys \['selct'\] \(did you mean 'selct' -> 'select'\?\)"),
        ({"kind": "ema", "target": "a", "online": "b"}, r"an ema contract needs \['decay'\]"),
        ({"kind": "ema", "target": "a", "online": "b", "decay": 1.0},
         r"decay must be a number in \(0, 1\)"),
        ({"kind": "reversal", "loss": "d", "features": "f", "classifier": "c", "scale": -0.1},
         r"scale must be a number > 0"),
        ({"kind": "trains", "select": "a", "within": 0}, r"within must be an integer >= 1"),
        ({"kind": "ema", "target": "a", "online": "b", "decay": 0.9, "integers": "round"},
         r"integers must be 'copy' or 'keep'"),
        ({"kind": "teacher", "select": "a", "loss": "x"}, r"unknown keys \['loss'\]"),
        ("teacher", r"a contract is a mapping with a kind"),
    ],
)  # fmt: skip
def test_a_bad_contract_is_refused_when_the_spec_is_built(entry: object, message: str) -> None:
    with pytest.raises(SpecError, match=r"^IsolationSpec: contracts\[0\]:? .*" + message):
        IsolationSpec(contracts=[entry])  # type: ignore[list-item]


def test_a_bad_contract_built_alone_names_the_contract() -> None:
    unknown = r"unknown kind 'teachr' \(did you mean 'teacher'\?\)"
    with pytest.raises(SpecError, match=rf"^Contract: {unknown}"):
        Contract(kind="teachr", select="a")
    with pytest.raises(SpecError, match=rf"^Contract: {unknown}"):
        Contract.from_dict({"kind": "teachr", "select": "a"})
    with pytest.raises(SpecError, match=r"^Contract: a contract is a mapping with a kind"):
        Contract.from_dict("teacher")
    with pytest.raises(SpecError, match=rf"^Contract 'mine': {unknown}"):
        Contract(kind="teachr", select="a", name="mine")


def test_contracts_must_be_a_list_with_distinct_names() -> None:
    with pytest.raises(SpecError, match=r"contracts must be a list of contracts"):
        IsolationSpec(contracts={"kind": "teacher", "select": "a"})  # type: ignore[arg-type]
    twice = [{"kind": "teacher", "select": "a"}, {"kind": "teacher", "select": "a"}]
    with pytest.raises(SpecError, match=r"contracts share the names \['teacher:a'\]"):
        IsolationSpec(contracts=twice)


def test_a_contract_read_from_data_is_refused_in_the_name_it_was_read_under() -> None:
    kinds = "['ema', 'probe', 'reversal', 'stop_gradient', 'teacher', 'trains']"
    unknown = f"unknown kind 'teachr' (did you mean 'teacher'?); the kinds are {kinds}"
    with pytest.raises(SpecError) as raised:
        Contract.from_dict({"select": "a"})
    assert str(raised.value) == (
        f"Contract: a contract is a mapping with a kind ({kinds}) and its keys, got "
        "{'select': 'a'}"
    )
    with pytest.raises(SpecError) as raised:
        Contract.from_dict({"kind": "teachr", "select": "a", "name": "mine"})
    assert str(raised.value) == f"Contract 'mine': {unknown}"
    with pytest.raises(SpecError) as raised:
        IsolationSpec(contracts=[{"kind": "teachr", "select": "a"}])
    assert str(raised.value) == f"IsolationSpec: contracts[0]: {unknown}"


@pytest.mark.parametrize("value", ["teacher", 5, {"kind": "teacher", "select": "a"}])
def test_contracts_that_are_no_list_are_refused_with_their_type(value: object) -> None:
    with pytest.raises(SpecError) as raised:
        contracts_of(value, "Here")
    assert str(raised.value) == (
        "Here: contracts must be a list of contracts (mappings with a kind), got "
        f"{type(value).__name__}"
    )


def test_a_contract_error_is_an_isolation_error_and_an_assertion() -> None:
    assert issubclass(ContractError, IsolationError) and issubclass(ContractError, AssertionError)


def test_selectors_are_resolved_when_the_spec_is_applied_and_nothing_changes_on_error() -> None:
    model = net()
    spec = IsolationSpec(freeze=["trunk"], contracts=[{"kind": "teacher", "select": "trnk"}])
    with pytest.raises(isolate.errors.SelectorError, match=r"'trnk' matched no parameter"):
        spec.apply(model)
    assert all(p.requires_grad for p in model.parameters())
    bad = IsolationSpec(
        contracts=[{"kind": "ema", "target": "head", "online": "trunk", "decay": 0.9}]
    )
    with pytest.raises(SpecError, match=r"hold different tensors: only the target has"):
        bad.apply(model)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"kind": "zzz"}, "Contract: unknown kind 'zzz'; the kinds are "
         "['ema', 'probe', 'reversal', 'stop_gradient', 'teacher', 'trains']"),
        ({"kind": "probe", "select": "p"},
         "Contract: a probe contract needs ['loss']; its keys are ['select', 'loss', 'within', "
         "'name']"),
        ({"kind": "teacher", "select": "t", "loss": "x"},
         "Contract: a teacher contract has no keys ['loss']; its keys are ['select', 'name']"),
        ({"kind": "teacher", "select": "t", "integers": "keep"},
         "Contract: a teacher contract has no keys ['integers']; its keys are ['select', 'name']"),
        ({"kind": "teacher", "select": [""], "name": "t"},
         "Contract 't': select must be a list of non-empty strings (module names, parameter "
         "names or globs), got ['']"),
        ({"kind": "ema", "target": "", "online": "o", "decay": 0.5},
         "Contract: target must name one submodule, got ''"),
        ({"kind": "ema", "target": 3, "online": "o", "decay": 0.5},
         "Contract: target must name one submodule, got 3"),
        ({"kind": "probe", "select": "p", "loss": ""},
         "Contract: loss must be a loss name, got ''"),
        ({"kind": "probe", "select": "p", "loss": 3}, "Contract: loss must be a loss name, got 3"),
        ({"kind": "ema", "target": "t", "online": "o", "decay": 0},
         "Contract: decay must be a number in (0, 1), got 0"),
        ({"kind": "reversal", "loss": "d", "features": "f", "classifier": "c", "scale": 0},
         "Contract: scale must be a number > 0 (the reversal multiplies the gradient by -scale), "
         "got 0"),
        ({"kind": "teacher", "select": "t", "name": 3}, "Contract 3: name must be a string, got 3"),
    ],
)  # fmt: skip
def test_a_bad_contract_is_refused_word_for_word(keys: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError) as raised:
        Contract(**keys)  # type: ignore[arg-type]
    assert str(raised.value) == message


# -- teacher ----------------------------------------------------------------------------------


def test_a_held_frozen_teacher_holds_and_each_clause_was_checked() -> None:
    model = net()
    opt = torch.optim.SGD([*model["head"].parameters(), *model["probe"].parameters()], lr=0.1)
    spec = IsolationSpec(
        freeze=["trunk"], mode="eval", contracts=[{"kind": "teacher", "select": "trunk"}]
    )
    handle = spec.apply(model, opt)
    loop = handle.check_every(1)
    for i in range(2):
        step(model, loop, opt, i)
    verification = handle.verify()
    assert verification.contracts == {"teacher:trunk": 3}  # the state clauses, no losses given
    assert "  contracts (5x): contract 'teacher:trunk' held (3 clause checks)" in str(handle.tally)
    clauses = handle.contracts.verdicts["teacher:trunk"]["clauses"]
    assert {c: v["violated"] for c, v in clauses.items()} == dict.fromkeys(clauses, 0)
    assert clauses["no loss reaches it"]["checked"] == 4  # before backward and after, 2 steps
    handle.restore()


def test_a_teacher_edited_in_place_is_not_still() -> None:
    model = net()
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    teacher = [{"kind": "teacher", "select": "trunk"}]
    spec = IsolationSpec(freeze=["trunk"], mode="eval", contracts=teacher)
    with spec.applied(model, opt) as handle:
        with torch.no_grad():
            model["trunk"][0].bias[0] += 1.0
        with pytest.raises(
            ContractError, match=r"'bitwise still': \['trunk.0.bias \(parameter\)'\] changed"
        ):
            handle.verify(checks=["contracts"])
        handle.verify(checks=["contracts"])  # each move is reported once


def test_a_teacher_without_an_attached_optimizer_cannot_be_checked() -> None:
    model = net()
    teacher = IsolationSpec(contracts=[{"kind": "teacher", "select": "trunk"}])
    with (
        teacher.applied(model) as handle,
        pytest.raises(
            BlindSpotError,
            match=r"cannot check its clause 'in no optimizer': no optimizer is attached",
        ),
    ):
        handle.verify(checks=["contracts"])


# -- ema --------------------------------------------------------------------------------------


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.online = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.target = copy.deepcopy(self.online).requires_grad_(False)


def ema_run(
    update: Callable[[Pair, int], None],
    *,
    decay: float = 0.9,
    integers: str = "copy",
    before: bool = False,
) -> dict:
    """Train ``Pair.online`` 3 steps; ``update`` is the EMA step, after the optimizer step or
    (``before``) at the start of the next forward, as MoCo does."""
    model = Pair()
    opt = torch.optim.SGD(model.online.parameters(), lr=0.5)
    contract = {
        "kind": "ema",
        "target": "target",
        "online": "online",
        "decay": decay,
        "integers": integers,
    }
    spec = IsolationSpec(freeze=["target"], mode="eval", contracts=[contract])
    with spec.applied(model, opt) as handle:
        loop = handle.check_every(1)
        for i in range(3):
            loop.begin_step(epoch=0, step=i)
            if before:
                update(model, i)
            x = torch.randn(8, 4)
            loss = model.online(x).pow(2).mean() + 0 * model.target(x).sum().detach()
            loop.before_backward(loss, {})
            loss.backward()
            opt.step()
            opt.zero_grad()
            if not before:
                update(model, i)
            loop.end_step()
        loop.finish()
        return handle.contracts.verdicts["ema:target"]["clauses"]


@torch.no_grad()
def lerp(model: Pair, decay: float) -> None:
    for t, o in zip(
        model.target.state_dict().values(), model.online.state_dict().values(), strict=True
    ):
        if t.is_floating_point():
            t.lerp_(o, 1 - decay)
        else:
            t.copy_(o)


def test_an_ema_updated_after_the_step_or_before_the_next_forward_holds() -> None:
    after = ema_run(lambda m, i: lerp(m, 0.9))
    assert after["equals the EMA of the online network"] == {
        "checked": 3,
        "violated": 0,
        "first": None,
    }
    before = ema_run(lambda m, i: lerp(m, 0.9), before=True)
    assert before["moves"]["checked"] == 3 and before["moves"]["violated"] == 0


def test_an_ema_with_another_decay_moved_by_another_rule() -> None:
    with pytest.raises(
        ContractError,
        match=r"'equals the EMA of the online network': \['0.weight \(parameter, off by .* x "
        r"tolerance\)'.* moved by another rule over optimizer step 0 \(decay 0.9\)",
    ):
        ema_run(lambda m, i: lerp(m, 0.5))


@torch.no_grad()
def keep_counters(model: Pair, decay: float) -> None:
    for t, o in zip(
        model.target.state_dict().values(), model.online.state_dict().values(), strict=True
    ):
        if t.is_floating_point():
            t.lerp_(o, 1 - decay)


def test_integer_buffers_follow_the_declared_policy() -> None:
    kept = ema_run(lambda m, i: keep_counters(m, 0.9), integers="keep")
    assert kept["integer buffers are kept"]["violated"] == 0
    with pytest.raises(
        ContractError,
        match=r"'integer buffers are copied from the online network': "
        r"\['1.num_batches_tracked = 0, expected 1'\]",
    ):
        ema_run(lambda m, i: keep_counters(m, 0.9), integers="copy")


def test_the_ema_target_is_left_to_its_contract_by_the_drift_check() -> None:
    model = Pair()
    spec = IsolationSpec(
        freeze=["target"],
        contracts=[{"kind": "ema", "target": "target", "online": "online", "decay": 0.9}],
    )
    with spec.applied(model) as handle:
        assert handle.plan.moving == {
            "target.0.weight",
            "target.0.bias",
            "target.1.weight",
            "target.1.bias",
            "target.1.running_mean",
            "target.1.running_var",
            "target.1.num_batches_tracked",
        }
        lerp(model, 0.0)
        handle.verify(checks=["drift"])  # moved, but by the EMA's rule
        assert handle.expectations()["target.0.weight"] == "EMA of online"


# -- stop_gradient ----------------------------------------------------------------------------


def test_a_stop_gradient_whose_blocked_side_nothing_reaches_is_a_cut_off() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = IsolationSpec(contracts=[{"kind": "stop_gradient", "loss": "probe", "blocked": "trunk"}])
    with spec.applied(model, opt) as handle:
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        features = model["trunk"](x).detach()  # the main loss is cut off from the trunk too
        main = F.cross_entropy(model["head"](features), y)
        probe = F.cross_entropy(model["probe"](features), y)
        with pytest.raises(
            ContractError,
            match=r"'the blocked side is still reached': no loss reaches "
            r"\['trunk.0.weight', 'trunk.0.bias', 'trunk.1.weight', 'trunk.1.bias'\]",
        ):
            handle.verify({"main": main, "probe": probe}, total=main + probe, checks=["contracts"])


def test_a_route_through_a_module_that_did_not_run_cannot_be_checked() -> None:
    model = net()
    spec = IsolationSpec(
        contracts=[
            {"kind": "stop_gradient", "loss": "main", "blocked": "trunk", "through": "probe"}
        ]
    )
    with spec.applied(model) as handle:
        handle.step(epoch=0, step=0)
        main = model["head"](model["trunk"](torch.randn(8, 4))).sum()
        with pytest.raises(BlindSpotError, match=r"'probe' did not run while the check recorded"):
            handle.verify({"main": main}, checks=["contracts"])


def test_a_contract_loss_missing_from_verify_is_an_error() -> None:
    model = net()
    spec = IsolationSpec(contracts=[{"kind": "probe", "select": "probe", "loss": "probe"}])
    with spec.applied(model) as handle:
        main = model["head"](model["trunk"](torch.randn(8, 4))).sum()
        with pytest.raises(
            SpecError,
            match=r"^IsolationSpec: the contracts read the losses \['probe'\], but verify\(\) "
            r"got \['main'\]; pass every loss the contracts name$",
        ):
            handle.verify({"main": main})


# -- reversal ---------------------------------------------------------------------------------


def dann_losses(model: nn.ModuleDict) -> dict[str, torch.Tensor]:
    features = model["features"](torch.randn(8, 4))
    return {"domain": F.cross_entropy(model["domain"](features), torch.arange(8) % 2)}


REVERSAL = {
    "kind": "reversal",
    "loss": "domain",
    "features": "features",
    "classifier": "domain.1",
    "scale": 0.3,
}


@pytest.mark.parametrize(
    ("layers", "clause", "detail"),
    [
        ([isolate.GradientScale(-0.1), nn.Linear(4, 2)], "reversed at the features",
         r"is -0.1 times .*; the scale differs"),
        ([nn.Identity(), nn.Linear(4, 2), isolate.GradientScale(-0.3)], "reversed at the features",
         r"is \+1 times .*; the reversal is missing"),
        ([isolate.GradientScale(-0.3), nn.Linear(4, 2), isolate.GradientScale(-1.0)],
         "the classifier gets it unreversed",
         r"every route from loss 'domain' to the output of 'domain.1' passes a gradient scale"),
    ],
    ids=["scale", "after the classifier", "reversed twice"],
)  # fmt: skip
def test_a_reversal_names_what_is_wrong(layers: list[nn.Module], clause: str, detail: str) -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"features": nn.Linear(4, 4), "domain": nn.Sequential(*layers)})
    with IsolationSpec(contracts=[REVERSAL]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        with pytest.raises(ContractError, match=rf"'{clause}': .*{detail}"):
            handle.verify(dann_losses(model), checks=["contracts"])


def test_a_reversal_whose_classifier_did_not_run_cannot_be_checked() -> None:
    model = nn.ModuleDict(
        {"features": nn.Linear(4, 4), "domain": nn.Sequential(nn.Identity(), nn.Linear(4, 2))}
    )
    with IsolationSpec(contracts=[REVERSAL]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        features = model["features"](torch.randn(8, 4))
        loss = F.cross_entropy(features[:, :2], torch.arange(8) % 2)  # the classifier is skipped
        with pytest.raises(
            BlindSpotError,
            match=r"'reversed at the features': 'domain\.1' did not run while the check recorded",
        ):
            handle.verify({"domain": loss}, checks=["contracts"])


def test_a_reversal_agrees_with_gradients_computed_with_and_without_it() -> None:
    """The contract's measured factor is what two real backward passes give."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "features": nn.Linear(4, 4),
            "domain": nn.Sequential(isolate.GradientScale(-0.3), nn.Linear(4, 2)),
        }
    )
    x, y = torch.randn(8, 4), torch.arange(8) % 2
    model["features"](x)
    with_reversal = torch.autograd.grad(
        F.cross_entropy(model["domain"](model["features"](x)), y), model["features"].weight
    )[0]
    without = torch.autograd.grad(
        F.cross_entropy(model["domain"][1](model["features"](x)), y), model["features"].weight
    )[0]
    torch.testing.assert_close(with_reversal, -0.3 * without)
    with IsolationSpec(contracts=[REVERSAL]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        features = model["features"](x)
        verification = handle.verify(
            {"domain": F.cross_entropy(model["domain"](features), y)}, checks=["contracts"]
        )
        assert verification.contracts == {"reversal:domain": 3} and not verification.violations


# -- probe and trains -------------------------------------------------------------------------


def test_a_probe_read_by_another_loss_and_a_probe_that_does_not_learn() -> None:
    model = net()
    spec = IsolationSpec(contracts=[{"kind": "probe", "select": "probe", "loss": "probe"}])
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)  # the probe is left out
    with spec.applied(model, opt) as handle:
        loop = handle.check_every(1, on_violation="warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(2):
                step(model, loop, opt, i)
        messages = [str(w.message) for w in caught]
    assert any(
        "'the probe moves': ['probe.weight', 'probe.bias'] did not change in the 1 optimizer "
        "step(s) from step 0" in m
        for m in messages
    )
    clauses = handle.contracts.verdicts["probe:probe"]["clauses"]
    assert (
        clauses["the probe moves"]["violated"] == 1
        and clauses["its loss reaches only the probe"]["violated"] == 0
    )
    model = net()
    with spec.applied(model) as handle:
        features = model["trunk"](torch.randn(8, 4))
        probe_out = model["probe"](features)
        main = model["head"](features).sum() + probe_out.sum()  # the main loss reads the probe
        with pytest.raises(
            ContractError,
            match=r"'no other loss reaches the probe': loss 'main' reaches "
            r"\['probe.weight', 'probe.bias'\]",
        ):
            handle.verify({"main": main, "probe": probe_out.sum()}, checks=["contracts"])


def test_trains_within_n_steps_waits_that_many_steps() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s < 2 else 1.0)
    late = IsolationSpec(contracts=[{"kind": "trains", "select": "head", "within": 3}])
    early = IsolationSpec(contracts=[{"kind": "trains", "select": "head", "within": 1}])
    for spec, fails in ((late, False), (early, True)):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s < 2 else 1.0)
        with spec.applied(model, opt) as handle:
            loop = handle.check_every(1)
            try:
                for i in range(4):
                    step(model, loop, opt, i)
                    lr.step()
                loop.finish()
            except ContractError as error:
                assert (
                    fails
                    and "'changes within 1 step(s)': ['head.weight', 'head.bias'] did not change "
                    "from step 0 to step 1"
                    in str(error)
                )
            else:
                assert not fails


# -- plumbing ---------------------------------------------------------------------------------


def test_recording_hooks_live_for_a_check_step_only() -> None:
    model = net()
    contract = {"kind": "stop_gradient", "loss": "probe", "blocked": "trunk", "through": "head"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with IsolationSpec(contracts=[contract]).applied(model, opt) as handle:
        loop = handle.check_every(2)
        loop.begin_step(epoch=0, step=0)
        assert len(model["head"]._forward_hooks) == 1
        loop.begin_step(epoch=0, step=1)  # not a check step
        assert not model["head"]._forward_hooks
        loop.begin_step(epoch=0, step=2)
        assert len(model["head"]._forward_hooks) == 1
    assert not model["head"]._forward_hooks  # restore removes them


def test_restore_leaves_no_weak_reference_on_a_parameter() -> None:
    """FSDP2 swaps parameters when the model moves after training, which a weak reference
    (a snapshot's) forbids."""
    import weakref

    model = net()
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    contracts = [
        {"kind": "teacher", "select": "trunk"},
        {"kind": "trains", "select": "head", "within": 2},
    ]
    handle = IsolationSpec(freeze=["trunk"], mode="eval", contracts=contracts).apply(model, opt)
    handle.step(epoch=0, step=0)  # opens the window: a snapshot of the head
    assert all(not weakref.getweakrefs(p) for p in model.parameters())  # none while applied
    handle.restore()
    assert all(not weakref.getweakrefs(p) for p in model.parameters())


def test_restore_closes_every_window_and_drops_its_copies() -> None:
    """An open window holds copies (an EMA's: both networks) or a snapshot; a restored handle
    keeps none of them."""
    model = Pair()
    opt = torch.optim.SGD(model.online.parameters(), lr=0.1)
    contracts = [
        {"kind": "ema", "target": "target", "online": "online", "decay": 0.9},
        {"kind": "trains", "select": "online", "within": 2},
    ]
    handle = IsolationSpec(contracts=contracts).apply(model, opt)
    handle.step(epoch=0, step=0)  # opens both windows
    assert [b.due(5) for b in handle.contracts.bound] == [True, True]
    handle.restore()
    assert [b.due(5) for b in handle.contracts.bound] == [False, False]
