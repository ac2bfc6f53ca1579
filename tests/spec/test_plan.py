"""The plan: each selector of a spec is resolved once, when the spec is applied."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

import isolate
from isolate.errors import SelectorError, SpecError, WrappingError
from isolate.spec import IsolationSpec, Thaw
from isolate.spec.plan import resolve
from tests.spec._models import SPEC, Net

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


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


def test_a_branch_registered_under_two_names_is_refused_before_wrapping() -> None:
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": shared, "b": shared})
    with pytest.raises(WrappingError) as raised:
        IsolationSpec(detach=["a"]).apply(model)
    assert str(raised.value).startswith(
        "IsolationSpec(detach): 'a' is registered under 2 names ['a', 'b']; only one of them "
        "can be replaced"
    )
    assert model["a"] is shared and model["b"] is shared


class Block(nn.Module):
    """A layer whose own forward reads ``.training``, holding a Linear and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) if self.training else self.lin(x)


def blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(block=Block(), head=nn.Linear(2, 1)))


def test_a_teacher_is_expected_still_even_where_freeze_does_not_freeze_it() -> None:
    spec = IsolationSpec(freeze=["head"], contracts=[{"kind": "teacher", "select": "trunk.0"}])
    assert spec.expectations(Net()) == {
        "trunk.0.weight": "still",
        "trunk.0.bias": "still",
        "trunk.1.weight": "moves",
        "trunk.1.bias": "moves",
        "trunk.3.weight": "moves",
        "trunk.3.bias": "moves",
        "head.weight": "still",
        "head.bias": "still",
        "aux.weight": "moves",
        "aux.bias": "moves",
    }


def test_the_record_names_each_held_buffer_once_and_every_key_of_a_thaw() -> None:
    spec = IsolationSpec(
        freeze=["block"],
        mode="eval",
        thaw=[Thaw("block", step=3, optimizer_idx=0, bn="eval", lr=0.5)],
    )
    record = resolve(spec, blocks()).record()
    held = ["block.bn.num_batches_tracked", "block.bn.running_mean", "block.bn.running_var"]
    assert record["bn"] == "eval" and record["bn_held"] == held
    assert record["thaw"] == [
        {
            "name": "block",
            "params": ["block.lin.weight", "block.lin.bias", "block.bn.weight", "block.bn.bias"],
            "epoch": None,
            "step": 3,
            "lr": 0.5,
            "optimizer_idx": 0,
            "bn": "eval",
        }
    ]
    trained = IsolationSpec(freeze=["block"], bn="train")
    assert resolve(trained, blocks()).record()["bn_held"] == []


def test_a_thaw_takes_the_frozen_part_of_what_it_selects_and_the_layers_all_frozen() -> None:
    spec = IsolationSpec(freeze=["block.bn"], mode="eval", thaw=[Thaw("block", epoch=1)])
    group = resolve(spec, blocks()).groups[0]
    assert list(group.params) == ["block.bn.weight", "block.bn.bias"]
    assert list(group.norms) == ["block", "block.bn"]  # block holds no parameter of its own


@pytest.mark.parametrize(
    ("thaws", "fix"),
    [
        (
            [Thaw("trunk", epoch=1), Thaw("trunk.3", epoch=2)],
            "take them out of one group with an exclusion, select: ['trunk', '!trunk.3'] "
            "for 'trunk'",
        ),
        (
            [Thaw(["trunk", "!trunk.0"], epoch=1), Thaw(["trunk", "!trunk.1"], epoch=2)],
            "take them out of one group with an exclusion, select: ['trunk', '!trunk.0', "
            "'!trunk.3.weight', '!trunk.3.bias'] for 'trunk+!trunk.0'",
        ),
        (
            [Thaw("*.weight", epoch=1), Thaw("trunk", epoch=2)],
            "take them out of one group with an exclusion, select: ['trunk', '!*.weight'] "
            "for 'trunk'",
        ),
        (
            [Thaw(["trunk", "!trunk.0"], epoch=1), Thaw(["trunk", "!trunk.0"], epoch=2, name="b")],
            "they select the same parameters; drop 'b' or 'trunk+!trunk.0'",
        ),
    ],
    ids=["narrow-excluded", "shared-excluded", "exclusion-picks-only-trainable", "same"],
)
def test_an_overlap_is_refused_with_the_first_exclusion_that_separates_the_groups(
    thaws: list[Thaw], fix: str
) -> None:
    with pytest.raises(SpecError) as raised:
        resolve(IsolationSpec(freeze=["trunk"], thaw=thaws), Net())
    assert str(raised.value).endswith("a parameter can be thawed once: " + fix)


def test_each_thaw_selector_must_pick_something_frozen_exclusions_aside() -> None:
    model = Net()
    ok = IsolationSpec(freeze=["trunk.0", "trunk.3"], thaw=[Thaw(["trunk", "!trunk.3"], epoch=1)])
    assert list(resolve(ok, model).groups[0].params) == ["trunk.0.weight", "trunk.0.bias"]
    bad = IsolationSpec(freeze=["trunk"], thaw=[Thaw(["trunk", "!trunk.3", "head"], epoch=1)])
    with pytest.raises(SpecError) as raised:
        resolve(bad, model)
    assert str(raised.value).startswith(
        "IsolationSpec: thaw group 'trunk+!trunk.3+head': 'head' selects 2 parameters that "
        "freeze does not freeze: ['head.weight', 'head.bias']; they are trainable already"
    )
    with pytest.raises(SelectorError) as missing:
        resolve(IsolationSpec(freeze=["trunk"], thaw=[Thaw("nowhere", epoch=1)]), model)
    assert str(missing.value).startswith(
        "IsolationSpec(thaw 'nowhere'): 'nowhere' matched no parameter of Net"
    )


def test_a_thaw_whose_exclusions_take_out_every_frozen_parameter_is_refused() -> None:
    # Each selector picks a frozen parameter, but the group keeps none: it would thaw nothing
    # (an empty param group was added to the optimizer at the thaw).
    spec = IsolationSpec(freeze=["trunk.0"], thaw=[Thaw(["trunk", "!trunk.0"], epoch=1, lr=0.1)])
    with pytest.raises(SpecError) as raised:
        resolve(spec, Net())
    assert str(raised.value) == (
        "IsolationSpec: thaw group 'trunk+!trunk.0' keeps no parameter that freeze freezes (its "
        "exclusions take out every frozen one), so it would thaw nothing; fix its select"
    )


def test_a_thaw_of_integer_parameters_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].register_parameter(
        "steps", nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)
    )
    with pytest.raises(SpecError) as raised:
        resolve(IsolationSpec(freeze=["0"], thaw=[Thaw("0", epoch=1)]), model)
    assert str(raised.value) == (
        "IsolationSpec: thaw group '0' selects parameters ['0.steps'] that are not floating "
        "point and can never require grad; leave them out"
    )


class Aliased(nn.Module):
    """Branches the model reaches only through properties: itself, and a layer it does not
    register at all."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2)])
        object.__setattr__(self, "_hidden", nn.Linear(2, 2))

    @property
    def hidden(self) -> nn.Module:
        return self._hidden  # type: ignore[no-any-return]

    @property
    def itself(self) -> nn.Module:
        return self

    @property
    def encoder(self) -> nn.Module:
        return self.layers[0]


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        (
            IsolationSpec(clone=["nowhere"]),
            SelectorError,
            "IsolationSpec(clone): 'nowhere' is not a submodule of Net",
        ),
        (
            IsolationSpec(detach=["itself"]),
            SpecError,
            "IsolationSpec(detach): 'itself' names the model itself; name a submodule",
        ),
        (
            IsolationSpec(clone=["hidden"]),
            SelectorError,
            "IsolationSpec(clone): 'hidden' reaches a module the model does not register (a "
            "property or a plain attribute returns it), so a wrapper put there would never be "
            "called; name the registered submodule it stands for",
        ),
    ],
    ids=["clone-missing", "model-itself", "unregistered"],
)
def test_a_branch_that_cannot_be_wrapped_is_refused_by_name(
    spec: IsolationSpec, error: type[Exception], message: str
) -> None:
    model = Net() if "nowhere" in spec.clone else Aliased()
    with pytest.raises(error) as raised:
        resolve(spec, model)
    assert str(raised.value).startswith(message)


def test_a_branch_reached_by_another_path_is_wrapped_where_it_is_registered() -> None:
    """``encoder`` is a property returning ``layers.0``, and torch.compile's wrapper forwards
    ``aux`` to the module it holds: each wrapper replaces the registered child, so the forward
    calls it and restore puts the branch back (a wrapper registered as ``encoder`` was
    shadowed by the property and never called; the compiled model's was never taken out)."""
    model = Aliased()
    layer = model.layers[0]
    with IsolationSpec(detach=["encoder"]).applied(model):
        assert isinstance(model.encoder, isolate.Detached) and model.layers[0] is model.encoder
        assert "encoder" not in model._modules
        x = torch.randn(3, 2, requires_grad=True)
        model.encoder(x).sum().backward()
        assert x.grad is None and layer.weight.grad is not None
    assert model.layers[0] is layer and model.encoder is layer
    net = Net()
    aux = net.aux
    with IsolationSpec(detach=["aux"]).applied(torch.compile(net)):
        assert isinstance(net.aux, isolate.Detached) and net.aux.module is aux
    assert net.aux is aux


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            IsolationSpec(detach=["encoder", "layers.0"]),
            "IsolationSpec(detach): 'layers.0' and detach 'encoder' are one module, registered "
            "as 'layers.0'; name it once",
        ),
        (
            IsolationSpec(detach=["layers.0"], clone=["encoder"]),
            "IsolationSpec(clone): 'encoder' and detach 'layers.0' are one module, registered "
            "as 'layers.0'; name it once",
        ),
    ],
)
def test_one_branch_named_by_two_paths_is_refused_before_wrapping(
    spec: IsolationSpec, message: str
) -> None:
    model = Aliased()
    layer = model.layers[0]
    with pytest.raises(SpecError) as raised:
        spec.apply(model)
    assert str(raised.value) == message
    assert model.layers[0] is layer and dict(model.named_modules())["layers.0"] is layer


def test_a_branch_already_wrapped_is_refused_with_its_wrapper_named() -> None:
    model = Net()
    model.aux = isolate.Detached(model.aux)
    with pytest.raises(WrappingError) as raised:
        resolve(IsolationSpec(detach=["aux"]), model)
    assert str(raised.value) == (
        "IsolationSpec(detach): 'aux' is already a Detached; drop it from detach, or unwrap it "
        "in the model code"
    )


def test_a_nested_branch_is_replaced_on_its_parent() -> None:
    model = Net()
    (wrap,) = resolve(IsolationSpec(detach=["trunk.3"]), model).wraps
    assert (wrap.kind, wrap.name, wrap.leaf) == ("detach", "trunk.3", "3")
    assert wrap.parent is model.trunk and wrap.child is model.trunk[3]


@pytest.mark.parametrize(
    ("spec", "model", "error", "message"),
    [
        (
            IsolationSpec(),
            [nn.Linear(2, 2)],
            isolate.errors.IsolationTypeError,
            "IsolationSpec: model must be a torch.nn.Module, got list",
        ),
        (
            IsolationSpec(protect={"main": ["nowhere"]}),
            Net(),
            SelectorError,
            "IsolationSpec(protect['main']): 'nowhere' matched no parameter of Net",
        ),
        (
            IsolationSpec(contracts=[{"kind": "teacher", "select": "trnk"}]),
            Net(),
            SelectorError,
            "IsolationSpec(contract 'teacher:trnk'): 'trnk' matched no parameter of Net",
        ),
    ],
    ids=["no-module", "protect", "contract"],
)
def test_what_cannot_be_resolved_is_refused_in_the_specs_name(
    spec: IsolationSpec, model: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        resolve(spec, model)
    assert str(raised.value).startswith(message)
