"""Property tests: random module trees under random nested freeze / unfreeze / restore
sequences always come back exactly."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from isolate import FreezeHandle, freeze, unfreeze

LEAVES = st.sampled_from(["linear", "bn", "bn_noaffine", "relu", "layernorm"])


@st.composite
def trees(draw: st.DrawFn, depth: int = 0) -> nn.Module:
    width = draw(st.integers(1, 3))
    children: list[nn.Module] = []
    for _ in range(width):
        if depth < 2 and draw(st.booleans()):
            children.append(draw(trees(depth=depth + 1)))
            continue
        kind = draw(LEAVES)
        children.append(
            {
                "linear": lambda: nn.Linear(2, 2),
                "bn": lambda: nn.BatchNorm1d(2),
                "bn_noaffine": lambda: nn.BatchNorm1d(2, affine=False),
                "relu": nn.ReLU,
                "layernorm": lambda: nn.LayerNorm(2),
            }[kind]()
        )
    return nn.Sequential(*children)


def snapshot(model: nn.Module) -> Any:
    return (
        [(n, id(p), p.requires_grad) for n, p in model.named_parameters()],
        [(n, type(m), m.training, len(m._forward_pre_hooks)) for n, m in model.named_modules()],
    )


def _selectors(model: nn.Module, draw: st.DrawFn) -> tuple[Any, ...]:
    names = [n for n, _ in model.named_parameters()]
    modules = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters())]
    options: list[Any] = names + modules + ["*.bias", "*weight"]
    picked = draw(st.lists(st.sampled_from(options), max_size=3)) if options else []
    return tuple(picked)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_nested_sequences_restore_exactly(data: st.DataObject) -> None:
    model = data.draw(trees())
    if not any(True for _ in model.parameters()):
        return
    if data.draw(st.booleans()):
        model.eval()
    for p in model.parameters():  # some parameters start out frozen by the user
        p.requires_grad_(data.draw(st.booleans()))
    states = [snapshot(model)]
    handles: list[FreezeHandle] = []
    for _ in range(data.draw(st.integers(1, 8))):
        action = data.draw(st.sampled_from(["freeze", "unfreeze", "restore", "train", "forward"]))
        if action in ("freeze", "unfreeze"):
            selectors = _selectors(model, data.draw)
            bn = data.draw(st.sampled_from(["eval", "train"]))
            operation = freeze if action == "freeze" else unfreeze
            try:
                handle = operation(model, *selectors, bn=bn)
            except ValueError:
                # "*.bias" may match nothing in this tree: the call must have changed nothing
                assert snapshot(model) == states[-1]
                continue
            handles.append(handle)
            states.append(snapshot(model))
        elif action == "restore" and handles:
            handles.pop().restore()
            states.pop()
            assert snapshot(model) == states[-1]
        elif action == "train" and not handles:
            model.train(data.draw(st.booleans()))
            states[-1] = snapshot(model)
        elif action == "forward":
            with torch.no_grad():
                model(torch.randn(4, 2))
    while handles:
        handles.pop().restore()
        states.pop()
        assert snapshot(model) == states[-1]
