"""Holds and wrappers survive copies: a copy of a Frozen, Detached or
Cloned module made by copy.deepcopy, pickle, torch.save/torch.load or EMA/SWA averaging is a
wrapper of its own over the copied module, and releasing it never touches the original.

Also the property test: random models under random freeze specs, with deepcopies, dtype
casts, state_dict round trips and optimizer steps in between, always restore exactly.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import isolate
import isolate.errors
import isolate.freezing
from isolate import Cloned, Detached, Frozen, _holding, freezing
from isolate.errors import RestoreError, WrappingError
from isolate.freezing import FreezeHandle


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = Frozen(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh()))
        self.head = nn.Linear(4, 2)
        self.aux = Detached(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        self.editor = Cloned(nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        return self.head(features), self.aux(self.editor(features)).sum(1)


def _torch_save(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded: nn.Module = torch.load(buffer, weights_only=False)
    return loaded


COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _torch_save,
    "SWA": lambda m: AveragedModel(m).module,
    "EMA": lambda m: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)).module,
}


def _held(net: Net) -> bool:
    """Whether the trunk's BatchNorm stays in eval mode and keeps its statistics through a
    forward in train mode, and its parameters are frozen."""
    bn = net.trunk.module[1]
    before = bn.running_mean.clone()
    net.train()
    net(torch.randn(8, 3))
    held = not bn.training and torch.equal(bn.running_mean, before)
    flags = {p.requires_grad for p in net.trunk.parameters()}
    assert flags == ({False} if held else {True})
    return held


def _hooks(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) for m in module.modules())


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copied_model_is_held_by_its_own_wrappers(how: str) -> None:
    net = Net()
    assert _held(net)
    twin = COPIES[how](net)
    assert isinstance(twin, Net) and twin.trunk is not net.trunk
    assert twin.trunk._handle is not net.trunk._handle and twin.trunk._handle.active
    assert twin.trunk._handle in freezing._active  # seen by nesting checks and leak checks
    assert _held(twin)

    # The copy's branch is isolated too: no gradient from aux reaches the copied trunk's input.
    x = torch.randn(8, 3, requires_grad=True)
    twin.aux(twin.trunk(x)).sum().backward()
    assert x.grad is None and twin.aux.module[0].weight.grad is not None

    twin.trunk.unwrap()  # releases the copy: flags back, BatchNorm follows train() again
    assert not _held(twin)
    assert _hooks(twin.trunk.module) == 0
    assert _held(net)  # the original is still held
    assert _hooks(net.trunk.module) == 1
    net.trunk.unwrap()
    assert not _held(net)


@pytest.mark.parametrize("how", list(COPIES))
def test_copied_branch_wrappers_are_independent(how: str) -> None:
    net = Net()
    twin = COPIES[how](net)
    for name in ("aux", "editor"):
        original, copied = getattr(net, name), getattr(twin, name)
        kind = type(original)
        with pytest.raises(
            WrappingError, match=rf"^{kind.__name__}\(\): this .* is already wrapped"
        ):
            kind(copied.module)  # the copy is the copied module's live wrapper
        copied.unwrap()
        kind(copied.module).unwrap()  # free once the copy lets go
        with pytest.raises(WrappingError, match=r"already wrapped in a live"):
            kind(original.module)  # the original still holds the original
    twin.trunk.unwrap()
    net.trunk.unwrap()


def test_a_copy_made_while_a_freeze_is_active_stays_frozen_and_the_original_restores() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    before = [p.requires_grad for p in model.parameters()], _hooks(model)
    handle = isolate.freeze(model, "0", "1")
    twin = copy.deepcopy(model)  # the handle is not part of the model, so not copied
    handle.restore()
    assert ([p.requires_grad for p in model.parameters()], _hooks(model)) == before
    # The copy of a frozen model is frozen; unfreeze() is how to release it.
    assert [p.requires_grad for p in twin.parameters()] == [False] * 4 + [True] * 2
    twin.train()
    twin(torch.randn(5, 3))
    assert not twin[1].training
    with isolate.freezing.unfrozen(twin, "0", "1"):
        twin.train()
        twin(torch.randn(5, 3))
        assert twin[1].training and all(p.requires_grad for p in twin.parameters())


def test_a_loaded_handle_keeps_its_place_in_the_nesting_order() -> None:
    wrapped = Frozen(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    # As if written by a process that had made many handles before: the handle loaded from
    # it must still count as older than one made afterwards in this process.
    policy = _holding.find_hold(wrapped.module[1])[1]  # type: ignore[index]
    shifted = wrapped._handle._seq + 10**6
    wrapped._handle._seq, policy.stack = shifted, [(shifted, "eval")]
    loaded = pickle.loads(pickle.dumps(wrapped))
    wrapped._handle._seq, policy.stack = shifted - 10**6, [(shifted - 10**6, "eval")]
    newer = isolate.freezing.unfreeze(loaded.module, "1")
    with pytest.raises(RestoreError, match=r"^Frozen\(\): restored out of order"):
        loaded.unwrap()
    newer.restore()
    loaded.unwrap()
    assert all(p.requires_grad for p in loaded.module.parameters())
    assert _hooks(loaded.module) == 0
    wrapped.unwrap()


# ------------------------------------------------------------------------------------------
# Property: random models x random freeze specs x random operations in between.

LEAVES = st.sampled_from(["linear", "bn", "bn_noaffine", "relu", "layernorm"])


@st.composite
def trees(draw: st.DrawFn, depth: int = 0) -> nn.Module:
    children: list[nn.Module] = []
    for _ in range(draw(st.integers(1, 3))):
        if depth < 2 and draw(st.booleans()):
            children.append(draw(trees(depth=depth + 1)))
            continue
        children.append(
            {
                "linear": lambda: nn.Linear(2, 2),
                "bn": lambda: nn.BatchNorm1d(2),
                "bn_noaffine": lambda: nn.BatchNorm1d(2, affine=False),
                "relu": nn.ReLU,
                "layernorm": lambda: nn.LayerNorm(2),
            }[draw(LEAVES)]()
        )
    block = nn.Sequential(*children)
    if depth > 0 and draw(st.integers(0, 3)) == 0:
        return Frozen(block)
    return block


def snapshot(model: nn.Module) -> Any:
    return (
        [(n, id(p), p.requires_grad) for n, p in model.named_parameters()],
        [(n, type(m), m.training, len(m._forward_pre_hooks)) for n, m in model.named_modules()],
    )


def _frozen_wrappers(model: nn.Module) -> list[Frozen]:
    return [m for m in model.modules() if isinstance(m, Frozen)]


def _selectors(model: nn.Module, draw: st.DrawFn) -> tuple[Any, ...]:
    names = [n for n, _ in model.named_parameters()]
    modules = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters())]
    return tuple(draw(st.lists(st.sampled_from([*names, *modules, "*.bias"]), max_size=3)))


def _step(model: nn.Module, weight_decay: float) -> None:
    """One SGD step over *all* parameters, as users write it: frozen ones have no .grad,
    so neither weight decay nor momentum may move them."""
    dtype = next(model.parameters()).dtype
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=weight_decay)
    out = model(torch.randn(4, 2, dtype=dtype)).square().mean()
    if out.requires_grad:
        out.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)


@settings(
    derandomize=True,
    database=None,
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_restore_is_exact_through_copies_casts_loads_and_steps(data: st.DataObject) -> None:
    model = data.draw(trees())
    if not any(True for _ in model.parameters()):
        return
    if data.draw(st.booleans()):
        model.eval()
    start = snapshot(model)
    handles: list[FreezeHandle] = []
    for _ in range(data.draw(st.integers(1, 8))):
        action = data.draw(
            st.sampled_from(["freeze", "unfreeze", "restore", "copy", "cast", "load", "step"])
        )
        before = snapshot(model)
        if action in ("freeze", "unfreeze"):
            operation = isolate.freeze if action == "freeze" else isolate.freezing.unfreeze
            try:
                handle = operation(
                    model,
                    *_selectors(model, data.draw),
                    bn=data.draw(st.sampled_from(["eval", "train"])),
                )
            except isolate.errors.SelectorError:
                assert snapshot(model) == before  # refused: nothing changed
                continue
            handles.append(handle)
        elif action == "restore" and handles:
            handles.pop().restore()
        elif action == "copy":
            how = data.draw(st.sampled_from(["deepcopy", "pickle"]))
            twin = COPIES[how](model)
            assert [(n, p.requires_grad) for n, p in twin.named_parameters()] == [
                (n, p.requires_grad) for n, p in model.named_parameters()
            ]
            # Whatever happens to the copy leaves the original as it was.
            twin.train()
            _step(twin, weight_decay=0.1)
            for wrapper in _frozen_wrappers(twin):
                wrapper.unwrap()
            with isolate.freezing.unfrozen(twin):
                twin(torch.randn(4, 2, dtype=next(twin.parameters()).dtype))
            assert snapshot(model) == before
        elif action == "cast":
            model.to(data.draw(st.sampled_from([torch.float64, torch.float32])))
            assert snapshot(model) == before  # parameters converted in place
        elif action == "load":
            state = copy.deepcopy(model.state_dict())
            model.load_state_dict(state)
            assert snapshot(model) == before
        elif action == "step":
            values = [p.detach().clone() for p in model.parameters() if not p.requires_grad]
            _step(model, weight_decay=data.draw(st.sampled_from([0.0, 0.1])))
            after = [p.detach() for p in model.parameters() if not p.requires_grad]
            assert all(torch.equal(a, b) for a, b in zip(values, after, strict=True))
            assert snapshot(model) == before
    for handle in reversed(handles):
        handle.restore()
    assert snapshot(model) == start
    for wrapper in _frozen_wrappers(model):
        wrapper.unwrap()
