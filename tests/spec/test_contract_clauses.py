"""The clauses of each contract kind (``isolate.spec.contract_clauses``): the tensors a
teacher watches, the losses each clause reads and names, the walks the checks share, and the
names a refusal is given."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from isolate.errors import BlindSpotError, ContractError, SelectorError, ShardedGraphError
from isolate.spec import IsolationSpec
from isolate.spec.contract_clauses import Window

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def net() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "trunk": nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2)),
            "head": nn.Linear(8, 3),
            "probe": nn.Linear(8, 3),
        }
    )


# -- what a teacher watches --------------------------------------------------------------------


class Gate(nn.Module):
    """A layer whose forward reads ``.training``, with a child of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.child = nn.Linear(4, 4)
        self.child.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x * self.weight) if self.training else x


def teacher_net() -> nn.ModuleDict:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    lin.register_buffer("scale", torch.ones(4))  # a buffer of a layer the teacher selects
    table = nn.Module()  # no parameter, no mode: a constant only its place makes the teacher's
    table.register_buffer("pos", torch.arange(4.0))
    teacher = nn.ModuleDict(
        {"lin": lin, "norm": nn.BatchNorm1d(4, affine=False), "gate": Gate(), "table": table}
    )  # the norm has no parameter: only its mode makes it the teacher's
    return nn.ModuleDict({"teacher": teacher, "head": nn.Linear(4, 2)})


@pytest.mark.parametrize(
    ("edited", "changed"),
    [
        ("teacher.lin.scale", "['teacher.lin.scale (buffer)']"),
        ("teacher.norm.running_mean", "['teacher.norm.running_mean (buffer)']"),
        ("teacher.table.pos", "['teacher.table.pos (buffer)']"),
        ("teacher.gate.child.count", None),  # excluded from the teacher
        ("head.bias", None),  # not the teacher's
    ],
)
def test_a_teacher_watches_the_buffers_of_its_layers_its_constants_and_its_mode_layers(
    edited: str, changed: str | None
) -> None:
    model = teacher_net()
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    teacher = {"kind": "teacher", "select": ["teacher", "!teacher.gate.child"]}
    spec = IsolationSpec(freeze=["teacher"], mode="eval", contracts=[teacher])
    with spec.applied(model, opt) as handle:
        assert handle.verify(checks=["contracts"]).contracts == {"teacher:teacher": 3}
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        with torch.no_grad():
            tensors[edited].add_(1.0)
        if changed is None:
            handle.verify(checks=["contracts"])
            return
        with pytest.raises(ContractError) as broken:
            handle.verify(checks=["contracts"])
    assert str(broken.value).endswith(f"breaks its clause 'bitwise still': {changed} changed")


def test_a_teacher_zero_that_turns_negative_is_not_bitwise_still() -> None:
    """0.0 and -0.0 compare equal, but the clause is bitwise: a fingerprint tells them apart."""
    model = net()
    with torch.no_grad():
        model["trunk"][0].bias.zero_()
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    spec = IsolationSpec(
        freeze=["trunk"], mode="eval", contracts=[{"kind": "teacher", "select": "trunk"}]
    )
    with spec.applied(model, opt) as handle:
        with torch.no_grad():
            model["trunk"][0].bias.neg_()
        assert torch.equal(model["trunk"][0].bias, torch.zeros(8))
        with pytest.raises(
            ContractError, match=r"'bitwise still': \['trunk.0.bias \(parameter\)'\] changed$"
        ):
            handle.verify(checks=["contracts"])


def test_a_window_is_due_within_steps_after_the_step_it_opened_at_and_tells_bitwise() -> None:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.bias.zero_()
    window = Window()
    assert not window.due(9, 1)  # not open
    window.open(5, model, ["bias"])
    window.open(6, model, ["weight"])  # already open: kept from step 5
    assert [window.due(s, 2) for s in (5, 6, 7, 8)] == [False, False, True, True]
    with torch.no_grad():
        model.bias.neg_()  # -0.0: equal to 0.0, not the same bits
    start, snap = window.close()
    assert start == 5 and snap.names == ("bias",) and list(snap.changed()) == ["bias"]
    assert not window.due(8, 2)  # closed


# -- the teacher's mode ------------------------------------------------------------------------


def test_a_teacher_in_eval_mode_by_hand_or_held_in_eval_holds_its_mode_clause() -> None:
    """A teacher put in eval mode by hand holds the clause; one held in eval mode holds it
    too after model.train(), before the next forward puts it back in eval mode."""
    model = net()
    teacher = [{"kind": "teacher", "select": "trunk"}]
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    with IsolationSpec(contracts=teacher).applied(model, opt) as handle:
        model["trunk"].eval()  # no hold: the user's own mode
        handle.verify(checks=["contracts"])
        model.train()
        with pytest.raises(ContractError, match=r"'in eval mode': \['trunk.1'\] run in train mode"):
            handle.verify(checks=["contracts"])
    model = net()
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    spec = IsolationSpec(freeze=["trunk"], mode="eval", contracts=teacher)
    with spec.applied(model, opt) as handle:
        model.train()
        assert model["trunk"][1].training  # until the next forward
        handle.verify(checks=["contracts"])


def test_a_teacher_that_ran_in_train_mode_and_was_put_back_in_eval_mode_breaks_its_clause() -> None:
    model = net()
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    ran: list[bool] = []
    model["trunk"][1].register_forward_pre_hook(lambda m, args: ran.append(m.training))
    teacher = IsolationSpec(contracts=[{"kind": "teacher", "select": "trunk"}])
    with teacher.applied(model, opt) as handle:
        loop = handle.check_every(1)
        loop.begin_step(epoch=0, step=0)
        with torch.no_grad():
            features = model["trunk"].train()(torch.randn(8, 4))  # dropout on
        model["trunk"].eval()  # put back after the forward, before the check
        loss = model["head"](features).sum()
        loop.before_backward(loss, {})
        loss.backward()
        opt.step()
        with pytest.raises(ContractError) as broken:
            loop.end_step()
    assert ran == [True] and not model["trunk"][1].training
    assert str(broken.value) == (
        "IsolationSpec: at step 0, contract 'teacher:trunk' (teacher) breaks its clause 'in eval "
        "mode': ['trunk.1'] run in train mode (their forward reads .training); hold them with "
        "freeze(..., mode='eval') or the spec's mode: eval, which survive model.train()"
    )


# -- what the clauses read and name ------------------------------------------------------------


def test_a_teacher_reached_by_a_named_loss_or_by_the_loss_backpropagated_names_it() -> None:
    model = net()
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    teacher = IsolationSpec(contracts=[{"kind": "teacher", "select": "trunk"}])
    with teacher.applied(model, opt) as handle:
        loss = model["head"](model["trunk"](torch.randn(8, 4))).sum()
        for losses, total, source in (
            ({"main": loss}, None, "loss 'main'"),
            (None, loss, "the loss backpropagated"),
        ):
            with pytest.raises(ContractError) as broken:
                handle.verify(losses, total=total, checks=["contracts"])
            assert str(broken.value) == (
                "IsolationSpec: at epoch 0, step 0, contract 'teacher:trunk' (teacher) breaks its "
                f"clause 'no loss reaches it': {source} reaches ['trunk.0.weight', "
                "'trunk.0.bias']"
            )


def test_a_teacher_without_an_optimizer_says_how_to_attach_one() -> None:
    model = net()
    teacher = IsolationSpec(contracts=[{"kind": "teacher", "select": "trunk"}])
    with teacher.applied(model) as handle, pytest.raises(BlindSpotError) as blind:
        handle.verify(checks=["contracts"])
    assert str(blind.value).endswith(
        "cannot check its clause 'in no optimizer': no optimizer is attached, so none can be "
        "searched; pass optimizer= to apply() or call handle.attach(optimizer)"
    )


def test_two_stop_gradients_on_one_loss_walk_it_each_with_its_own_route() -> None:
    """The first stops its walk at the head's output; the second walks the whole graph."""
    model = net()
    routed = {"kind": "stop_gradient", "loss": "main", "blocked": "trunk", "through": "head"}
    whole = {"kind": "stop_gradient", "loss": "main", "blocked": "trunk", "name": "whole"}
    with IsolationSpec(contracts=[routed, whole]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        main = model["head"](model["trunk"](torch.randn(8, 4))).sum()
        with pytest.raises(ContractError) as broken:
            handle.verify({"main": main}, checks=["contracts"])
        clauses = handle.contracts.verdicts["stop_gradient:main"]["clauses"]
    unbroken = {"checked": 1, "violated": 0, "first": None}
    assert clauses["does not reach the blocked side"] == unbroken
    assert str(broken.value) == (
        "IsolationSpec: at epoch 0, step 0, contract 'whole' (stop_gradient) breaks its clause "
        "'does not reach the blocked side': loss 'main' reaches ['trunk.0.weight', "
        "'trunk.0.bias']"
    )


def test_a_route_that_did_not_run_is_named_in_the_clause_it_blinds() -> None:
    model = net()
    contract = {"kind": "stop_gradient", "loss": "main", "blocked": "trunk", "through": "probe"}
    with IsolationSpec(contracts=[contract]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        main = model["head"](model["trunk"](torch.randn(8, 4))).sum()
        with pytest.raises(BlindSpotError) as blind:
            handle.verify({"main": main}, checks=["contracts"])
    assert str(blind.value) == (
        "IsolationSpec: at epoch 0, step 0, contract 'stop_gradient:main' (stop_gradient) cannot "
        "check its clause 'does not reach the blocked side': 'probe' did not run while the "
        "check recorded (call handle.step(..., record=True) before the forward)"
    )


def test_a_blocked_side_reached_by_a_named_loss_only_is_not_cut_off() -> None:
    """The loss backpropagated leaves out the probe's loss, which still reaches the probe."""
    model = net()
    contract = {"kind": "stop_gradient", "loss": "main", "blocked": "probe"}
    with IsolationSpec(contracts=[contract]).applied(model) as handle:
        features = model["trunk"](torch.randn(8, 4))
        main = model["head"](features).sum()
        probe = model["probe"](features.detach()).sum()
        verification = handle.verify(
            {"main": main, "probe": probe}, total=main, checks=["contracts"]
        )
        assert verification.contracts == {"stop_gradient:main": 2}
        assert not verification.violations


def test_a_probe_read_by_two_other_losses_names_both() -> None:
    model = net()
    spec = IsolationSpec(contracts=[{"kind": "probe", "select": "probe", "loss": "probe"}])
    with spec.applied(model) as handle:
        features = model["trunk"](torch.randn(8, 4)).detach()
        out = model["probe"](features)
        losses = {"probe": F.relu(out).sum(), "main": out.sum(), "aux": out.mean()}
        with pytest.raises(ContractError) as broken:
            handle.verify(losses, checks=["contracts"])
    assert str(broken.value).endswith(
        "'no other loss reaches the probe': loss 'main' reaches ['probe.weight', 'probe.bias']; "
        "loss 'aux' reaches ['probe.weight', 'probe.bias']"
    )


@pytest.mark.parametrize("ensemble", [False, True])
def test_a_loss_left_unnamed_in_the_loss_backpropagated_that_reaches_the_probe_is_named(
    ensemble: bool,
) -> None:
    model = net()
    spec = IsolationSpec(contracts=[{"kind": "probe", "select": "probe", "loss": "probe"}])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.arange(8) % 3
    with spec.applied(model, optimizer) as handle:
        loop = handle.check_every(1)
        loop.begin_step(epoch=0, step=0)
        features = model["trunk"](torch.randn(8, 4))
        probe_logits = model["probe"](features.detach())
        logits = model["head"](features) + (probe_logits if ensemble else 0)
        main = F.cross_entropy(logits, labels)
        probe = F.cross_entropy(probe_logits, labels)
        total = main + probe
        # brute force: the unnamed part of the loss backpropagated reaches the probe or not
        (grad,) = torch.autograd.grad(
            main, model["probe"].weight, retain_graph=True, allow_unused=True
        )
        assert (grad is not None) == ensemble
        loop.before_backward(total, {"probe": probe})  # only the loss the contract names
        total.backward()
        optimizer.step()
        if ensemble:
            with pytest.raises(ContractError) as broken:
                loop.end_step()
        else:
            loop.end_step()
    clauses = handle.contracts.verdicts["probe:probe"]["clauses"]
    assert clauses["no other loss reaches the probe"]["violated"] == int(ensemble)
    if ensemble:
        assert str(broken.value) == (
            "IsolationSpec: at step 0, contract 'probe:probe' (probe) breaks its clause 'no "
            "other loss reaches the probe': the loss backpropagated, apart from the named "
            "losses in it, reaches ['probe.weight', 'probe.bias']"
        )


def test_a_probe_over_two_micro_batches_is_told_apart_from_the_losses_of_both() -> None:
    model = net()
    spec = IsolationSpec(contracts=[{"kind": "probe", "select": "probe", "loss": "probe"}])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with spec.applied(model, optimizer) as handle:
        loop = handle.check_every(1)
        loop.begin_step(epoch=0, step=0)
        for _ in range(2):  # gradient accumulation: one optimizer step
            features = model["trunk"](torch.randn(8, 4))
            main = F.cross_entropy(model["head"](features), torch.arange(8) % 3)
            probe = F.cross_entropy(model["probe"](features.detach()), torch.arange(8) % 3)
            loop.before_backward((main + probe) / 2, {"main": main, "probe": probe})
            ((main + probe) / 2).backward()
        optimizer.step()
        loop.end_step()
    clauses = handle.contracts.verdicts["probe:probe"]["clauses"]
    assert clauses["no other loss reaches the probe"] == {
        "checked": 3,
        "violated": 0,
        "first": None,
    }


# -- the names a refusal is given --------------------------------------------------------------


@pytest.mark.parametrize(
    ("contract", "message"),
    [
        ({"kind": "teacher", "select": "trnk"},
         "IsolationSpec(contract 'teacher:trnk'): 'trnk' matched no parameter"),
        ({"kind": "stop_gradient", "loss": "main", "blocked": "trnk"},
         "IsolationSpec(contract 'stop_gradient:main'): 'trnk' matched no parameter"),
        ({"kind": "stop_gradient", "loss": "main", "blocked": "trunk", "through": "hed"},
         "IsolationSpec(contract 'stop_gradient:main'): 'hed' is not a submodule of"),
        ({"kind": "probe", "select": "prob", "loss": "probe"},
         "IsolationSpec(contract 'probe:prob'): 'prob' matched no parameter"),
        ({"kind": "trains", "select": "hed", "within": 1},
         "IsolationSpec(contract 'trains:hed'): 'hed' matched no parameter"),
    ],
    ids=["teacher", "blocked", "through", "probe", "trains"],
)  # fmt: skip
def test_a_selector_of_a_contract_that_matches_nothing_is_refused_in_its_name(
    contract: dict[str, object], message: str
) -> None:
    with pytest.raises(SelectorError) as refused:
        IsolationSpec(contracts=[contract]).apply(net())
    assert str(refused.value).startswith(message)


def test_a_walk_that_cannot_see_is_refused_in_the_handles_name() -> None:
    """A reentrant checkpoint whose saved arguments a backward freed cannot be re-run; a
    loss computed on a stand-in of the head's weight cannot be mapped back to it."""
    model = net()
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    with IsolationSpec(contracts=[{"kind": "teacher", "select": "trunk"}]).applied(
        model, opt
    ) as handle:
        x = torch.randn(5, 4, requires_grad=True)
        loss = model["head"](checkpoint(model["trunk"], x, use_reentrant=True)).sum()
        loss.backward()  # frees the segment's saved arguments
        with pytest.raises(BlindSpotError) as blind:
            handle.verify({"main": loss}, checks=["contracts"])
        stand_in = model["head"].weight.detach().requires_grad_()
        with pytest.raises(ShardedGraphError) as foreign:
            handle.verify({"main": stand_in.sum()}, checks=["contracts"])
    assert str(blind.value).startswith("IsolationSpec: ")
    assert str(foreign.value).startswith(
        "IsolationSpec: the graph's leaves are not the model's parameters"
    )
