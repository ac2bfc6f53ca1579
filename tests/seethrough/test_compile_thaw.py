"""Freezes and thaws under torch.compile take effect at the next step, as in eager.

Dynamo guards on each parameter's ``requires_grad`` and compiles again after a flip. A
``guard_filter_fn`` that drops nn-module guards hides the flip: the region compiled before a
thaw runs on, and its backward has no gradient for the thawed parameters. A spec's thaw makes
dynamo compile again; an audit that walks such a region names it.

``aot_eager`` runs the same aten kernels in the same order as eager, so its gradients and
weights are compared bitwise; inductor fuses kernels and reorders reductions, so its values
agree to float32 rounding (and which parameters get a gradient agrees exactly).
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import isolate
import isolate.freezing
import isolate.spec.thawing
from isolate.cutoff import assert_reached, cut_off_parameters
from isolate.errors import StaleCompileError
from isolate.spec import IsolationSpec, Thaw
from tests._launch import launch

STEPS = 3
# The compile options that hide requires_grad from dynamo's guards. Whether torch reuses a
# region under them depends on what the process compiled before (a test run in the same
# process made dynamo compile again), so each case that needs them runs in a process of its
# own (:func:`_in_child`).
UNGUARDED = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


class Net(nn.Module):
    """a -> b -> c; ``b`` is the part frozen or thawed between steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).mean()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


Record = dict[str, Any]


def _train(event: str, compile_: Callable[[Net], Callable[[torch.Tensor], torch.Tensor]]) -> Record:
    """Three SGD steps (momentum) of ``Net``; at step 1 ``b`` is frozen with ``isolate.freeze``
    (``event="freeze"``) or thawed by a spec through its loop (``event="thaw"``). Returns each
    step's gradients (``None`` where none) and the weights after it."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    handle, loop, freeze = None, None, None
    if event == "thaw":
        handle = IsolationSpec(freeze=["b"], thaw=[Thaw("b", step=1, lr=0.1)]).apply(model)
        opt = torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9
        )
        handle.attach(opt)
        loop = handle.check_every(1)
    forward = compile_(model)
    rec: Record = {"grads": [], "weights": []}
    try:
        for step in range(STEPS):
            if loop is not None:
                loop.begin_step(epoch=0, step=step)
            elif step == 1:
                freeze = isolate.freeze(model, "b")
            loss = forward(torch.randn(8, 4, generator=torch.Generator().manual_seed(step)))
            if loop is not None:
                loop.before_backward(loss)
            loss.backward()
            rec["grads"].append(
                {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
            if loop is not None:
                loop.end_step()
            rec["weights"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    finally:
        for h in (handle, freeze):
            if h is not None:
                h.restore()
    return rec


def _compiled(backend: str, *, fullgraph: bool, options: dict[str, Any] | None = None) -> Any:
    return lambda model: torch.compile(model, backend=backend, fullgraph=fullgraph, options=options)


def _assert_same(got: Record, want: Record, *, exact: bool) -> None:
    for key in ("grads", "weights"):
        for step, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert g.keys() == w.keys()
            for name, value in w.items():
                assert (g[name] is None) == (value is None), (key, step, name)
                if value is None:
                    continue
                if exact:
                    assert torch.equal(g[name], value), (key, step, name)
                else:
                    torch.testing.assert_close(g[name], value, msg=f"{key} {step} {name}")


def _assert_event_happened(rec: Record, event: str) -> None:
    """The flip changed training at the step it was made: b's gradients stop or start, and
    b stops or starts moving."""
    b_grads = [g["b.weight"] is not None for g in rec["grads"]]
    b = [Net().b.weight.detach(), *(w["b.weight"] for w in rec["weights"])]
    moved = [not torch.equal(x, y) for x, y in itertools.pairwise(b)]
    if event == "freeze":
        assert b_grads == [True, False, False] and moved == [True, False, False]
    else:
        assert b_grads == [False, True, True] and moved == [False, True, True]


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("event", ["freeze", "thaw"])
def test_a_flip_between_steps_trains_as_in_eager(event: str, fullgraph: bool) -> None:
    eager = _train(event, lambda model: model)
    _assert_event_happened(eager, event)
    compiled = _train(event, _compiled("aot_eager", fullgraph=fullgraph))
    _assert_same(compiled, eager, exact=True)


def test_a_thaw_under_inductor_trains_as_in_eager() -> None:
    eager = _train("thaw", lambda model: model)
    compiled = _train("thaw", _compiled("inductor", fullgraph=True))
    _assert_same(compiled, eager, exact=False)


def _hand_thaw() -> dict[str, Any]:
    """A thaw by hand under the guard filter: what a real backward and the audits say."""
    model = Net()
    freeze = isolate.freeze(model, "b")
    forward = torch.compile(model, backend="aot_eager", options=UNGUARDED)
    x = torch.randn(8, 4)
    forward(x).backward()
    freeze.restore()
    model.zero_grad(set_to_none=True)
    forward(x).backward()
    out: dict[str, Any] = {"b_grads": [p.grad is not None for p in model.b.parameters()]}
    out["a_grad"] = model.a.weight.grad is not None
    for audit in (cut_off_parameters, assert_reached):
        try:
            audit(forward(x), model)
            out[audit.__name__] = None
        except StaleCompileError as error:
            same = [t is p for t, p in zip(error.tensors, model.b.parameters(), strict=True)]
            out[audit.__name__] = [str(error), same]
    # Once dynamo compiles again, the audit answers and b is reached.
    isolate.spec.thawing.forget_compiled()
    out["after_forget"] = list(cut_off_parameters(forward(x), model).parameters)
    return out


def _spec_thaw(planted: bool) -> dict[str, Any]:
    """A spec's thaw under the guard filter, against eager; ``planted``: the spec leaves the
    compiled region in place (as a thaw by hand does)."""
    eager = _train("thaw", lambda model: model)
    if planted:
        isolate.spec.thawing.forget_compiled = lambda: 0  # type: ignore[assignment]
        try:
            _train("thaw", _compiled("aot_eager", fullgraph=True, options=UNGUARDED))
        except StaleCompileError as error:
            return {"error": str(error)}
        return {"error": None}
    compiled = _train("thaw", _compiled("aot_eager", fullgraph=True, options=UNGUARDED))
    _assert_same(compiled, eager, exact=True)
    _assert_event_happened(compiled, "thaw")
    return {"same": True}


def _llama_thaw(planted: bool) -> dict[str, Any]:
    """A tiny Llama with LoRA, compiled under the guard filter: the LoRA of layer 1 frozen by a
    spec and thawed at step 1 (the fault matrix's thaw under compile); ``planted``: the spec
    leaves the compiled region in place."""
    from tests._llama import batch, lora_llama

    if planted:
        isolate.spec.thawing.forget_compiled = lambda: 0  # type: ignore[assignment]
    model = lora_llama()
    layer1 = "*layers.1.*lora_*"
    handle = IsolationSpec(freeze=[layer1], thaw=[Thaw(layer1, step=1, lr=1e-2)]).apply(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    handle.attach(opt)
    loop = handle.check_every(0)  # the checks a thaw needs: reach on its first step
    thawed = {n: p for n, p in model.named_parameters() if ".layers.1." in n and "lora_" in n}
    before = {n: p.detach().clone() for n, p in thawed.items()}
    forward = torch.compile(model, backend="aot_eager", options=UNGUARDED)
    try:
        for step in range(2):
            loop.begin_step(epoch=0, step=step)
            loss = forward(**batch(seed=step)).loss
            loop.before_backward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loop.end_step()
    except StaleCompileError as error:
        return {"error": str(error)}
    moved = sorted(n for n, p in thawed.items() if not torch.equal(p.detach(), before[n]))
    handle.restore()
    return {"error": None, "moved": moved, "thawed": sorted(thawed)}


def _in_child(function: str, args: str, tmp_path: Path) -> Any:
    """Call this module's ``function`` with ``args`` in a fresh process; its JSON result."""
    module = "tests.seethrough.test_compile_thaw"
    code = f"import json; from {module} import {function}; print(json.dumps({function}({args})))"
    done = launch([sys.executable, "-c", code], cwd=tmp_path)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.upstream_trap
def test_a_guard_filter_hides_a_hand_thaw_from_dynamo(tmp_path: Path) -> None:
    """torch reuses the region compiled while ``b`` was frozen: a real backward gives ``b``
    no gradient; the audits name the region and the parameters, and answer once dynamo
    compiles again."""
    out = _in_child("_hand_thaw", "", tmp_path)
    assert out["b_grads"] == [False, False] and out["a_grad"] is True
    message = (
        r"^{}: the torch\.compile region Net\.forward \(.*test_compile_thaw\.py:\d+\), graph "
        r"\d+/\d+ was compiled while 2 of its inputs \(shapes \(6, 6\), \(6,\)\) did not "
        r"require grad, and runs now that they do: its backward has no gradient for them"
    )
    for audit in ("cut_off_parameters", "assert_reached"):
        text, same = out[audit]
        assert re.match(message.format(audit + r"\(\)"), text), text
        assert same == [True, True]
    assert out["after_forget"] == []


@pytest.mark.slow
def test_a_spec_thaw_under_a_guard_filter_trains_as_in_eager(tmp_path: Path) -> None:
    assert _in_child("_spec_thaw", "False", tmp_path) == {"same": True}


@pytest.mark.slow
def test_a_thaw_that_would_not_train_under_compile_is_caught_with_its_cause(
    tmp_path: Path,
) -> None:
    """The planted fault: the spec's thaw leaves the compiled region in place (as a flip by
    hand does); the loop's reach check on the thaw's first step names the region and the
    parameters."""
    out = _in_child("_spec_thaw", "True", tmp_path)
    assert re.match(
        r"^IsolationSpec: at step 1, \['b\.weight', 'b\.bias'\] get no gradient: "
        r"cut_off_parameters\(\): the torch\.compile region Net\.forward .* was compiled while "
        r"2 of its inputs",
        out["error"],
    ), out["error"]


@pytest.mark.slow
@pytest.mark.parametrize("planted", [False, True])
def test_fault_matrix_a_thaw_under_compile_on_a_lora_llama(planted: bool, tmp_path: Path) -> None:
    """Clean, the thawed LoRA of layer 1 trains from the thaw's step; planted, the reach check
    on that step names the compiled region and the four LoRA tensors."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    out = _in_child("_llama_thaw", str(planted), tmp_path)
    if not planted:
        assert out["error"] is None
        assert len(out["thawed"]) == 4 and out["moved"] == out["thawed"]
        return
    lora = (
        r"'base_model\.model\.model\.layers\.1\.self_attn\.[qv]_proj\.lora_[AB]\.default\.weight'"
    )
    assert re.match(
        rf"^IsolationSpec: at step 1, \[{lora}, {lora}, {lora}, {lora}\] get no gradient: "
        r"cut_off_parameters\(\): the torch\.compile region .* was compiled while 4 of its "
        r"inputs .* did not require grad",
        out["error"],
    ), out["error"]
