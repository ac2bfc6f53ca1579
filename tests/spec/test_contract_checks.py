"""How the handle runs the contracts (``isolate.spec.contract_checks``): every contract's
clauses counted in one check, windows closed over several steps all reported, what the watched
modules recorded kept over a step's micro-batches, and the verdicts kept for reports."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import isolate
from isolate.errors import BlindSpotError, ContractError, SelectorError
from isolate.spec import IsolationSpec

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def net() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "trunk": nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)),
            "head": nn.Linear(8, 3),
            "probe": isolate.Detached(nn.Linear(8, 3)),
        }
    )


REVERSAL = {
    "kind": "reversal",
    "loss": "domain",
    "features": "features",
    "classifier": "domain.1",
    "scale": 0.3,
}


def test_a_contract_broken_twice_counts_both_and_keeps_the_first_message() -> None:
    model = net()
    opt = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    spec = IsolationSpec(
        freeze=["trunk"], mode="eval", contracts=[{"kind": "teacher", "select": "trunk"}]
    )
    with spec.applied(model, opt) as handle:
        with torch.no_grad():
            model["trunk"][0].bias[0] += 1.0
        with pytest.raises(ContractError) as first:
            handle.verify(checks=["contracts"], when="after step 3")
        with torch.no_grad():
            model["trunk"][0].weight[0, 0] += 1.0
        with pytest.raises(ContractError, match=r"\['trunk.0.weight \(parameter\)'\] changed"):
            handle.verify(checks=["contracts"])
        verdicts = handle.contracts.verdicts
    assert str(first.value) == (
        "IsolationSpec: after step 3, contract 'teacher:trunk' (teacher) breaks its clause "
        "'bitwise still': ['trunk.0.bias (parameter)'] changed"
    )
    unbroken = {"checked": 2, "violated": 0, "first": None}
    assert verdicts == {
        "teacher:trunk": {
            "kind": "teacher",
            "clauses": {
                "no loss reaches it": {"checked": 0, "violated": 0, "first": None},
                "in no optimizer": unbroken,
                "in eval mode": unbroken,
                "bitwise still": {"checked": 2, "violated": 2, "first": str(first.value)},
            },
        }
    }


def test_every_contract_s_clauses_are_counted_in_one_check() -> None:
    model = net()
    opt = torch.optim.SGD([*model["head"].parameters(), *model["probe"].parameters()], lr=0.1)
    spec = IsolationSpec(
        freeze=["trunk"],
        mode="eval",
        contracts=[
            {"kind": "teacher", "select": "trunk"},
            {"kind": "probe", "select": "probe", "loss": "probe"},
        ],
    )
    with spec.applied(model, opt) as handle:
        handle.step(epoch=0, step=0)
        features = model["trunk"](torch.randn(8, 4))
        main, probe = model["head"](features).sum(), model["probe"](features).sum()
        verification = handle.verify({"main": main, "probe": probe}, checks=["contracts"])
        assert verification.contracts == {"teacher:trunk": 4, "probe:probe": 2}
        clauses = handle.contracts.verdicts["teacher:trunk"]["clauses"]
        assert clauses["no loss reaches it"]["checked"] == 1


def test_windows_closed_at_two_steps_before_a_check_are_both_reported() -> None:
    model = net()
    spec = IsolationSpec(contracts=[{"kind": "trains", "select": "head", "within": 1}])
    with spec.applied(model) as handle:  # no optimizer: the head never moves
        for i in range(3):
            handle.step(epoch=0, step=i)
        verification = handle.verify(checks=["contracts"], on_violation="warn")
    assert verification.contracts == {"trains:head": 2}
    assert verification.violations == tuple(
        f"IsolationSpec: at the start of step {i + 1}, contract 'trains:head' (trains) breaks its "
        f"clause 'changes within 1 step(s)': ['head.weight', 'head.bias'] did not change from "
        f"step {i} to step {i + 1}"
        for i in range(2)
    )


def test_a_window_still_open_at_the_end_of_training_is_closed_and_reported() -> None:
    model = net()
    spec = IsolationSpec(contracts=[{"kind": "trains", "select": "head", "within": 1}])
    with spec.applied(model) as handle:
        loop = handle.check_every(1)
        handle.step(epoch=0, step=0)
        with pytest.raises(ContractError) as raised:
            loop.finish()
    assert str(raised.value) == (
        "IsolationSpec: at the end of training, contract 'trains:head' (trains) breaks its "
        "clause 'changes within 1 step(s)': ['head.weight', 'head.bias'] did not change from "
        "step 0 to step 1"
    )


def dann() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "features": nn.Linear(4, 4),
            "domain": nn.Sequential(isolate.GradientScale(-0.3), nn.Linear(4, 2)),
        }
    )


def domain_loss(model: nn.ModuleDict) -> torch.Tensor:
    features = model["features"](torch.randn(8, 4))
    return F.cross_entropy(model["domain"](features), torch.arange(8) % 2)


def test_what_a_step_s_first_micro_batch_recorded_is_kept_over_the_second() -> None:
    model = dann()
    with IsolationSpec(contracts=[REVERSAL]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        first = domain_loss(model)
        handle.step(epoch=0, step=0)  # the same optimizer step: its second micro-batch
        domain_loss(model)
        verification = handle.verify({"domain": first}, checks=["contracts"])
        assert verification.contracts == {"reversal:domain": 3} and not verification.violations
        handle.step(epoch=0, step=1, record=False)  # a step that does not record
        with pytest.raises(BlindSpotError, match=r"'features' did not run while the check"):
            handle.verify({"domain": domain_loss(model)}, checks=["contracts"])


class Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": self.linear(x)}


class Reverse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = isolate.GradientScale(-0.3)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self.scale(v) for k, v in batch.items()}


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(batch["h"])


def test_modules_that_pass_mappings_are_recorded_through_them() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"features": Features(), "domain": nn.Sequential(Reverse(), Classifier())}
    )
    with IsolationSpec(contracts=[REVERSAL]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        features = model["features"](torch.randn(8, 4))
        loss = F.cross_entropy(model["domain"](features), torch.arange(8) % 2)
        verification = handle.verify({"domain": loss}, checks=["contracts"])
    assert verification.contracts == {"reversal:domain": 3} and not verification.violations


def test_a_contract_naming_no_submodule_is_refused_in_the_spec_s_name() -> None:
    model = dann()
    bad = dict(REVERSAL, classifier="domain.2")
    with pytest.raises(SelectorError, match=r"^IsolationSpec\(contract 'reversal:domain'\): "):
        IsolationSpec(contracts=[bad]).apply(model)
