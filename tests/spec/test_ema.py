"""The ``ema`` contract: a target network that is the exponential moving average of another,
each clause broken on its own and named in full."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

from isolate.errors import ContractError, SelectorError, SpecError
from isolate.spec import IsolationSpec
from isolate.spec.ema import _deviations


class Pair(nn.Module):
    """An online network with BatchNorm and an integer buffer of two numbers, and its copy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.online = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.online.register_buffer("seen", torch.zeros(2, dtype=torch.long))
        self.target = copy.deepcopy(self.online).requires_grad_(False)


Update = Callable[[Pair], None]


def run(
    update: Update,
    *,
    model: Pair | None = None,
    decay: float = 0.9,
    integers: str = "copy",
    steps: int = 2,
    optimized: Callable[[Pair], list[nn.Parameter]] | None = None,
    freeze: bool = True,
    errors: list[str] | None = None,
) -> dict:
    """Train ``model.online`` for ``steps`` steps, ``update`` after each optimizer step; the
    verdicts of the contract. With ``errors``, each step's violation is kept there instead of
    raised."""
    model = model or Pair()
    params = optimized(model) if optimized else list(model.online.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    contract = {
        "kind": "ema",
        "target": "target",
        "online": "online",
        "decay": decay,
        "integers": integers,
    }

    def guarded(call: Callable[[], object]) -> None:
        try:
            call()
        except ContractError as error:
            if errors is None:
                raise
            errors.append(str(error))

    spec = IsolationSpec(freeze=["target"] if freeze else [], mode="eval", contracts=[contract])
    with spec.applied(model, opt) as handle:
        loop = handle.check_every(1)
        for i in range(steps):
            guarded(lambda i=i: loop.begin_step(epoch=0, step=i))
            x = torch.randn(8, 4, dtype=model.online[0].weight.dtype)
            loss = model.online(x).pow(2).mean()
            loop.before_backward(loss, {})
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model.online.seen += 1
                update(model)
            loop.end_step()
        guarded(loop.finish)
        return handle.contracts.verdicts["ema:target"]["clauses"]


def lerp(decay: float, integers: bool = True) -> Update:
    def update(model: Pair) -> None:
        for t, o in zip(
            model.target.state_dict().values(), model.online.state_dict().values(), strict=True
        ):
            if t.is_floating_point():
                t.lerp_(o, 1 - decay)
            elif integers:
                t.copy_(o)

    return update


def test_a_right_ema_holds() -> None:
    verdicts = run(lerp(0.9))
    assert {c: (v["checked"], v["violated"]) for c, v in verdicts.items()} == {
        "gets no gradient": (2, 0),  # before backward, each step
        "in no optimizer": (4, 0),  # before and after backward
        "equals the EMA of the online network": (2, 0),  # over step 0, and at the end
        "moves": (2, 0),
        "integer buffers are copied from the online network": (2, 0),
    }


def test_a_target_an_optimizer_holds_is_named_in_the_contract_s_name() -> None:
    with pytest.raises(ContractError) as error:
        run(lerp(0.9), optimized=lambda m: [*m.online.parameters(), m.target[0].bias], freeze=False)
    assert str(error.value) == (
        "IsolationSpec: at step 0, contract 'ema:target' (ema) breaks its clause 'in no "
        "optimizer': an optimizer holds ['target.0.bias (optimizer 0, group 0)']"
    )


def test_integer_buffers_of_several_numbers_are_named_by_their_shape() -> None:
    with pytest.raises(ContractError) as error:
        run(lerp(0.9, integers=False))
    assert str(error.value) == (
        "IsolationSpec: at the start of step 1, contract 'ema:target' (ema) breaks its clause "
        "'integer buffers are copied from the online network': ['seen = tensor of shape (2,), "
        "expected tensor of shape (2,)', '1.num_batches_tracked = 0, expected 1']"
    )


def test_networks_that_hold_different_tensors_are_refused_with_both_sides_named() -> None:
    model = Pair()
    model.target.register_buffer("extra", torch.zeros(1))
    contract = {"kind": "ema", "target": "target", "online": "online", "decay": 0.9}
    with pytest.raises(SpecError) as error:
        IsolationSpec(contracts=[contract]).apply(model)
    assert str(error.value) == (
        "IsolationSpec(contract 'ema:target'): the target 'target' and the online network "
        "'online' hold different tensors: only the target has ['extra'], only the online "
        "network []; an EMA pairs them by name"
    )


def test_networks_whose_tensors_differ_in_shape_are_refused() -> None:
    model = Pair()
    model.target.seen = torch.zeros(3, dtype=torch.long)
    contract = {"kind": "ema", "target": "target", "online": "online", "decay": 0.9}
    with pytest.raises(SpecError) as error:
        IsolationSpec(contracts=[contract]).apply(model)
    assert str(error.value) == (
        "IsolationSpec(contract 'ema:target'): ['seen'] differ in shape between the networks"
    )


def test_a_target_that_does_not_move_is_named_tensor_by_tensor() -> None:
    def only_weight(model: Pair) -> None:
        model.target[0].weight.lerp_(model.online[0].weight, 0.1)
        model.target.seen.copy_(model.online.seen)
        model.target[1].num_batches_tracked.copy_(model.online[1].num_batches_tracked)

    # (0.bias is not named: before BatchNorm it gets no gradient, so the EMA keeps it too)
    errors: list[str] = []
    verdicts = run(only_weight, errors=errors)
    assert errors[0] == (
        "IsolationSpec: at the start of step 1, contract 'ema:target' (ema) breaks its clause "
        "'moves': ['1.weight (parameter)', '1.bias (parameter)', '1.running_mean (buffer)', "
        "'1.running_var (buffer)'] did not move over optimizer step 0 (decay 0.9), while the "
        "EMA moves them"
    )
    assert {c: (v["checked"], v["violated"]) for c, v in verdicts.items()} == {
        "gets no gradient": (1, 0),  # step 1 stopped at its start
        "in no optimizer": (3, 0),
        "equals the EMA of the online network": (2, 0),
        "moves": (2, 2),
        "integer buffers are copied from the online network": (2, 0),
    }


def test_kept_integer_buffers_that_change_are_named() -> None:
    with pytest.raises(ContractError) as error:
        run(lerp(0.9), integers="keep")
    assert str(error.value) == (
        "IsolationSpec: at the start of step 1, contract 'ema:target' (ema) breaks its clause "
        "'integer buffers are kept': ['seen = tensor of shape (2,), expected tensor of shape "
        "(2,)', '1.num_batches_tracked = 1, expected 0']"
    )
    kept = run(lerp(0.9, integers=False), integers="keep")
    assert kept["integer buffers are kept"] == {"checked": 2, "violated": 0, "first": None}


def test_tensors_moved_by_another_rule_and_tensors_left_still_are_both_named() -> None:
    def weights_only(model: Pair) -> None:
        model.target[0].weight.lerp_(model.online[0].weight, 0.5)
        model.target[1].running_mean.lerp_(model.online[1].running_mean, 0.5)

    errors: list[str] = []
    verdicts = run(weights_only, integers="keep", decay=0.75, errors=errors)
    off = r"off by \d\.\de\+0\d x tolerance"
    assert len(errors) == 2
    assert re.fullmatch(
        r"IsolationSpec: at the start of step 1, contract 'ema:target' \(ema\) breaks its "
        r"clause 'equals the EMA of the online network': "
        rf"\['0.weight \(parameter, {off}\)', '1.running_mean \(buffer, {off}\)'\] moved by "
        r"another rule over optimizer step 0 \(decay 0.75\)",
        errors[0],
    )
    assert errors[1].startswith("IsolationSpec: at the end of training, contract 'ema:target'")
    assert "over optimizer step 1 (decay 0.75)" in errors[1]
    assert verdicts["equals the EMA of the online network"]["checked"] == 2
    assert verdicts["equals the EMA of the online network"]["violated"] == 2
    assert verdicts["moves"] == {
        "checked": 2,
        "violated": 2,
        "first": "IsolationSpec: at the start of step 1, contract 'ema:target' (ema) breaks its "
        "clause 'moves': ['1.weight (parameter)', '1.bias (parameter)', '1.running_var "
        "(buffer)'] did not move over optimizer step 0 (decay 0.75), while the EMA moves them",
    }
    assert verdicts["integer buffers are kept"] == {"checked": 2, "violated": 0, "first": None}


def test_a_target_moved_everywhere_by_another_decay_still_moves() -> None:
    errors: list[str] = []
    verdicts = run(lerp(0.5), errors=errors)
    assert len(errors) == 2
    assert {c: (v["checked"], v["violated"]) for c, v in verdicts.items()} == {
        "gets no gradient": (1, 0),  # step 1 stopped at its start
        "in no optimizer": (3, 0),
        "equals the EMA of the online network": (2, 2),
        "moves": (2, 0),
        "integer buffers are copied from the online network": (2, 0),
    }


def test_networks_of_different_float_dtypes_are_compared_in_float32() -> None:
    def update(model: Pair) -> None:
        for t, o in zip(
            model.target.state_dict().values(), model.online.state_dict().values(), strict=True
        ):
            t.copy_(t.float().lerp(o.float(), 0.1) if t.is_floating_point() else o)

    half_target, half_online = Pair(), Pair()
    half_target.target.to(torch.bfloat16)  # an EMA stored in bfloat16
    half_online.online.to(torch.bfloat16)  # a float32 EMA of a network trained in bfloat16
    for model in (half_target, half_online):
        verdicts = run(update, model=model)
        assert verdicts["equals the EMA of the online network"] == {
            "checked": 2,
            "violated": 0,
            "first": None,
        }


def deviations(
    old: torch.Tensor, new: torch.Tensor, online: torch.Tensor, decay: float = 0.5
) -> dict[str, float]:
    return dict(_deviations({"w": old}, {"w": new}, {"w": online}, ["w"], decay))


def test_a_target_is_held_to_four_roundings_of_the_sizes_of_its_operands() -> None:
    one, eps = torch.ones(1), torch.finfo(torch.float32).eps
    # expected 1 exactly; the tolerance is 4 eps times |old| + |online| + |new|, about 12 eps
    assert deviations(one, one + 11 * eps, one) == {}
    assert deviations(one, one + 13 * eps, one) == {"w": pytest.approx(13 / 12, rel=1e-6)}


def test_a_target_off_by_exactly_its_tolerance_is_held() -> None:
    zero, tiny = torch.zeros(1), torch.finfo(torch.float32).tiny
    # new = tiny + 2^-147: its tolerance, new * 4 eps + tiny, rounds to new itself
    new = torch.tensor([tiny + 2.0**-147])
    assert deviations(zero, new, zero) == {}
    assert deviations(zero, 2 * new, zero) == {"w": pytest.approx(2.0)}


def test_an_empty_tensor_is_never_off() -> None:
    empty = torch.zeros(0)
    assert deviations(empty, empty, empty) == {}


@pytest.mark.parametrize(
    ("side", "name", "contract"),
    [("target", "targt", "ema:targt"), ("online", "onlin", "ema:target")],
)
def test_a_network_that_is_no_submodule_is_refused_in_the_contract_s_name(
    side: str, name: str, contract: str
) -> None:
    given = {"kind": "ema", "target": "target", "online": "online", "decay": 0.9, side: name}
    with pytest.raises(SelectorError) as error:
        IsolationSpec(contracts=[given]).apply(Pair())
    assert str(error.value) == (
        f"IsolationSpec(contract {contract!r}): {name!r} is not a submodule of Pair; its children "
        "are ['online', 'target']; name a submodule with its dotted path"
    )
