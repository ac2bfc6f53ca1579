"""The audits under torch.compile give the eager answer, or refuse naming the region.

A compiled region is one autograd node with an edge to every parameter it reads, even one it
reads only through ``.detach()``; its backward graph says which of them get a gradient.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from isolate._compiled import (
    _backward_graph,
    _donates,
    _read,
    _refuse_stale,
    _region_name,
    compiled_in,
    forget_compiled,
    live_edges,
)
from isolate.cutoff import assert_reached, cut_off_parameters
from isolate.detaching import GradientScale
from isolate.errors import BlindSpotError, CutOffError, GradientLeakError, StaleCompileError
from isolate.gradients import gradient_invariance, gradient_report
from isolate.reachability import assert_isolated, reachable_parameters

GROUPS = ["embed", "trunk", "side", "head", "probe", "frozen"]


class Net(nn.Module):
    """embed -> trunk -> head, a side branch read through .detach(), a frozen layer, a probe that
    reads the trunk's features (``leak``) or their detached copy; the segment is
    checkpointed when ``reentrant`` is not None."""

    def __init__(self, *, leak: bool, reentrant: bool | None = None, graph_break: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(5, 5)
        self.trunk = nn.Linear(5, 5)
        self.side = nn.Linear(5, 5)
        self.head = nn.Linear(5, 1)
        self.probe = nn.Linear(5, 2)
        self.frozen = nn.Linear(5, 5).requires_grad_(False)
        self.leak, self.reentrant, self.graph_break = leak, reentrant, graph_break

    def segment(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.trunk(self.frozen(x))) + self.side(x).detach()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(x)
        if self.reentrant is None:
            h = self.segment(x)
        else:
            h = checkpoint(self.segment, x, use_reentrant=self.reentrant)
        if self.graph_break:
            torch._dynamo.graph_break()
        main = self.head(h).pow(2).mean()
        probe = self.probe(h if self.leak else h.detach()).pow(2).mean()
        return main, probe


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _answers(model: Net, main: torch.Tensor, probe: torch.Tensor) -> dict[str, object]:
    """Everything the audits say about one forward."""
    report = gradient_report({"main": main, "probe": probe}, model, groups=GROUPS)
    norms = {(g, k): report[g].norms[k] for g in GROUPS for k in ("main", "probe")}
    invariance = gradient_invariance(main, main + probe, model.trunk)
    return {
        "reach_main": reachable_parameters(main, model),
        "reach_probe": reachable_parameters(probe, model),
        "cut": list(cut_off_parameters(main, model).parameters),
        "norms": norms,
        "deltas": dict(invariance.deltas),
    }


def _close(compiled: dict[str, object], eager: dict[str, object]) -> None:
    for key in ("reach_main", "reach_probe", "cut"):
        assert compiled[key] == eager[key], key
    for key in ("norms", "deltas"):
        got, want = compiled[key], eager[key]
        assert isinstance(got, dict) and isinstance(want, dict)
        assert got.keys() == want.keys()
        for k, value in want.items():
            if value is None:
                assert got[k] is None, (key, k)
            else:
                assert got[k] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, k)


CASES = [
    pytest.param(backend, fullgraph, reentrant, graph_break, leak, id=f"{name}-{kind}")
    for backend, fullgraph, reentrant, graph_break, name in [
        ("aot_eager", True, None, False, "aot_eager-fullgraph"),
        ("aot_eager", False, None, True, "aot_eager-graph_break"),
        ("aot_eager", True, True, False, "aot_eager-reentrant_checkpoint"),
        ("aot_eager", True, False, False, "aot_eager-checkpoint"),
        ("inductor", True, None, False, "inductor-fullgraph"),  # one C++ compile: seconds
    ]
    for leak, kind in [(False, "clean"), (True, "leak")]
    if backend == "aot_eager" or leak
]


@pytest.mark.parametrize(("backend", "fullgraph", "reentrant", "graph_break", "leak"), CASES)
def test_compiled_audits_give_the_eager_answer(
    backend: str, fullgraph: bool, reentrant: bool | None, graph_break: bool, leak: bool
) -> None:
    x = torch.randn(4, 5)
    model = Net(leak=leak, reentrant=reentrant, graph_break=graph_break)
    eager = _answers(model, *model(x))
    assert eager["cut"] == ["side.weight", "side.bias", "probe.weight", "probe.bias"]
    assert ("trunk.weight" in eager["reach_probe"]) == leak  # type: ignore[operator]
    compiled_model = torch.compile(model, backend=backend, fullgraph=fullgraph)
    main, probe = compiled_model(x)
    names = {type(main.grad_fn).__name__, type(probe.grad_fn).__name__}
    assert names == {"CompiledFunctionBackward"} or graph_break
    _close(_answers(model, main, probe), eager)
    assert_isolated(main, model.side)
    with pytest.raises(CutOffError, match=r"side\.weight, side\.bias"):
        assert_reached(main, model, expected_unused="probe")
    if leak:
        with pytest.raises(GradientLeakError, match=r"(?s)trunk\.weight.*CompiledFunctionBackward"):
            assert_isolated(probe, model.trunk, model=model)
    else:
        assert_isolated(probe, model.trunk, model=model)


def test_an_output_reached_late_adds_its_parameters() -> None:
    """The walk meets the region through its first output, expands it, and only later
    reaches its second output (a longer route): what that output uses is added then."""

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x)

    model = TwoHeads()
    x = torch.randn(2, 3)
    for run in (model, torch.compile(model, backend="aot_eager", fullgraph=True)):
        a, b = run(x)
        loss = a.sum() + b.mul(2).exp().tanh().sum()
        assert reachable_parameters(loss, model) == ("a.weight", "a.bias", "b.weight", "b.bias")
        assert reachable_parameters(a.sum(), model) == ("a.weight", "a.bias")


def test_a_region_is_read_once_for_each_output_set_however_often_it_is_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reaching an output of an expanded region again adds nothing: its backward graph is
    read again only when a new output is reached."""
    import isolate._seethrough as seethrough

    reads: list[set[int]] = []

    def counted(node: object, outputs: set[int], caller: str) -> object:
        reads.append(set(outputs))
        return live_edges(node, outputs, caller)

    live_edges = seethrough.live_edges
    monkeypatch.setattr(seethrough, "live_edges", counted)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    compiled = torch.compile(lambda x: (model["a"](x), model["b"](x)), backend="aot_eager")
    a, b = compiled(torch.randn(2, 3))
    # b's output is met first; a's twice, both before the region is expanded
    loss = (a.sum() + a.mean()) + b.sum()
    assert reachable_parameters(loss, model) == ("a.weight", "a.bias", "b.weight", "b.bias")
    assert reads == [{0, 1}]


def test_recompiled_with_dynamic_shapes() -> None:
    """A second batch size recompiles with a symbolic size, an argument of the region that is
    not a tensor: the backward graph's outputs and the node's edges still line up."""
    model = Net(leak=True)
    compiled = torch.compile(model, backend="aot_eager")
    # A recompiled region compiles its backward at once, reusing the memory of what it saved;
    # torch then refuses the kept graph that gradients need (see the next test).
    with torch._functorch.config.patch(donated_buffer=False):
        for rows in (2, 3, 5):
            x = torch.randn(rows, 5)
            _close(_answers(model, *compiled(x)), _answers(model, *model(x)))


def test_a_backward_that_reuses_saved_memory_refuses_gradients_but_not_reach() -> None:
    model = Net(leak=True)
    compiled = torch.compile(model, backend="aot_eager")
    main, probe = compiled(torch.randn(2, 5))
    (main + probe).backward()  # compiles the backward, donating saved buffers
    main, probe = compiled(torch.randn(2, 5))
    assert list(cut_off_parameters(main, model).parameters)[:2] == ["side.weight", "side.bias"]
    for caller, audit in (
        ("gradient_report", lambda: gradient_report({"main": main}, model)),
        ("gradient_invariance", lambda: gradient_invariance(main, main + probe, model.trunk)),
    ):
        with pytest.raises(
            BlindSpotError,
            match=rf"^{caller}\(\): the backward of .*Net\.forward .*donated buffers.*"
            r"donated_buffer = False",
        ):
            audit()
    main.backward()  # the refusal ran nothing: the training step's backward still works


def test_a_region_whose_backward_graph_is_gone_is_refused_by_name() -> None:
    model = Net(leak=True)
    main, probe = torch.compile(model, backend="aot_eager")(torch.randn(3, 5))
    node = main.grad_fn
    while node.name() != "CompiledFunctionBackward":
        node = node.next_functions[0][0]
    region = node._forward_cls
    info = region._lazy_backward_info
    region._lazy_backward_info = None
    try:
        for caller, audit in (
            ("reachable_parameters", lambda: reachable_parameters(main, model)),
            ("assert_isolated", lambda: assert_isolated(probe, model.trunk)),
            ("cut_off_parameters", lambda: cut_off_parameters(main, model)),
            ("assert_reached", lambda: assert_reached(main, model)),
        ):
            with pytest.raises(
                BlindSpotError,
                match=rf"^{caller}\(\): cannot see which inputs of .*torch\.compile region, "
                r"graph 0/0 get a grad",
            ):
                audit()
    finally:
        region._lazy_backward_info = info


def test_gradient_scale_alpha_changes_under_fullgraph() -> None:
    """alpha is checked when it is set, so every forward traces; a new alpha takes effect.
    (Dynamo refused the check in the forward before any backend ran: aot_eager suffices.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), GradientScale(-1.0), nn.Linear(3, 1))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 3)
    for alpha in [-1.0, 0.5, 0.0, 2.0]:
        model[1].alpha = alpha
        grads = []
        for run in (model, compiled):
            model.zero_grad(set_to_none=True)
            run(x).sum().backward()
            grads.append(model[0].weight.grad)
        eager, got = grads
        if alpha == 0.0:
            assert eager is None and got is None
        else:
            assert eager is not None and got is not None
            torch.testing.assert_close(got, eager)


def test_seeing_through_loads_no_compiler_until_a_compiled_region_is_met() -> None:
    """``import isolate`` and every audit of an eager graph leave torch._dynamo, transformers
    and peft unloaded: the see-through reads compiled nodes, it does not import a compiler;
    nor does forgetting compiled code (at a thaw) where none was loaded."""
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    probe = (
        "import sys, torch, isolate\n"
        "from isolate.cutoff import cut_off_parameters\n"
        "from isolate.gradients import gradient_report\n"
        "from isolate.reachability import reachable_parameters\n"
        "m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))\n"
        "loss = m(torch.randn(3, 2)).sum()\n"
        "reachable_parameters(loss, m); cut_off_parameters(loss, m)\n"
        "gradient_report({'loss': loss}, m)\n"
        "from isolate._compiled import forget_compiled\n"
        "assert forget_compiled() == 0\n"
        "print(sorted(n for n in ('torch._dynamo', 'transformers', 'peft') if n in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_region_is_named_with_what_its_torch_version_records() -> None:
    """A region without the metadata or the traced code this torch keeps is still named; a
    code object without ``co_qualname`` (Python 3.10) by its ``co_name``."""
    assert _region_name(SimpleNamespace()) == "a torch.compile region"
    code = SimpleNamespace(co_name="forward", co_filename="net.py", co_firstlineno=7)
    region = SimpleNamespace(
        metadata=SimpleNamespace(compile_id_str="2/1"),
        _lazy_backward_info=SimpleNamespace(saved_context=SimpleNamespace(traced_code=[code])),
    )
    assert _region_name(region) == "the torch.compile region forward (net.py:7), graph 2/1"


def test_forgetting_compiled_code_makes_dynamo_compile_again() -> None:
    compiles: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., object]:
        compiles.append(1)
        return gm.forward

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin() + 1

    compiled = torch.compile(f, backend=backend)
    x = torch.randn(3)
    compiled(x)
    compiled(x)
    assert len(compiles) == 1
    assert forget_compiled() > 0  # f's code among them
    compiled(x)
    assert len(compiles) == 2


def test_a_region_without_this_torchs_record_of_donated_buffers_donates_none() -> None:
    with torch._functorch.config.patch(donated_buffer=True):
        assert not _donates(SimpleNamespace(metadata=SimpleNamespace()))
        region = SimpleNamespace(metadata=SimpleNamespace(bw_donated_idxs=[0]))
        assert not _donates(region)  # its backward not compiled yet
        region.compiled_bw = object()
        assert _donates(region)


def test_a_graph_holds_a_compiled_region_only_where_torch_compile_made_one() -> None:
    model = Net(leak=True)
    x = torch.randn(2, 5)
    eager = model(x)
    compiled = torch.compile(model, backend="aot_eager")(x)
    assert compiled_in(list(eager), "test") is False
    assert compiled_in([compiled[0] * 2], "test") is True  # a step below the output
    assert compiled_in([eager[0], compiled[1]], "test") is True


def test_the_search_for_compiled_regions_looks_at_each_node_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each of ten diamonds doubles the routes to the region; the search is linear in nodes."""
    import isolate._compiled as compiled_module

    looked: list[object] = []
    is_compiled = compiled_module.is_compiled

    def counted(node: object) -> bool:
        looked.append(node)
        return is_compiled(node)

    monkeypatch.setattr(compiled_module, "is_compiled", counted)
    block = nn.Linear(3, 3)
    h = torch.compile(block, backend="aot_eager")(torch.randn(2, 3))
    for _ in range(10):
        h = h + h.sin()
    assert compiled_in([h.sum()], "test") is True
    # sum, the diamonds, the region, its two parameters' AccumulateGrad
    assert len(looked) == len(set(looked)) == 1 + 2 * 10 + 1 + 2


def test_a_region_that_mutates_an_input_gives_the_eager_answer() -> None:
    """An input that requires grad, changed in place by the region, gets its tangent first
    (AOTAutograd applies that mutation outside the graph); one that needs no gradient is
    changed inside the graph and gets none."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"lin": nn.Linear(3, 3), "other": nn.Linear(3, 3), "probe": nn.Linear(3, 1)}
    )

    def f(h: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h.mul_(2)
        counter.add_(1)
        return model["lin"](h).sum(), h.detach().sum()

    x = torch.randn(2, 3, requires_grad=True)
    main, detached = torch.compile(f, backend="aot_eager")(model["other"](x), torch.zeros(2))
    assert type(main.grad_fn).__name__ == "CompiledFunctionBackward"
    assert reachable_parameters(main, model) == (
        "lin.weight",
        "lin.bias",
        "other.weight",
        "other.bias",
    )
    assert reachable_parameters(model["probe"](detached.reshape(1, 1).expand(1, 3)), model) == (
        "probe.weight", "probe.bias",
    )  # fmt: skip


def test_a_region_whose_outputs_are_views_gives_the_eager_answer() -> None:
    """Views of an input, and two views of one intermediate (AOTAutograd regenerates them
    outside the region from their base), reach what eager autograd reaches."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"lin": nn.Linear(3, 3), "other": nn.Linear(3, 3)})

    def f(h: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = model["lin"](h)
        return t[0], t[1], g.view(-1)

    x = torch.randn(2, 3, requires_grad=True)
    for run in (f, torch.compile(f, backend="aot_eager")):
        a, b, v = run(model["other"](x), model["other"](x) * 2)
        assert reachable_parameters(a.sum(), model) == tuple(n for n, _ in model.named_parameters())
        assert reachable_parameters(b.sum() + v.sum(), model) == (
            "lin.weight", "lin.bias", "other.weight", "other.bias",
        )  # fmt: skip
        assert reachable_parameters(v.sum(), model) == ("other.weight", "other.bias")


def test_a_region_whose_record_of_its_inputs_does_not_line_up_is_refused() -> None:
    """Without this torch's record of which inputs required grad at compile time, or with
    one that does not line up with the node, staleness cannot be told: refused by name."""
    for metadata in (SimpleNamespace(compile_id_str="0/3"),
                     SimpleNamespace(compile_id_str="0/3", input_info=[])):  # fmt: skip
        node = SimpleNamespace(_forward_cls=SimpleNamespace(metadata=metadata), next_functions=())
        with pytest.raises(
            BlindSpotError,
            match=r"^mine\(\): cannot tell which inputs of a torch\.compile region, graph 0/3 "
            r"required grad when it was compiled \(torch .*\)\. Fix: run the audit on the model "
            r"before torch\.compile",
        ):
            _refuse_stale(node, (True,), "mine()")  # type: ignore[arg-type]


def test_a_stale_region_names_each_input_compiled_without_grad_and_how_to_fix_it() -> None:
    """The inputs that require grad now (the node's edges that are not None, in order) and
    did not when the region was compiled: named by the tensors their edges accumulate into.
    (The end-to-end case, a guard filter hiding a thaw, runs in a child process in
    test_compile_thaw.py.)"""
    weight, bias, fresh = torch.zeros(6, 6), torch.zeros(6), torch.zeros(2)
    leaf = SimpleNamespace
    node = SimpleNamespace(
        _forward_cls=SimpleNamespace(
            metadata=SimpleNamespace(
                compile_id_str="1/0",
                input_info=[leaf(requires_grad=b) for b in (False, False, True, False, False)],
            )
        ),
        next_functions=(
            (leaf(variable=weight), 0),
            (None, 0),
            (leaf(variable=fresh), 0),
            (leaf(variable=bias), 0),
            (leaf(), 0),  # no variable: not a leaf's edge
        ),
    )
    with pytest.raises(StaleCompileError) as caught:
        _refuse_stale(node, (True, False, True, True, True), "mine()")  # type: ignore[arg-type]
    assert str(caught.value) == (
        "mine(): a torch.compile region, graph 1/0 was compiled while 2 of its inputs (shapes "
        "(6, 6), (6,)) did not require grad, and runs now that they do: its backward has no "
        "gradient for them, so they never learn (dynamo's guards did not see the flip, as under "
        "a guard_filter_fn that skips nn-module or parameter guards). Fix: thaw through the "
        "spec (IsolationSpec thaws make dynamo compile again), call "
        "torch._dynamo.reset_code_caches() after flipping flags by hand, or compile without "
        "the guard filter"
    )
    assert caught.value.tensors == (weight, bias)
    node._forward_cls.metadata.input_info = [leaf(requires_grad=True)] * 5
    assert _refuse_stale(node, (True, False, True, True, True), "mine()") is None  # type: ignore[arg-type, func-returns-value]


def test_a_region_without_this_torchs_lazy_backward_has_no_graph_to_read() -> None:
    assert _backward_graph(SimpleNamespace()) is None
    assert _backward_graph(SimpleNamespace(_lazy_backward_info=SimpleNamespace())) is None
    graph = object()
    module = SimpleNamespace(graph=graph)
    info = SimpleNamespace(bw_module=None, bw_module_fn=lambda: module)
    assert _backward_graph(SimpleNamespace(_lazy_backward_info=info)) is graph
    info = SimpleNamespace(bw_module=module, bw_module_fn=None)
    assert _backward_graph(SimpleNamespace(_lazy_backward_info=info)) is graph


class _Doubled(torch.autograd.Function):
    """A user's Function whose class happens to carry ``metadata``, as AOTAutograd's do."""

    metadata = "not a compiled region's"

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def test_only_a_node_named_as_a_compiled_region_is_read_as_one() -> None:
    model = nn.Linear(3, 3)
    loss = _Doubled.apply(model(torch.randn(2, 3))).sum()
    assert compiled_in([loss], "test") is False
    assert reachable_parameters(loss, model) == ("weight", "bias")


def test_a_region_over_tensor_subclasses_is_refused_by_name() -> None:
    """Its backward graph works on the subclasses' inner tensors, which do not line up with
    the node's edges; a region without this torch's subclass record is read as plain."""
    model = Net(leak=True)
    main, _ = torch.compile(model, backend="aot_eager")(torch.randn(3, 5))
    node = main.grad_fn
    while node.name() != "CompiledFunctionBackward":
        node = node.next_functions[0][0]
    region = node._forward_cls
    kept = region.maybe_subclass_metadata
    region.maybe_subclass_metadata = object()
    try:
        with pytest.raises(BlindSpotError, match=r"^reachable_parameters\(\): cannot see which"):
            reachable_parameters(main, model)
    finally:
        region.maybe_subclass_metadata = kept
    info = SimpleNamespace(bw_module=SimpleNamespace(graph=object()))
    plain = type("Region", (), {"_lazy_backward_info": info})
    assert _read(plain) is None  # no metadata to line the graph up with


def test_a_backward_graph_or_a_node_that_does_not_line_up_with_the_region_is_not_read() -> None:
    graph = torch.fx.Graph()
    t1, t2 = graph.placeholder("tangents_1"), graph.placeholder("tangents_2")
    graph.output((graph.call_function(torch.add, (t1, t2)),))
    output = SimpleNamespace(
        output_type=SimpleNamespace(name="non_alias"),
        raw_type=torch.Tensor,
        requires_grad_for_backward=True,
    )
    metadata = SimpleNamespace(
        input_info=[],
        mutated_inp_runtime_indices=[],
        output_info=[output],
        num_outputs=1,
        num_intermediate_bases=0,
    )
    info = SimpleNamespace(bw_module=SimpleNamespace(graph=graph))
    region = type("Region", (), {"_lazy_backward_info": info, "metadata": metadata})
    assert _read(region) is None  # two tangents, one output that takes one
    output_info = [output, output]
    region = type(
        "Region",
        (),
        {
            "_lazy_backward_info": info,
            "metadata": SimpleNamespace(
                **{**vars(metadata), "output_info": output_info, "num_outputs": 2}
            ),
        },
    )
    read = _read(region)
    assert read is not None and read.masks == (0b11,) and read.slots == (0, 1)

    # A node that does not line up with its region: no flags, or fewer edges than flags.
    unflagged = SimpleNamespace(_forward_cls=region, next_functions=())
    edgeless = SimpleNamespace(_forward_cls=region, next_functions=(), needs_input_grad=(True,))
    for node in (unflagged, edgeless):
        with pytest.raises(BlindSpotError, match=r"^mine\(\): cannot see which inputs of a "):
            live_edges(node, {0}, "mine()")  # type: ignore[arg-type]
