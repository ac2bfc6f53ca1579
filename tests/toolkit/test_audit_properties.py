"""Every audit agrees with brute force or raises; none passes vacuously.

Hypothesis builds random small programs over random module trees: branches, detaches,
clones, gradient scales (0 included), in-place ops on clones and on views, tied parameters,
views, ``no_grad`` islands, parameters read through ``.detach()``, checkpoints (reentrant or
not) and custom Functions, in float32, float16 and bfloat16. On every one:

* ``reachable_parameters`` never under-reports: each parameter a real backward gives a
  gradient to is named. It over-reports only where the gradient is structurally absent: a
  custom Function that returns ``None`` for an input it used. The same program with that
  Function returning zeros instead must then agree exactly with brute force.
* ``cut_off_parameters`` names exactly the trainable parameters no loss reaches (with or
  without a trace), never one that gets a gradient, reentrant checkpoints included (the
  walk re-runs their segments, as backward does).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import isolate
from isolate.cutoff import cut_off_parameters, trace_forward
from isolate.reachability import reachable_parameters

pytestmark = pytest.mark.usefixtures("one_thread")


class _Gate(torch.autograd.Function):
    """x * w going forward; going back, ``None`` (``drop=True``) or zeros for ``w``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, drop: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.drop = drop
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        _, w = ctx.saved_tensors
        dw = None if ctx.drop else torch.zeros_like(w)
        return grad * w, dw, None


OPS = (
    "linear",
    "linear",
    "tanh",
    "add",
    "detach",
    "clone",
    "isolate_clone",
    "scale",
    "inplace",
    "inplace_view",
    "view",
    "no_grad",
    "detached_weight",
    "gate",
    "checkpoint",
    "times_zero",
)


@st.composite
def programs(draw: st.DrawFn) -> dict[str, Any]:
    n_leaves = draw(st.integers(1, 5))
    nesting = draw(st.lists(st.integers(0, 2), min_size=n_leaves, max_size=n_leaves))
    frozen = draw(st.sets(st.integers(0, n_leaves - 1), max_size=n_leaves))
    ties = draw(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=2))
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        op = draw(st.sampled_from(OPS))
        steps.append(
            {
                "op": op,
                "a": draw(st.one_of(st.just(-1), st.integers(0, 99))),  # -1: the latest
                "b": draw(st.integers(0, 99)),
                "leaf": draw(st.integers(0, n_leaves - 1)),
                "alpha": draw(st.sampled_from([0.0, -1.0, 0.5])),
                "reentrant": draw(st.booleans()),
            }
        )
    n_losses = draw(st.integers(1, 3))
    losses = [-1, *draw(st.lists(st.integers(0, 99), max_size=n_losses - 1))]
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    input_grad = draw(st.booleans())
    return {
        "leaves": nesting,
        "frozen": frozen,
        "ties": ties,
        "steps": steps,
        "losses": losses,
        "dtype": dtype,
        "input_grad": input_grad,
    }


def build(spec: dict[str, Any]) -> tuple[nn.Module, list[nn.Linear]]:
    """A tree of Linear(3, 3) leaves at random depths, some frozen, some weights tied."""
    torch.manual_seed(0)
    root = nn.Module()
    root.scale = nn.Parameter(torch.randn(3))
    leaves: list[nn.Linear] = []
    for i, depth in enumerate(spec["leaves"]):
        parent = root
        for level in range(depth):
            name = f"block{level}"
            if not hasattr(parent, name):
                parent.add_module(name, nn.Module())
            parent = getattr(parent, name)
        leaf = nn.Linear(3, 3)
        parent.add_module(f"leaf{i}", leaf)
        leaves.append(leaf)
    for i, j in spec["ties"]:
        if i < len(leaves) and j < len(leaves) and i != j:
            leaves[j].weight = leaves[i].weight
    for i in spec["frozen"]:
        leaves[i].bias.requires_grad_(False)
        if not any(leaves[i].weight is leaves[k].weight for k in range(len(leaves)) if k != i):
            leaves[i].weight.requires_grad_(False)
    return root.to(spec["dtype"]), leaves


def run(spec: dict[str, Any], model: nn.Module, leaves: list[nn.Linear], *, drop: bool):
    """The program: a pool of tensors, each step adds one. Returns the loss tensors."""
    x = torch.randn(2, 3, dtype=spec["dtype"], requires_grad=spec["input_grad"])
    pool = [x, torch.randn(2, 3, dtype=spec["dtype"])]
    for step in spec["steps"]:
        a = pool[-1] if step["a"] == -1 else pool[step["a"] % len(pool)]
        b = pool[step["b"] % len(pool)]
        leaf = leaves[step["leaf"]]
        op = step["op"]
        if op == "linear":
            out = leaf(a)
        elif op == "tanh":
            out = a.tanh()
        elif op == "add":
            out = a + b
        elif op == "detach":
            out = a.detach()
        elif op == "clone":
            out = a.clone()
        elif op == "isolate_clone":
            out = isolate.clone(a)
        elif op == "scale":
            out = isolate.scale_gradient(a, step["alpha"])
        elif op == "inplace":
            out = a.clone()
            out.mul_(2).add_(b)
        elif op == "inplace_view":
            out = a.clone()
            out[0].mul_(3)
            out.view(-1)[:3].add_(b[1])
        elif op == "view":
            out = a.t().reshape(-1).view(3, 2).t()[:, [0, 1, 2]] + a[:1].expand(2, 3) * 0.5
        elif op == "no_grad":
            with torch.no_grad():
                out = leaf(a)
        elif op == "detached_weight":
            out = nn.functional.linear(a, leaf.weight.detach(), leaf.bias)
        elif op == "gate":
            out = _Gate.apply(a, model.scale, drop)
        elif op == "checkpoint":
            out = checkpoint(leaf, a, use_reentrant=step["reentrant"])
        else:  # times_zero: a live path with an exactly zero gradient
            out = a + 0 * leaf(b)
        pool.append(out)
    return [pool[-1 if i == -1 else i % len(pool)].float().sum() for i in spec["losses"]]


def by_backward(losses: list[torch.Tensor], model: nn.Module) -> set[int]:
    """ids of the parameters a real backward writes a gradient to (works through reentrant
    checkpoints, unlike autograd.grad)."""
    reached: set[int] = set()
    for loss in losses:
        for p in model.parameters():
            p.grad = None
        if loss.requires_grad:
            loss.backward(retain_graph=True)
        reached |= {id(p) for p in model.parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return reached


def trainable_names(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    named = model.named_parameters(remove_duplicate=False)
    return [(n, p) for n, p in named if p.requires_grad]


@settings(derandomize=True, database=None, deadline=None, max_examples=300)
@given(spec=programs())
def test_every_audit_agrees_with_brute_force(spec: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's checkpoint warnings
        for drop in (False, True):
            model, leaves = build(spec)
            with trace_forward(model) as trace:
                losses = run(spec, model, leaves, drop=drop)
            reached = set(reachable_parameters(losses, model))
            cut = cut_off_parameters(losses, model)
            traced = cut_off_parameters(losses, model, trace=trace)
            truth = by_backward(losses, model)
            truth_names = {n for n, p in trainable_names(model) if id(p) in truth}

            # Never under-report: whatever gets a gradient is named (reentrant checkpoints
            # included: the walk re-runs them as backward does).
            assert truth_names <= reached, sorted(truth_names - reached)
            if not drop:
                assert reached == truth_names  # zeros instead of None: exact agreement
            # Cut-off never names a parameter that learns; it names all that do not, with a
            # reason each, trace or not.
            for result in (cut, traced):
                assert not set(result.parameters) & truth_names
                assert all(result.parameters.values())
                expected = [n for n, _ in trainable_names(model) if n not in reached]
                assert list(result.parameters) == expected
                if not drop:
                    assert set(expected) == {n for n, _ in trainable_names(model)} - truth_names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_property_test_can_fail(dtype: torch.dtype) -> None:
    """Negative control for the oracle: a walk that missed a path would be caught."""
    spec = {
        "leaves": [0, 0],
        "frozen": set(),
        "ties": [],
        "steps": [
            {"op": "linear", "a": 0, "b": 0, "leaf": 0, "alpha": 0.0, "reentrant": False},
            {"op": "scale", "a": 2, "b": 0, "leaf": 0, "alpha": 0.0, "reentrant": False},
            {"op": "linear", "a": 3, "b": 0, "leaf": 1, "alpha": 0.0, "reentrant": False},
        ],
        "losses": [4],
        "dtype": dtype,
        "input_grad": False,
    }
    model, leaves = build(spec)
    losses = run(spec, model, leaves, drop=False)
    # scale_gradient(x, 0.0) is a real cut: leaf0 gets no gradient, and both answers agree.
    assert id(leaves[0].weight) not in by_backward(losses, model)
    cut = cut_off_parameters(losses, model).parameters
    assert list(cut) == ["scale", "leaf0.weight", "leaf0.bias"]  # scale: used by no step
    assert reachable_parameters(losses, model) == ("leaf1.weight", "leaf1.bias")
    # A live path with an exactly zero gradient: reached, not cut off.
    spec["steps"][1] = {"op": "times_zero", "a": 1, "b": 2, "leaf": 1, "alpha": 0.0}
    spec["steps"][1]["reentrant"] = False
    model, leaves = build(spec)
    losses = run(spec, model, leaves, drop=False)
    assert all(p.grad is None for p in model.parameters())
    assert by_backward(losses, model) >= {id(leaves[0].weight), id(leaves[1].weight)}
    assert len(reachable_parameters(losses, model)) == 4
    assert list(cut_off_parameters(losses, model).parameters) == ["scale"]
    # A custom Function that returns None: reached by the walk, not by backward (the one
    # documented over-report), and so never called cut off.
    spec["steps"].append({"op": "gate", "a": 4, "b": 0, "leaf": 0, "alpha": 0.0})
    spec["steps"][-1]["reentrant"] = False
    spec["losses"] = [5]
    model, leaves = build(spec)
    losses = run(spec, model, leaves, drop=True)
    assert id(model.scale) not in by_backward(losses, model)
    assert "scale" in reachable_parameters(losses, model)
    assert "scale" not in cut_off_parameters(losses, model).parameters
