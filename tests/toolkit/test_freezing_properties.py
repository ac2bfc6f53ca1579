"""Property tests: random module trees under random nested freeze / unfreeze / restore
sequences. Every call changes exactly what its selectors pick (checked against an
independent model of the selector grammar), a selector that picks nothing is refused before
anything changes, BatchNorm layers follow their policy, and every restore comes back exactly.

Hypothesis runs derandomized and without an example database (see ``tests/conftest.py``).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from isolate import freeze
from isolate.errors import SelectorError
from isolate.freezing import FreezeHandle, unfreeze

LEAVES = st.sampled_from(["linear", "bn", "bn_noaffine", "relu", "layernorm"])
_GLOBS = ("*.bias", "*weight", "*", "1.*", "*.running_mean")
_BN = nn.modules.batchnorm._BatchNorm


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


def structure(model: nn.Module) -> Any:
    """Everything a restore must bring back: flags, identities, classes, modes, hooks."""
    return (
        [(n, id(p), p.requires_grad) for n, p in model.named_parameters()],
        [(n, type(m), m.training, len(m._forward_pre_hooks)) for n, m in model.named_modules()],
    )


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _same_buffers(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _selectors(model: nn.Module, draw: st.DrawFn) -> tuple[str, ...]:
    names = [n for n, _ in model.named_parameters()]
    modules = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters())]
    options: list[str] = [*names, *modules, *_GLOBS]
    return tuple(draw(st.lists(st.sampled_from(options), max_size=3)))


# --- an independent model of the selector grammar, written from the docs -----------------


def _picks(selector: str, name: str) -> bool:
    if set(selector) & set("*?["):
        return fnmatch.fnmatchcase(name, selector)
    return name == selector or name.startswith(selector + ".")


@dataclass
class Expected:
    params: list[str]  # picked parameter names, model order
    norms: list[str]  # BatchNorm layers whose policy the call sets


def expected_selection(model: nn.Module, selectors: tuple[str, ...]) -> Expected | str | None:
    """What a selection must pick, or the first selector that picks nothing (``None``: the
    whole model, which holds no parameter)."""
    names = [n for n, _ in model.named_parameters()]
    if not names and not selectors:
        return None
    for s in selectors:
        if not any(_picks(s, n) for n in names):
            return s
    picked = [n for n in names if not selectors or any(_picks(s, n) for s in selectors)]
    norms = []
    for name, m in model.named_modules():
        if not isinstance(m, _BN):
            continue
        own = [f"{name}.{p}" for p, t in m.named_parameters(recurse=False) if t is not None]
        covered = (
            not selectors
            or (own and all(n in picked for n in own))
            # a layer without affine parameters is covered by a module name over its place
            or any(not set(s) & set("*?[") and _picks(s, name) for s in selectors)
            # ... or by a glob over one of its buffers
            or any(
                set(s) & set("*?[") and _picks(s, f"{name}.{b}")
                for s in selectors
                for b, _ in m.named_buffers(recurse=False)
            )
        )
        if covered:
            norms.append(name)
    return Expected(picked, norms)


def test_freezing_a_model_without_parameters_names_the_problem() -> None:
    model = nn.Sequential(nn.ReLU(), nn.BatchNorm1d(2, affine=False))
    with pytest.raises(SelectorError, match=r"^freeze\(\): ") as info:
        freeze(model)
    assert "exclusion" not in str(info.value), str(info.value)
    assert "Sequential" in str(info.value), str(info.value)


# --- the property ---------------------------------------------------------------------------


def test_the_hypothesis_profile_is_reproducible_and_writes_nothing() -> None:
    assert settings.default.derandomize is True
    assert settings.default.database is None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_nested_sequences_change_exactly_the_selection_and_restore_exactly(
    data: st.DataObject,
) -> None:
    model = data.draw(trees())
    names = [n for n, _ in model.named_parameters()]
    if not names:
        event("a tree without parameters")
        # Nothing to pick: names, globs and the whole model are all refused, before anything
        # changes (see test_freezing_a_model_without_parameters_names_the_problem).
        before = structure(model)
        for selectors in [(glob,) for glob in _GLOBS] + [()]:
            for operation in (freeze, unfreeze):
                with pytest.raises(SelectorError, match=rf"^{operation.__name__}\(\): "):
                    operation(model, *selectors)
                assert structure(model) == before
    if data.draw(st.booleans()):
        model.eval()
    for p in model.parameters():  # some parameters start out frozen by the user
        p.requires_grad_(data.draw(st.booleans()))
    handles: list[tuple[FreezeHandle, Expected, str]] = []
    try:
        states = [structure(model)]
        modules = dict(model.named_modules())
        for _ in range(data.draw(st.integers(1, 8))):
            action = data.draw(
                st.sampled_from(
                    ["freeze", "unfreeze", "restore", "train", "forward", "forward_train"]
                )
            )
            if action in ("freeze", "unfreeze"):
                selectors = _selectors(model, data.draw)
                bn = data.draw(st.sampled_from(["eval", "train"]))
                operation = freeze if action == "freeze" else unfreeze
                expected = expected_selection(model, selectors)
                flags = {n: p.requires_grad for n, p in model.named_parameters()}
                modes = {n: m.training for n, m in modules.items()}
                if not isinstance(expected, Expected):
                    # "*.running_mean" names buffers only; "1.*" may name a child without parameters
                    event(f"{action}: a selector matched nothing")
                    message = rf"^{action}\(\): "
                    if expected is not None:
                        message += rf"{re.escape(repr(expected))} matched no parameter"
                    with pytest.raises(SelectorError, match=message):
                        operation(model, *selectors, bn=bn)
                    assert structure(model) == states[-1], "a refused call changed the model"
                    continue
                handle = operation(model, *selectors, bn=bn)
                event(f"{action} with {len(expected.norms)} BatchNorm layers")
                assert list(handle.names) == expected.params
                assert sorted(handle.norms) == sorted(expected.norms)
                want = action == "unfreeze"
                for n, p in model.named_parameters():
                    assert p.requires_grad == (want if n in expected.params else flags[n]), n
                for n, m in modules.items():
                    if n in expected.norms:
                        assert m.training == (False if bn == "eval" else model.training), n
                    else:
                        assert m.training == modes[n], n
                handles.append((handle, expected, bn))
                states.append(structure(model))
            elif action == "restore" and handles:
                held = buffers(model)
                handles.pop()[0].restore()
                states.pop()
                assert structure(model) == states[-1]
                assert _same_buffers(buffers(model), held), "restore() touched a buffer"
            elif action == "train" and not handles:
                model.train(data.draw(st.booleans()))
                states[-1] = structure(model)
            elif action in ("forward", "forward_train"):
                # forward_train: a parent's .train() must not wake a layer held in eval mode.
                modes = {n: m.training for n, m in modules.items()}
                if action == "forward_train":
                    model.train()
                before = buffers(model)
                with torch.no_grad():
                    model(torch.randn(4, 2))
                policy: dict[str, str] = {}
                for _, expected, bn in handles:  # the newest handle's policy is the one in force
                    policy.update(dict.fromkeys(expected.norms, bn))
                for n, m in modules.items():
                    if not isinstance(m, _BN):
                        continue
                    held_in_eval = policy.get(n) == "eval"
                    training = m.training
                    if held_in_eval:
                        event("a BatchNorm layer held in eval mode through a forward")
                        assert not training, f"{n} left eval mode under freeze(bn='eval')"
                    key = f"{n}.num_batches_tracked"
                    moved = not torch.equal(before[key], buffers(model)[key])
                    assert moved == training, f"{n}: statistics moved={moved}, training={training}"
                for n, m in modules.items():  # put the modes back by hand: restore records them
                    m.training = modes[n]
                assert structure(model) == states[-1]
        while handles:
            held = buffers(model)
            handles.pop()[0].restore()
            states.pop()
            assert structure(model) == states[-1]
            assert _same_buffers(buffers(model), held), "restore() touched a buffer"
    finally:  # a failing example must not leave flags flipped for the next one
        for handle, _, _ in reversed(handles):
            if handle.active:
                handle.restore()
