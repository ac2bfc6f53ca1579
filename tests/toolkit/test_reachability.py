"""reachable_parameters / assert_isolated: which parameters a loss can send gradient to,
against brute force, and what the leak report says, to the word."""

from __future__ import annotations

import re
import sys
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from isolate import assert_isolated
from isolate.cutoff import assert_reached, cut_off_parameters
from isolate.errors import (
    BlindSpotError,
    GradientLeakError,
    IsolationError,
    IsolationTypeError,
    SelectorError,
    ShardedGraphError,
)
from isolate.gradients import gradient_invariance
from isolate.reachability import reachable_parameters
from tests.toolkit._shared import Net, TanhOnce, X, freed_checkpoint
from tests.toolkit.test_sharding import FlatViews


def brute_force(loss: torch.Tensor | list[torch.Tensor], model: nn.Module) -> tuple[str, ...]:
    """Names whose gradient autograd computes (``is not None``: exact zeros count as reached)."""
    losses = loss if isinstance(loss, list) else [loss]
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    reached: set[int] = set()
    for out in losses:
        if not out.requires_grad:
            continue
        grads = torch.autograd.grad(
            out.sum(), [p for _, p in named], retain_graph=True, allow_unused=True
        )
        reached |= {id(p) for (_, p), g in zip(named, grads, strict=True) if g is not None}
    return tuple(n for n, p in named if id(p) in reached)


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


# --------------------------------------------------------------------------------------------
# reachable_parameters


def test_full_model_reaches_every_parameter(net: Net) -> None:
    main, probe = net(X)
    names = tuple(n for n, _ in net.named_parameters())
    assert reachable_parameters([main.sum(), probe.sum()], net) == names


def test_detached_branch_reaches_only_its_own_head(net: Net) -> None:
    _, probe = net(X)
    loss = probe.pow(2).mean()
    assert reachable_parameters(loss, net) == ("probe.weight", "probe.bias")
    assert reachable_parameters(loss, net) == brute_force(loss, net)


def test_result_is_in_model_order_not_alphabetical() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(12)])
    out = model(torch.randn(1, 2)).sum()
    assert reachable_parameters(out, model) == tuple(n for n, _ in model.named_parameters())
    assert reachable_parameters(out, model)[-2:] == ("11.weight", "11.bias")


def test_graph_is_left_intact_for_the_real_backward(net: Net) -> None:
    main, probe = net(X)
    loss = main.pow(2).mean() + probe.pow(2).mean()
    params = list(net.parameters())
    reference = torch.autograd.grad(loss, params, retain_graph=True)
    before = [p.grad for p in params]
    reachable_parameters(loss, net)
    assert_isolated(probe.sum(), net.encoder)
    assert before == [None] * len(params)  # the walk writes no .grad
    loss.backward()  # no "graph freed" error: nothing was consumed
    for p, ref in zip(params, reference, strict=True):
        assert p.grad is not None and torch.equal(p.grad, ref)


def test_walk_also_works_after_the_graph_was_freed(net: Net) -> None:
    main, _ = net(X)
    loss = main.sum()
    loss.backward()
    assert reachable_parameters(loss, net) == brute_force_names(net, exclude=("probe",))


def brute_force_names(model: nn.Module, *, exclude: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n, _ in model.named_parameters() if not n.startswith(exclude))


def test_tied_weights_are_reported_under_every_name() -> None:
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 6)
            self.body = nn.Linear(6, 6)
            self.decoder = nn.Linear(6, 10, bias=False)
            self.decoder.weight = self.embed.weight

    model = TiedLM()
    tokens = torch.tensor([[1, 2, 3]])
    hidden = model.body(model.embed(tokens))
    # Only the decoder use reaches the shared tensor: both of its names are still reported.
    logits = model.decoder(hidden.detach())
    assert reachable_parameters(logits.sum(), model) == ("embed.weight", "decoder.weight")
    assert reachable_parameters(logits.sum(), model) == brute_force(logits.sum(), model)
    everything = model.decoder(hidden).sum()
    assert reachable_parameters(everything, model) == (
        "embed.weight",
        "body.weight",
        "body.bias",
        "decoder.weight",
    )
    with pytest.raises(GradientLeakError) as info:
        assert_isolated(logits.sum(), model.embed, model=model)
    assert "embed.weight" in str(info.value) and "decoder.weight" in str(info.value)


def test_several_outputs_are_walked_together(net: Net) -> None:
    main, probe = net(X)
    assert reachable_parameters((probe.sum(),), net) == ("probe.weight", "probe.bias")
    both = reachable_parameters([main[:, 0].sum(), probe.sum()], net)
    assert set(both) == {n for n, _ in net.named_parameters()}
    # Non-scalar outputs are fine too: the walk needs no grad_outputs.
    assert reachable_parameters([main, probe], net) == both


class MulAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0), grad.sum(0)


def test_custom_autograd_function() -> None:
    model = nn.ParameterDict({"w": nn.Parameter(torch.randn(3)), "b": nn.Parameter(torch.zeros(3))})
    lin = nn.Linear(3, 3)
    holder = nn.ModuleDict({"lin": lin, "params": model})
    out = MulAdd.apply(lin(torch.randn(2, 3)), model["w"], model["b"]).sum()
    expected = tuple(n for n, _ in holder.named_parameters())
    assert reachable_parameters(out, holder) == expected == brute_force(out, holder)
    detached = MulAdd.apply(lin(torch.randn(2, 3)).detach(), model["w"], model["b"]).sum()
    assert set(reachable_parameters(detached, holder)) == {"params.w", "params.b"}


def test_custom_function_context_may_hold_a_tensor_named_variable() -> None:
    """The node of a custom Function is its ctx: a ``variable`` attribute must not end the walk."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.variable = x.detach()
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * 2

    model = nn.Linear(2, 2)
    out = Scale.apply(model(torch.randn(1, 2))).sum()
    assert reachable_parameters(out, model) == ("weight", "bias") == brute_force(out, model)


def test_reachability_is_structural_an_upper_bound() -> None:
    """A Function that returns None for an input still has the edge (see the Note)."""

    class DropGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x * w

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return grad, None

    model = nn.Linear(2, 2)
    out = DropGrad.apply(model(torch.randn(1, 2)), model.bias).sum()
    assert reachable_parameters(out, model) == ("weight", "bias")
    assert brute_force(out, model) == ("weight", "bias")  # bias: reached through the Linear
    zero = (model.weight * 0).sum()  # zero gradient, but a path: reached by both answers
    assert reachable_parameters(zero, model) == brute_force(zero, model) == ("weight",)


def test_views_and_in_place_ops() -> None:
    a, b, c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    model = nn.ModuleDict({"a": a, "b": b, "c": c})
    x = torch.randn(4, 3)
    h = a(x)
    h[0].mul_(2)  # CopySlices over a view of h
    h.view(-1)[:3].add_(b(x)[0])  # in place on a view, with b's output
    flat = h.t().reshape(-1)
    loss = flat.sum()
    assert reachable_parameters(loss, model) == brute_force(loss, model)
    assert reachable_parameters(loss, model) == ("a.weight", "a.bias", "b.weight", "b.bias")
    # A buffer that did not require grad picks up a path through an in-place write.
    buf = torch.zeros(2, 3)
    buf[1].copy_(c(x).mean(0))
    assert reachable_parameters(buf.sum(), model) == ("c.weight", "c.bias")
    assert reachable_parameters(buf.sum(), model) == brute_force(buf.sum(), model)
    # In place on a detached view: the edit changes values but adds no path.
    d = a(x)
    d.detach()[0].mul_(3)
    assert reachable_parameters(d.sum(), model) == ("a.weight", "a.bias")


def test_loss_without_grad_fn_reaches_nothing(net: Net) -> None:
    with torch.no_grad():
        main, _ = net(X)
    assert reachable_parameters(main.sum(), net) == ()
    assert reachable_parameters(torch.tensor(1.0), net) == ()
    assert reachable_parameters([], net) == ()
    assert_isolated(main.sum(), net)


def test_a_parameter_that_is_its_own_loss_reaches_itself(net: Net) -> None:
    assert reachable_parameters(net.scale, net) == ("scale",)


def test_frozen_parameters_are_never_reached(net: Net) -> None:
    net.encoder.requires_grad_(False)
    main, _ = net(X)
    assert reachable_parameters(main.sum(), net) == ("scale", "head.weight", "head.bias")
    assert reachable_parameters(main.sum(), net) == brute_force(main.sum(), net)


def test_deep_graph_needs_no_recursion() -> None:
    layer = nn.Linear(2, 2)
    h = layer(torch.randn(1, 2))
    for _ in range(3 * sys.getrecursionlimit()):
        h = h * 1.0001
    assert reachable_parameters(h.sum(), layer) == ("weight", "bias")


def test_diamonds_are_visited_once() -> None:
    """A graph whose routes double at every level: exponential without a visited set."""
    layer = nn.Linear(2, 2)
    h = layer(torch.randn(1, 2))
    for _ in range(60):
        h = h + h.tanh()
    assert reachable_parameters(h.sum(), layer) == ("weight", "bias")


def test_reentrant_checkpoint_is_seen_through_without_a_warning() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    x = torch.randn(1, 2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for reentrant in (True, False):
            out = checkpoint(model, x, use_reentrant=reentrant)
            assert len(reachable_parameters(out.sum(), model)) == 4
            model.zero_grad(set_to_none=True)
            out.sum().backward()
            assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    ("loss", "model", "message"),
    [
        (1.0, nn.Linear(1, 1), r"^reachable_parameters\(\): loss must be a torch.Tensor"),
        ("loss", nn.Linear(1, 1), r"^reachable_parameters\(\): loss must be"),
        ([torch.ones(1), 2.0], nn.Linear(1, 1), r"^reachable_parameters\(\): .*float at index 1"),
        (torch.ones(1), [nn.Linear(1, 1)], r"^reachable_parameters\(\): model must be"),
    ],
)
def test_wrong_types(loss: Any, model: Any, message: str) -> None:
    with pytest.raises(IsolationTypeError, match=message) as info:
        reachable_parameters(loss, model)
    assert isinstance(info.value, TypeError) and isinstance(info.value, IsolationError)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    n_layers=st.integers(1, 6),
    cut=st.integers(0, 6),
    frozen=st.sets(st.integers(0, 5)),
    skip=st.booleans(),
)
def test_random_chains_agree_with_brute_force(
    n_layers: int, cut: int, frozen: set[int], skip: bool
) -> None:
    torch.manual_seed(n_layers)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(n_layers)])
    for i in frozen & set(range(n_layers)):
        model[i].requires_grad_(False)
    h = torch.randn(2, 3)
    first = None
    for i, layer in enumerate(model):
        if i == cut:
            h = h.detach()
        h = layer(h)
        if first is None:
            first = h
    loss = h.sum() + (first.sum() if skip and first is not None else 0)
    assert reachable_parameters(loss, model) == brute_force(loss, model)


# --------------------------------------------------------------------------------------------
# assert_isolated


def test_assert_isolated_passes_through_a_cut(net: Net) -> None:
    _, probe = net(X)
    assert assert_isolated(probe.sum(), net.encoder) is None
    assert_isolated(probe.sum(), [net.encoder, net.head])
    assert_isolated(probe.sum(), "encoder", model=net)


def test_assert_isolated_names_parameter_owner_and_operation(net: Net) -> None:
    main, _ = net(X)
    with pytest.raises(GradientLeakError, match=r"^assert_isolated\(\): ") as info:
        assert_isolated(main.sum(), net.encoder, model=net)
    message = str(info.value)
    assert "reaches 4 of 4 protected parameters" in message
    for name in ("encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"):
        assert f"\n  {name}" in message
    assert "in 'encoder.2' (Linear); consumed by AddmmBackward0 (through TBackward0)" in message
    assert "Shortest route, to encoder.2.bias: SumBackward0 -> MulBackward0 -> " in message
    assert "Fix: " in message
    assert isinstance(info.value, AssertionError)


def test_assert_isolated_lists_only_the_leaks(net: Net) -> None:
    h = net.encoder[0](X)
    loss = net.head(net.encoder[2](h.detach().relu())).sum()
    with pytest.raises(GradientLeakError) as info:
        assert_isolated(loss, net.encoder, model=net)
    message = str(info.value)
    assert "reaches 2 of 4" in message
    assert "encoder.2.weight" in message and "encoder.0" not in message


@pytest.mark.parametrize(
    "protected",
    [
        pytest.param(lambda n: n.encoder, id="module"),
        pytest.param(lambda n: [n.encoder[0], n.encoder[2]], id="modules"),
        pytest.param(lambda n: n.encoder.named_parameters(), id="pairs"),
        pytest.param(lambda n: dict(n.encoder.named_parameters()), id="mapping"),
        pytest.param(lambda n: list(n.encoder.parameters()), id="parameters"),
        pytest.param(lambda n: n.encoder[2].weight, id="parameter"),
    ],
)
def test_assert_isolated_accepts_every_form(net: Net, protected: Any) -> None:
    main, probe = net(X)
    assert_isolated(probe.sum(), protected(net))
    with pytest.raises(GradientLeakError, match=r"^assert_isolated\(\): the loss reaches"):
        assert_isolated(main.sum(), protected(net))


def test_names_without_a_model_are_relative(net: Net) -> None:
    main, _ = net(X)
    with pytest.raises(GradientLeakError) as info:
        assert_isolated(main.sum(), [net.encoder[0], net.head])
    assert "\n  [0].weight" in str(info.value) and "\n  [1].bias" in str(info.value)
    with pytest.raises(GradientLeakError) as info:
        assert_isolated(main.sum(), list(net.head.parameters()))
    assert "<tensor #0, shape (2, 8)>" in str(info.value)
    with pytest.raises(GradientLeakError) as info:
        assert_isolated(main.sum(), list(net.head.parameters()), model=net)
    assert "\n  head.weight" in str(info.value)


def test_selectors_and_input_tensors(net: Net) -> None:
    x = X.clone().requires_grad_()
    main, probe = net(x)
    with pytest.raises(GradientLeakError, match=r"head\.bias"):
        assert_isolated(main.sum(), ["*.bias"], model=net)
    # Any leaf can be protected by name: here the input itself.
    assert_isolated(probe.sum(), [("x", x)])
    with pytest.raises(GradientLeakError, match=r"\n  x  "):
        assert_isolated(main.sum(), [("x", x)])


def test_assert_isolated_errors(net: Net) -> None:
    main, _ = net(X)
    with pytest.raises(SelectorError, match=r"^assert_isolated\(\): 'nope\.\*' matched no"):
        assert_isolated(main.sum(), "nope.*", model=net)
    with pytest.raises(IsolationTypeError, match=r"^assert_isolated\(\): the selector 'encoder'"):
        assert_isolated(main.sum(), "encoder")
    with pytest.raises(SelectorError, match=r"^assert_isolated\(\): the Linear passed is not a"):
        assert_isolated(main.sum(), nn.Linear(1, 1), model=net)
    with pytest.raises(IsolationTypeError, match=r"^assert_isolated\(\): item 0 is a int"):
        assert_isolated(main.sum(), [3])
    with pytest.raises(IsolationTypeError, match=r"^assert_isolated\(\): cannot tell"):
        assert_isolated(main.sum(), 3)  # type: ignore[arg-type]
    params = net.encoder.parameters()
    with pytest.raises(GradientLeakError):
        assert_isolated(main.sum(), params)
    with pytest.raises(SelectorError, match=r"^assert_isolated\(\): generator names no param"):
        assert_isolated(main.sum(), params)  # exhausted: would pass vacuously
    with pytest.raises(SelectorError, match=r"^gradient_invariance\(\): ReLU names no param"):
        gradient_invariance(main.sum(), main.sum(), net.encoder[1])
    with pytest.raises(IsolationTypeError, match=r"^assert_isolated\(\): loss must be"):
        assert_isolated(None, net)  # type: ignore[arg-type]
    with pytest.raises(IsolationTypeError) as empty:
        assert_isolated([], net.encoder)  # an emptied list of auxiliary losses
    assert str(empty.value) == (
        "assert_isolated(): loss is an empty sequence, so there is nothing to prove isolated (a "
        "branch that produced no loss, an emptied config list); pass the loss tensors"
    )


# --------------------------------------------------------------------------------------------
# The leak report, to the word: the operations that consume a protected parameter, the route
# from the loss, where a long route is shortened, and the reentrant-checkpoint warning

FIX = (
    "Fix: cut the path where the branch starts (isolate.stop_gradient(features) or "
    "isolate.Detached(module)), or freeze the protected parameters (isolate.freeze)"
)


def _leak(loss: torch.Tensor, module: nn.Module) -> str:
    with pytest.raises(GradientLeakError) as info:
        assert_isolated(loss, module)
    return str(info.value)


@pytest.fixture
def lin() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 3)


def test_a_parameter_that_is_the_output_itself_is_reported_without_an_operation(
    lin: nn.Linear,
) -> None:
    assert _leak(lin.weight, lin) == (
        "assert_isolated(): the loss reaches 1 of 2 protected parameters:\n"
        "  weight  in '<root>' (Linear)\n" + FIX
    )


def test_a_route_of_layout_operations_only_names_them(lin: nn.Linear) -> None:
    assert _leak(lin.weight.t(), lin) == (
        "assert_isolated(): the loss reaches 1 of 2 protected parameters:\n"
        "  weight  in '<root>' (Linear); consumed by TBackward0\n"
        "Shortest route, to weight: TBackward0 -> AccumulateGrad\n" + FIX
    )


def test_every_consuming_operation_is_named_looking_through_layout_ops(lin: nn.Linear) -> None:
    x = torch.randn(2, 3)
    message = _leak((x @ lin.weight.t()).sum() + lin.weight.sum(), lin)
    assert "  weight  in '<root>' (Linear); consumed by SumBackward0, MmBackward0 (through " \
        "TBackward0)\n" in message  # fmt: skip
    assert "Shortest route, to weight: AddBackward0 -> SumBackward0 -> AccumulateGrad\n" in message


def test_node_names_lose_the_autograd_namespace(lin: nn.Linear) -> None:
    z = torch.zeros(2, 3)
    z[0] = lin.weight[0] * 2  # an in-place write into a slice: a CopySlices node
    message = _leak(z.sum(), lin)
    assert (
        "Shortest route, to weight: SumBackward0 -> CopySlices -> MulBackward0 -> "
        "SelectBackward0 -> AccumulateGrad\n"
    ) in message
    assert "torch::autograd::" not in message


@pytest.mark.parametrize(("muls", "route"), [
    (9, " -> ".join(["MulBackward0"] * 9 + ["SumBackward0", "AccumulateGrad"])),
    (10, " -> ".join(["MulBackward0"] * 5 + ["... 2 more ..."]
                     + ["MulBackward0"] * 3 + ["SumBackward0", "AccumulateGrad"])),
    (14, " -> ".join(["MulBackward0"] * 5 + ["... 6 more ..."]
                     + ["MulBackward0"] * 3 + ["SumBackward0", "AccumulateGrad"])),
])  # fmt: skip
def test_a_long_route_keeps_five_nodes_at_each_end(lin: nn.Linear, muls: int, route: str) -> None:
    loss = lin.weight.sum()
    for _ in range(muls):
        loss = loss * 1.0
    message = _leak(loss, lin)
    assert f"Shortest route, to weight: {route}\n" in message


def test_a_reentrant_checkpoint_is_re_run_not_warned_about(lin: nn.Linear) -> None:
    x = torch.randn(2, 3, requires_grad=True)
    out = checkpoint(lin, x, use_reentrant=True).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reachable_parameters(out, lin) == ("weight", "bias")
        assert_isolated(out, nn.Linear(1, 1))  # an unrelated module: no leak
        with pytest.raises(GradientLeakError, match=r"CheckpointFunctionBackward -> Addmm"):
            assert_isolated(out, lin)


def test_the_shortest_route_is_the_one_reported(lin: nn.Linear) -> None:
    x = torch.randn(2, 3)
    deep = (lin(x) * 1.0 * 1.0).sum()  # weight and bias: both through AddmmBackward0
    message = _leak(deep + lin.bias.sum(), lin)
    routes = re.findall(r"Shortest route, to (\w+): (.*)\n", message)
    assert routes == [("bias", "AddBackward0 -> SumBackward0 -> AccumulateGrad")]


def test_a_chain_of_layout_operations_is_shown_whole(lin: nn.Linear) -> None:
    # Arrows point the way gradient flows: TBackward0 gets it from UnsqueezeBackward0.
    assert "consumed by TBackward0 <- UnsqueezeBackward0\n" in _leak(
        lin.weight.t().unsqueeze(0), lin
    )
    assert "consumed by SumBackward0 (through TBackward0 <- UnsqueezeBackward0)\n" in _leak(
        lin.weight.t().unsqueeze(0).sum(), lin
    )


class _TwoLeaves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.zeta = nn.Parameter(torch.ones(2))  # first in model order, last by name
        self.alpha = nn.Parameter(torch.ones(2))


def test_of_equally_short_routes_the_first_parameter_in_model_order_is_shown() -> None:
    model = _TwoLeaves()
    message = _leak(model.zeta.sum() + model.alpha.sum(), model)
    assert "Shortest route, to zeta: AddBackward0 -> SumBackward0 -> AccumulateGrad\n" in message


# --------------------------------------------------------------------------------------------
# What assert_isolated cannot see, it refuses in its own name


def test_a_segment_that_cannot_be_re_run_is_refused_in_the_callers_name(lin: nn.Linear) -> None:
    out = freed_checkpoint(lin)
    for audit, caller in (
        (lambda: reachable_parameters(out, lin), r"reachable_parameters\(\)"),
        (lambda: assert_isolated(out, lin), r"assert_isolated\(\)"),
        (lambda: assert_isolated(out, lin.weight, model=lin), r"assert_isolated\(\)"),
    ):
        with pytest.raises(BlindSpotError, match=rf"^{caller}: cannot re-run .* saved arguments"):
            audit()


class DTensor(nn.Parameter):
    """Stands for a sharded parameter: the audits know one by its class name alone."""


def test_a_sharded_parameter_no_module_passed_owns_is_refused() -> None:
    sharded = DTensor(torch.zeros(2))
    temporary = torch.zeros(2, requires_grad=True)  # what FSDP2 would put in the graph
    loss = (temporary * 2).sum()
    # Negative control: the walk alone finds no sharded parameter, so without the refusal
    # the audit would pass whatever the loss reaches.
    assert torch.autograd.grad(loss, sharded, allow_unused=True) == (None,)
    with pytest.raises(ShardedGraphError) as info:
        assert_isolated(loss, [sharded])
    assert str(info.value) == (
        "assert_isolated(): 1 of the parameters audited are sharded (DTensor), and no "
        "fully_shard unit passed owns them, so their graph leaves (FSDP's unsharded "
        "temporaries) cannot be found; pass the whole model with model=..."
    )


def _hidden_leaves() -> tuple[FlatViews, torch.Tensor]:
    model = FlatViews(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)))
    loss = model(torch.randn(2, 3)).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert grads == (None,) * 4  # the backward writes to the hidden leaf, not to these
    return model, loss


@pytest.mark.parametrize(
    "protected",
    [
        pytest.param(lambda m: m, id="module"),
        pytest.param(lambda m: [m.module[0], m.module[2]], id="modules"),
    ],
)
def test_hidden_leaves_of_the_modules_protected_are_refused_without_a_model(
    protected: Any,
) -> None:
    model, loss = _hidden_leaves()
    with pytest.raises(ShardedGraphError, match=r"^assert_isolated\(\): the graph's leaves"):
        assert_isolated(loss, protected(model))


@pytest.mark.parametrize(
    "protected",
    [
        pytest.param(lambda m: list(m.module[0].parameters()), id="parameters"),
        pytest.param(lambda m: "module.0.*", id="selector"),
        pytest.param(lambda m: m.module[0], id="submodule"),
    ],
)
def test_hidden_leaves_of_the_model_are_refused_whatever_is_protected(protected: Any) -> None:
    model, loss = _hidden_leaves()
    with pytest.raises(ShardedGraphError, match=r"^assert_isolated\(\): the graph's leaves"):
        assert_isolated(loss, protected(model), model=model)


def test_a_segment_checkpointed_inside_a_segment_on_its_argument_reaches_what_feeds_both() -> None:
    # The inner checkpoint takes the outer segment's argument as it is, so the inner
    # segment's detached argument stands for the outer's, which stands for embed's output.
    torch.manual_seed(0)
    model = nn.ModuleDict({"embed": nn.Linear(3, 3), "block": nn.Linear(3, 3)})

    def outer(h: torch.Tensor) -> torch.Tensor:
        return checkpoint(model["block"], h, use_reentrant=True)  # type: ignore[no-any-return]

    x = torch.randn(2, 3)
    loss = checkpoint(outer, model["embed"](x), use_reentrant=True).sum()
    names = ("embed.weight", "embed.bias", "block.weight", "block.bias")
    assert reachable_parameters(loss, model) == names
    loss.backward()  # autograd.grad refuses reentrant checkpoints: a real backward
    assert tuple(n for n, p in model.named_parameters() if p.grad is not None) == names


def test_a_graph_through_a_once_differentiable_function_is_refused_by_every_walk() -> None:
    """Differentiated again, its backward leaves a node that raises and whose edges go to
    stand-in leaves: the walk would read the layer behind it as unreached, and a real
    backward fails there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(2, 3, requires_grad=True)
    (g,) = torch.autograd.grad(model[1](TanhOnce.apply(model[0](x))).sum(), x, create_graph=True)
    penalty = g.pow(2).sum()
    (partial,) = torch.autograd.grad(penalty, model[1].weight, retain_graph=True, allow_unused=True)
    assert partial is None  # autograd.grad cannot see past the node either
    start = r"the loss's graph runs through torch::autograd::Error \(consumed by MmBackward0\), "
    for name, audit in [
        ("reachable_parameters", lambda: reachable_parameters(penalty, model)),
        ("assert_isolated", lambda: assert_isolated(penalty, model[1])),
        ("cut_off_parameters", lambda: cut_off_parameters(penalty, model)),
        ("assert_reached", lambda: assert_reached(penalty, model)),
    ]:
        with pytest.raises(BlindSpotError, match=rf"^{name}\(\): {start}whose backward raises"):
            audit()
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        penalty.backward()
