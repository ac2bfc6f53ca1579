"""The spec engine without Lightning: IsolationSpec, its plan and the IsolationHandle."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import isolate
from isolate import IsolationSpec, Thaw
from isolate.errors import (
    CheckpointMismatchError,
    DriftError,
    GradientLeakError,
    SelectorError,
    SpecError,
)
from isolate.spec.checks import Verification

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)
        self.aux = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        return self.head(features), self.aux(features)


SPEC = IsolationSpec(freeze=["trunk"], detach=["aux"], thaw=[Thaw("trunk.3", epoch=1, lr=0.5)])


def state_of(model: nn.Module) -> dict[str, Any]:
    return {
        "flags": [(n, p.requires_grad) for n, p in model.named_parameters()],
        "ids": [id(p) for p in model.parameters()],
        "classes": [type(m) for m in model.modules()],
        "modes": [m.training for m in model.modules()],
        "hooks": [len(m._forward_pre_hooks) for m in model.modules()],
        "values": {k: v.clone() for k, v in model.state_dict().items()},
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in ("flags", "ids", "classes", "modes", "hooks"):
        assert before[key] == after[key], key
    for name, value in before["values"].items():
        assert torch.equal(value, after["values"][name]), name


def groups_of(opt: torch.optim.Optimizer) -> list[list[int]]:
    return [[id(p) for p in g["params"]] for g in opt.param_groups]


def test_from_dict_round_trips_and_names_typos() -> None:
    data = SPEC.to_dict()
    assert IsolationSpec.from_dict(data).to_dict() == data
    assert data["thaw"][0]["select"] == ["trunk.3"]
    with pytest.raises(
        SpecError, match=r"unknown keys \['detatch'\] \(did you mean 'detatch' -> 'detach'\?\)"
    ):
        IsolationSpec.from_dict({"detatch": ["aux"]})
    with pytest.raises(
        SpecError, match=r"from_dict\(\)\.freeze\[0\]: from_dict\(\) takes plain data .* got Linear"
    ):
        IsolationSpec.from_dict({"freeze": [nn.Linear(1, 1)]})
    with pytest.raises(SpecError, match=r"thaw\[0\] has unknown keys \['epochs'\]"):
        IsolationSpec.from_dict({"freeze": ["a"], "thaw": [{"select": "a", "epochs": 1}]})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"freeze": [""]}, r"^IsolationSpec: freeze must be a list of non-empty strings"),
        ({"bn": "frozen"}, r"^IsolationSpec: bn must be 'eval' or 'train', got 'frozen'"),
        ({"detach": ["a"], "clone": ["a"]}, r"\['a'\] are both in detach and clone"),
        ({"detach": ["a", "a"]}, r"detach lists \['a'\] twice"),
        ({"thaw": "trunk"}, r"thaw must be a list of Thaw steps"),
        ({"protect": ["aux"]}, r"protect must map loss names to selectors, got list"),
        ({"frozen_in_optimizer": "keep"}, r"frozen_in_optimizer must be 'remove' or 'error'"),
    ],
)
def test_bad_specs_are_refused_when_built(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        IsolationSpec(**kwargs)


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (
            IsolationSpec(freeze=["backbone"]),
            SelectorError,
            r"^IsolationSpec\(freeze\): 'backbone' matched no",
        ),
        (
            IsolationSpec(detach=["probe"]),
            SelectorError,
            r"^IsolationSpec\(detach\): 'probe' is not a submodule",
        ),
        (
            IsolationSpec(freeze=["trunk.0"], thaw=[Thaw("head", epoch=1)]),
            SpecError,
            r"thaw group 'head'",
        ),
        # the last item fails after the freeze and the first wrap would have been done
        (IsolationSpec(freeze=["trunk"], detach=["aux", "nowhere"]), SelectorError, r"'nowhere'"),
    ],
)
def test_apply_checks_everything_before_changing_anything(
    spec: IsolationSpec, error: type[Exception], match: str
) -> None:
    model = Net()
    before = state_of(model)
    with pytest.raises(error, match=match):
        spec.apply(model)
    assert_same(before, state_of(model))


def test_an_optimizer_refused_leaves_model_and_optimizer_as_they_were() -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    before, groups = state_of(model), groups_of(opt)
    spec = IsolationSpec(freeze=["trunk"], frozen_in_optimizer="error")
    with pytest.raises(SpecError, match=r"^IsolationSpec: 6 frozen parameters sit in an optimizer"):
        spec.apply(model, optimizer=opt)
    assert_same(before, state_of(model))
    assert groups_of(opt) == groups


def test_apply_then_restore_is_exact_wrappers_optimizer_and_thaws_included() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before, groups = state_of(model), groups_of(opt)
    handle = SPEC.apply(model, optimizer=opt)
    assert isinstance(model.aux, isolate.Detached) and not model.trunk[0].weight.requires_grad
    assert not model.train().trunk[1].training or model.trunk[1](torch.randn(3, 8)) is not None
    handle.step(epoch=1, step=3)
    assert handle.thawed == ("trunk.3",) and model.trunk[3].weight.requires_grad
    handle.restore()
    model.eval().train()  # modes were recorded at apply; the model was in train mode then
    assert_same(before, state_of(model))
    assert groups_of(opt) == groups
    assert not handle.active
    with pytest.raises(SpecError, match=r"the handle was restored; apply the spec again"):
        handle.thaw("trunk.3")


def test_applied_restores_on_exceptions() -> None:
    model = Net()
    before = state_of(model)
    with pytest.raises(RuntimeError, match="boom"), SPEC.applied(model) as handle:
        assert handle.frozen[0] == "trunk.0.weight"
        raise RuntimeError("boom")
    assert_same(before, state_of(model))


def test_a_thaw_adds_the_group_once_by_identity_with_its_settings() -> None:
    model = Net()
    opt = torch.optim.SGD([p for p in model.parameters()], lr=0.1, momentum=0.9)
    handle = SPEC.apply(model, optimizer=opt)
    assert [len(g) for g in groups_of(opt)] == [4]  # the 6 frozen parameters are out
    assert handle.step(epoch=0, step=5) == []
    assert handle.step(epoch=1, step=6) == ["trunk.3"]
    last = opt.param_groups[-1]
    assert [id(p) for p in last["params"]] == [id(model.trunk[3].weight), id(model.trunk[3].bias)]
    assert last["lr"] == 0.5 and last["momentum"] == 0.9
    with pytest.raises(SpecError, match=r"thaw group 'trunk.3' was thawed already .*thawed once"):
        handle.thaw("trunk.3")
    with pytest.raises(SpecError, match=r"no thaw group 'trunk'; the groups are \['trunk.3'\]"):
        handle.thaw("trunk")
    assert handle.step(epoch=2, step=7) == []
    assert sum(len(g) for g in groups_of(opt)) == 6
    handle.restore()


def test_an_optimizer_built_before_the_spec_gives_up_its_frozen_parameters_quietly() -> None:
    """Lightning's ModelParallelStrategy applies the spec after configure_optimizers: the
    optimizer cannot help holding what the spec freezes, so taking them out is no news."""
    before, after = Net(), Net()
    early = torch.optim.AdamW(before.parameters(), lr=0.1, weight_decay=0.1)
    quiet, loud = SPEC.apply(before), SPEC.apply(after)
    late = torch.optim.AdamW(after.parameters(), lr=0.1, weight_decay=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.attach(early, built_before_apply=True)
    assert [str(w.message) for w in caught] == []
    with pytest.warns(isolate.IsolationWarning, match=r"took 6 frozen parameters out"):
        loud.attach(late)  # built from a frozen model's parameters: worth a warning
    for model, opt in ((before, early), (after, late)):
        trainable = [id(p) for p in model.parameters() if p.requires_grad]
        assert groups_of(opt) == [trainable]  # taken out either way
    quiet.restore()
    loud.restore()


def test_thaw_takes_an_optimizer_and_an_lr() -> None:
    model = Net()
    first = torch.optim.SGD(model.head.parameters(), lr=0.1)
    second = torch.optim.SGD(model.aux.parameters(), lr=0.2)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", step=2, lr=0.5, optimizer_idx=0)])
    handle = spec.apply(model, optimizer=[first, second])
    group = handle.thaw("trunk.3", optimizer=second, lr=0.01)
    assert group is second.param_groups[-1] and group["lr"] == 0.01
    assert len(first.param_groups) == 1
    handle.restore()
    assert len(second.param_groups) == 1


def test_verify_reports_what_it_checked_and_raises_on_a_leak() -> None:
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    handle.step(epoch=0, step=0)
    _, aux = model(torch.randn(5, 4))
    checked = handle.verify({"aux": aux.sum()})
    assert checked == Verification(losses={"aux": 6}, drift=9, flags=6, optimizers=1, ranks=1)
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


def test_state_round_trip_resumes_without_refreezing() -> None:
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.head.parameters(), lr=0.1))
    handle.step(epoch=1, step=4)
    state = handle.state_dict()
    handle.restore()
    assert state["thawed"] == [{"name": "trunk.3", "epoch": 1, "global_step": 4}]
    assert state["frozen"] == ["trunk.0.weight", "trunk.0.bias", "trunk.1.weight", "trunk.1.bias"]
    fresh = Net()
    opt = torch.optim.SGD(fresh.head.parameters(), lr=0.1)
    resumed = SPEC.apply(fresh, optimizer=opt)
    resumed.load_state_dict(copy.deepcopy(state))
    assert fresh.trunk[3].weight.requires_grad and not fresh.trunk[0].weight.requires_grad
    assert len(opt.param_groups) == 2 and resumed.step(epoch=1, step=5) == []
    resumed.restore()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda s: s["spec"].update(freeze=["trunk.0.weight"]),
            r"\n  freeze: only in the checkpoint \[\], only in this run \['trunk.0.bias'",
        ),
        (
            lambda s: s["spec"]["thaw"][0].update(lr=0.1),
            r"thaw group 'trunk.3': lr 0.1 in the checkpoint, 0.5 in this run",
        ),
        (lambda s: s.update(format=7), r"has format 7, expected 1"),
        (lambda s: s.update(thawed=[{"name": "trunk.3"}]), r"'thawed' must be a list of"),
        (
            lambda s: s.update(thawed=[{"name": "x", "epoch": 0, "global_step": 0}]),
            r"thawed groups \['x'\] that this spec does not have",
        ),
        (lambda s: s.update(frozen=[]), r"lists \[\] as frozen, but its schedule leaves"),
    ],
)
def test_a_foreign_state_is_refused_and_changes_nothing(edit: Any, match: str) -> None:
    model = Net()
    handle = SPEC.apply(model)
    handle.step(epoch=1, step=4)
    state = handle.state_dict()
    handle.restore()
    edit(state)
    fresh = Net()
    resumed = SPEC.apply(fresh)
    before = state_of(fresh)
    with pytest.raises(CheckpointMismatchError, match=match):
        resumed.load_state_dict(state)
    assert_same(before, state_of(fresh))
    resumed.restore()


def test_each_selector_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import isolate.freezing
    import isolate.spec.plan

    calls: list[tuple[str, ...]] = []
    real = isolate.spec.plan.select

    def counting(model: nn.Module, selectors: Any, caller: str, **options: Any) -> Any:
        calls.append(tuple(selectors))
        return real(model, selectors, caller, **options)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("freezing resolved a selector again")

    monkeypatch.setattr(isolate.spec.plan, "select", counting)
    monkeypatch.setattr(isolate.freezing, "select", refuse)
    model = Net()
    handle = SPEC.apply(model, optimizer=torch.optim.SGD(model.head.parameters(), lr=0.1))
    handle.step(epoch=1, step=1)
    handle.load_state_dict(handle.state_dict())
    handle.restore()
    assert calls == [("trunk",), ("trunk.3",)]


def test_import_isolate_does_not_pull_the_lightning_adapter() -> None:
    import subprocess
    import sys

    code = "import sys, isolate; isolate.IsolationSpec(); print('lightning_fabric' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
