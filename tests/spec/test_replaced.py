"""A parameter replaced after the spec was applied is named at the next check, with what
changed: identity, requires_grad, optimizer membership.

Each way of replacing runs for real (``module.weight = nn.Parameter(...)`` as float8 training
re-registers weights, torch's tensor parallelism on a 1-process mesh, ``to_empty`` under
torch's overwrite flag, ``load_state_dict(assign=True)``), then an optimizer step shows the
harm: the freeze, the thaw and the flag and optimizer checks apply to the old objects.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from isolate import IsolationWarning
from isolate.errors import ReplacedParameterError
from isolate.spec import IsolationSpec, Thaw

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*took \\d+ frozen parameters out of the optimizers"
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def _step(model: Net, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(16, 4, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    opt.step()


def _values(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def reregister(model: Net) -> None:
    """What float8 training and older tensor-parallel code do: a new Parameter per weight,
    which requires grad by default."""
    layer = model.trunk[0]
    layer.weight = nn.Parameter(layer.weight.detach().clone())


def assign(model: Net) -> None:
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def to_empty(model: Net) -> None:
    values = {k: v.clone() for k, v in model.state_dict().items()}
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to_empty(device="cpu")  # new Parameters under the flag (as across devices)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    model.load_state_dict(values)


def tensor_parallel(model: Net) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(model.trunk[0], init_device_mesh("cpu", (1,)), ColwiseParallel())


@pytest.fixture
def one_process() -> Iterator[None]:
    """A process group of one (gloo), for tensor parallelism on a mesh of one CPU."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


PATHS: dict[str, Callable[[Net], None]] = {
    "reregister": reregister,
    "assign": assign,
    "to_empty": to_empty,
    "tensor_parallel": tensor_parallel,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_replaced_frozen_weight_moves_and_is_named_with_what_changed(
    path: str, request: pytest.FixtureRequest
) -> None:
    if path == "tensor_parallel":
        request.getfixturevalue("one_process")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    handle = IsolationSpec(freeze=["trunk"]).apply(model, optimizer=opt)  # trunk taken out
    spec_object = handle.plan.frozen["trunk.0.weight"]
    before = _values(spec_object)
    PATHS[path](model)
    new = model.trunk[0].weight
    assert new is not spec_object
    # What a finetuning callback does to a frozen backbone: by module, so to the new object.
    new.requires_grad_(True)
    opt.add_param_group({"params": [new]})
    _step(model, opt)
    assert not torch.equal(_values(new), before)  # the frozen base weight moved
    assert not spec_object.requires_grad  # while the spec's object looks frozen
    with pytest.raises(ReplacedParameterError) as raised:
        handle.verify()
    message = str(raised.value)
    assert message.startswith("IsolationSpec: at epoch 0, step 0, the spec's parameter")
    assert (
        "  trunk.0.weight (frozen): a new object; requires grad (the spec's object: "
        "requires_grad=False); in optimizer 0, group 1\n"
    ) in message
    assert "Fix: replace parameters before applying the spec" in message
    # Nothing the spec does not apply to is named.
    assert "head." not in message.split("\nThe spec holds")[0]
    with pytest.warns(IsolationWarning, match=r"trunk.0.weight \(frozen\): a new object"):
        warned = handle.verify(on_violation="warn")
    assert warned.params == 4 and len(warned.violations) == 1
    assert warned.drift == warned.flags == 0  # not checked against objects no longer used
    handle.restore()


@pytest.mark.parametrize("path", ["reregister", "assign"])
def test_a_thaw_of_a_replaced_group_is_refused_before_it_flips_anything(path: str) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk", step=1, lr=0.1)])
    handle = spec.apply(model, optimizer=opt)
    loop = handle.check_every(1)
    spec_object = handle.plan.frozen["trunk.0.weight"]
    PATHS[path](model)
    groups = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(
        ReplacedParameterError,
        match=r"before thawing \['trunk'\] \(epoch 0, step 1\), the spec's parameter"
        r".*\n  trunk.0.weight \(frozen, to be thawed by 'trunk'\): a new object",
    ):
        loop.begin_step(epoch=0, step=1)
    with pytest.raises(ReplacedParameterError, match=r"before thawing 'trunk', "):
        handle.step(epoch=0, step=1)  # a loop of its own calls the handle directly
    assert handle.thawed == () and not spec_object.requires_grad
    assert [list(g["params"]) for g in opt.param_groups] == groups
    # The harm refused: the thaw flips the spec's object and adds it to the optimizer, and
    # the model's weight, which the forward uses, never trains.
    before = model.trunk[0].weight.detach().clone()
    for p in handle.plan.group("trunk").params.values():
        p.requires_grad_(True)
    opt.add_param_group({"params": list(handle.plan.group("trunk").params.values())})
    _step(model, opt)
    assert torch.equal(model.trunk[0].weight, before)
    handle.restore()


def test_attach_refuses_layers_built_again_and_leaves_the_optimizer() -> None:
    model = Net()
    handle = IsolationSpec(freeze=["trunk.0"]).apply(model)
    model.trunk[0] = nn.Linear(4, 8)  # a configure_model that builds the layer again
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(ReplacedParameterError) as raised:
        handle.attach(opt)
    assert "at attach, the spec's parameters 'trunk.0.weight', 'trunk.0.bias' were" in str(
        raised.value
    )
    assert "  trunk.0.bias (frozen): a new object; requires grad (the spec's object: " in str(
        raised.value
    )
    assert "in optimizer 0, group 0" in str(raised.value)
    assert [list(g["params"]) for g in opt.param_groups] == held
    handle.restore()


def test_what_each_parameter_is_to_the_spec_is_named() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = IsolationSpec(
        freeze=["trunk"], thaw=[Thaw("trunk.2", step=1, lr=0.1)], protect={"aux": ["head"]}
    )
    handle = spec.apply(model, optimizer=opt)
    handle.step(epoch=0, step=1)  # trunk.2 thawed: in optimizer 0, group 1
    for layer in (model.trunk[0], model.trunk[2], model.head):
        layer.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
    model.trunk[0].weight = None  # type: ignore[assignment]
    with pytest.raises(ReplacedParameterError) as raised:
        handle.verify(checks=("params",))
    lines = str(raised.value).splitlines()
    assert lines[1:5] == [
        "  trunk.0.weight (frozen): no longer in the model",
        "  trunk.0.bias (frozen): a new object",
        "  trunk.2.bias (thawed by 'trunk.2'): a new object; does not require grad (the "
        "spec's object: requires_grad=True); optimizer 0, group 1 still holds the old one",
        "  head.bias (protected from 'aux'): a new object; does not require grad (the spec's "
        "object: requires_grad=True); optimizer 0, group 0 still holds the old one",
    ]
    handle.restore()


def test_replaced_parameters_are_named_in_model_order_at_most_eight_lines() -> None:
    # Protected before frozen in the model, frozen first in the spec; a name with a space.
    layers = {"first layer": nn.Linear(2, 2), **{f"l{i}": nn.Linear(2, 2) for i in range(4)}}
    model = nn.ModuleDict(layers)
    handle = IsolationSpec(freeze=["l0", "l1", "l2", "l3"], protect={"aux": ["first layer"]}).apply(
        model
    )
    for layer in model.values():
        layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
        layer.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
    with pytest.raises(ReplacedParameterError) as raised:
        handle.verify(checks=("params",))
    header, *lines = str(raised.value).splitlines()
    assert header == (
        "IsolationSpec: at epoch 0, step 0, the spec's parameters 'first layer.weight', "
        "'first layer.bias', 'l0.weight', 'l0.bias', 'l1.weight' and 5 more were replaced or "
        "removed after it was applied:"
    )
    assert [line.split(" (")[0] for line in lines[:9]] == [
        "  first layer.weight",
        "  first layer.bias",
        *(f"  l{i}.{w}" for i in range(3) for w in ("weight", "bias")),
        "The spec holds the old objects: its freeze, thaws and checks do not apply to the new "
        "ones. Fix: replace parameters before applying the spec",
    ]
    handle.restore()


def test_the_same_object_under_another_name_is_still_the_specs() -> None:
    import torch.nn.utils.parametrize as parametrize

    class Same(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model = Net()
    handle = IsolationSpec(freeze=["trunk"]).apply(model)
    parametrize.register_parametrization(model.trunk[0], "weight", Same())
    assert handle.verify(checks=("params",)).params == 4
    handle.restore()
    parametrize.remove_parametrizations(model.trunk[0], "weight")


def test_a_weight_tied_to_another_after_apply_is_named_with_what_it_is_now() -> None:
    model = nn.ModuleDict({"embed": nn.Linear(4, 4, bias=False), "head": nn.Linear(4, 4)})
    handle = IsolationSpec(freeze=["head"]).apply(model)
    model["head"].weight = model["embed"].weight  # tied after apply, as tie_weights() does
    with pytest.raises(ReplacedParameterError) as raised:
        handle.verify(checks=("params",))
    assert str(raised.value).splitlines()[:2] == [
        "IsolationSpec: at epoch 0, step 0, the spec's parameter 'head.weight' was replaced or "
        "removed after it was applied:",
        "  head.weight (frozen): a new object; requires grad (the spec's object: "
        "requires_grad=False)",
    ]
    handle.restore()


def test_a_spec_applied_while_fsdp_holds_temporaries_freezes_the_sharded_parameters(
    one_process: None,
) -> None:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model)
    with torch.no_grad():
        model(torch.ones(1, 4))  # a validation pass: the unit stays unsharded after it
    assert not isinstance(model[1].weight, DTensor)  # the module holds temporaries
    handle = IsolationSpec(freeze=["1"]).apply(model)
    model(torch.ones(1, 4)).sum().backward()
    weight = model[1].weight
    assert isinstance(weight, DTensor) and not weight.requires_grad and weight.grad is None
    handle.restore()


def test_a_restore_while_fsdp_holds_temporaries_gives_the_sharded_parameters_back(
    one_process: None,
) -> None:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model)
    handle = IsolationSpec(freeze=["1"]).apply(model)
    with torch.no_grad():
        model(torch.ones(1, 4))  # a validation pass: the unit stays unsharded after it
    assert not isinstance(model[1].weight, DTensor)
    handle.restore()
    weight = model[1].weight  # the sharded parameter, which an optimizer built now must get
    assert isinstance(weight, DTensor) and weight.requires_grad
    model(torch.ones(1, 4)).sum().backward()
    assert weight.grad is not None
