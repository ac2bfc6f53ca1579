"""cut_off_parameters / assert_reached / trace_forward: trainable parameters that no loss
reaches, each scenario with its negative control and checked against brute force
(``torch.autograd.grad(..., allow_unused=True)`` or a real ``backward``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint

import isolate
from isolate import assert_reached
from isolate.cutoff import CutOff, cut_off_parameters, trace_forward
from isolate.errors import (
    CutOffError,
    IsolationError,
    IsolationTypeError,
    SelectorError,
)
from isolate.reachability import reachable_parameters

pytestmark = pytest.mark.usefixtures("one_thread")


def unreached_by_backward(loss: torch.Tensor, model: nn.Module) -> tuple[str, ...]:
    """Trainable names whose .grad stays None after a real backward (works through reentrant
    checkpoints, where autograd.grad does not)."""
    for p in model.parameters():
        p.grad = None
    loss.backward(retain_graph=True)
    named = model.named_parameters(remove_duplicate=False)
    out = tuple(n for n, p in named if p.requires_grad and p.grad is None)
    for p in model.parameters():
        p.grad = None
    return out


def unreached_by_grad(loss: torch.Tensor, model: nn.Module) -> tuple[str, ...]:
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    if not loss.requires_grad:
        return tuple(n for n, _ in named)
    grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True, allow_unused=True)
    return tuple(n for (n, _), g in zip(named, grads, strict=True) if g is None)


def names(module: nn.Module, prefix: str) -> tuple[str, ...]:
    return tuple(prefix + n for n, _ in module.named_parameters())


# --------------------------------------------------------------------------------------------
# Reentrant checkpoint with a frozen input (transformers#21381, open_clip#573)


class Checkpointed(nn.Module):
    def __init__(self, *, reentrant: bool = True, input_grad: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4).requires_grad_(False)  # frozen embeddings
        self.segment = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.reentrant, self.input_grad = reentrant, input_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.input_grad:
            h.requires_grad_()  # the enable_input_require_grads workaround
        return self.head(checkpoint(self.segment, h, use_reentrant=self.reentrant))


SEGMENT = ("segment.0.weight", "segment.0.bias", "segment.2.weight", "segment.2.bias")


def test_reentrant_checkpoint_with_frozen_input_cuts_off_the_segment() -> None:
    torch.manual_seed(0)
    model = Checkpointed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "None of the inputs have requires_grad=True"
        with trace_forward(model) as trace:
            loss = model(torch.randn(3, 4)).sum()
    assert unreached_by_backward(loss, model) == SEGMENT  # the failure is real
    cut = cut_off_parameters(loss, model, trace=trace)
    assert tuple(cut.parameters) == SEGMENT
    reason = cut.parameters["segment.0.weight"]
    assert reason.startswith("'segment.0' (Linear) ran inside a reentrant checkpoint whose ")
    assert "requires_grad_()" in reason and "use_reentrant=False" in reason
    assert cut.trainable == 6 and not cut.clean
    with pytest.raises(CutOffError, match=r"^assert_reached\(\): 4 of 6 trainable") as info:
        assert_reached(loss, model, trace=trace)
    message = str(info.value)
    assert "\n  segment.0.weight, segment.0.bias: 'segment.0' (Linear) ran inside" in message
    assert "\n  segment.2.weight, segment.2.bias: 'segment.2' (Linear)" in message
    assert isinstance(info.value, AssertionError) and isinstance(info.value, IsolationError)
    # Without a trace the walk still names them, and says how to learn why.
    blind = cut_off_parameters(loss, model)
    assert tuple(blind.parameters) == SEGMENT
    assert "trace_forward" in blind.parameters["segment.2.bias"]


def test_reentrant_checkpoint_fixed_by_an_input_that_requires_grad() -> None:
    """The fix works: the segment sits behind CheckpointFunctionBackward, which the walk
    re-runs as backward does, so every parameter is reached."""
    torch.manual_seed(0)
    model = Checkpointed(input_grad=True)
    with trace_forward(model) as trace:
        loss = model(torch.randn(3, 4)).sum()
    assert unreached_by_backward(loss, model) == ()  # every parameter learns
    for kwargs in ({}, {"trace": trace}):
        cut = cut_off_parameters(loss, model, **kwargs)
        assert dict(cut.parameters) == {} and cut.clean
    assert_reached(loss, model)


def test_non_reentrant_checkpoint_is_seen_through() -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = model(torch.randn(3, 4)).sum()
        cut = cut_off_parameters(loss, model)
    assert cut.clean and cut.trainable == 6
    assert unreached_by_grad(loss, model) == ()
    assert_reached(loss, model)


# --------------------------------------------------------------------------------------------
# A misplaced detach, an unused branch, a skipped group, no_grad


class Trunk(nn.Module):
    def __init__(self, detach_at: int | None = None) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)
        self.probe = isolate.Detached(nn.Linear(4, 2))
        self.detach_at = detach_at

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for i, layer in enumerate(self.trunk):
            if i == self.detach_at:
                x = x.detach()
            x = layer(x)
        return self.head(x), self.probe(x)


def test_a_detach_one_layer_too_early_cuts_off_the_trunk() -> None:
    torch.manual_seed(0)
    model = Trunk(detach_at=2)
    with trace_forward(model) as trace:
        main, probe = model(torch.randn(5, 4))
    losses = {"main": main.pow(2).mean(), "probe": probe.pow(2).mean()}
    total = losses["main"] + losses["probe"]
    assert unreached_by_grad(total, model) == ("trunk.0.weight", "trunk.0.bias")
    cut = cut_off_parameters(losses, model, trace=trace)
    assert tuple(cut.parameters) == ("trunk.0.weight", "trunk.0.bias")
    assert cut.parameters["trunk.0.bias"] == (
        "'trunk.0' (Linear) ran, but its output does not reach the loss: it is detached "
        "(stop_gradient, .detach(), Detached) on the way, or feeds a loss that is not passed "
        "in; the loss's graph starts again at 'trunk.2' (Linear), whose input carries no graph"
    )
    # Negative control: the detach where the probe starts (inside Detached) cuts off nothing.
    control = Trunk()
    main, probe = control(torch.randn(5, 4))
    assert cut_off_parameters([main.sum(), probe.sum()], control).clean
    assert_reached([main.sum(), probe.sum()], control)


def test_an_unused_branch_and_a_loss_not_added_in() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"body": nn.Linear(4, 4), "main": nn.Linear(4, 1), "aux": nn.Linear(4, 1)}
    )
    with trace_forward(model) as trace:
        h = model["body"](torch.randn(3, 4))
        aux = model["aux"](h).sum()  # computed, never added in
        main = model["main"](h).sum()  # runs later, on an input that carries a graph
    assert unreached_by_grad(main, model) == ("aux.weight", "aux.bias")
    cut = cut_off_parameters(main, model, trace=trace)
    assert list(cut.parameters) == ["aux.weight", "aux.bias"]
    assert cut.parameters["aux.weight"].startswith(
        "'aux' (Linear) ran, but its output does not reach the loss"
    )
    assert "starts again" not in cut.parameters["aux.weight"]  # no detach to point at
    assert cut_off_parameters(main + aux, model).clean  # control: added in
    assert cut_off_parameters({"main": main, "aux": aux}, model).clean


def test_a_thawed_group_that_the_forward_skips() -> None:
    class Adapted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Linear(4, 4)
            self.adapter = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, *, use_adapter: bool) -> torch.Tensor:
            h = self.backbone(x)
            return self.head(self.adapter(h) if use_adapter else h)

    torch.manual_seed(0)
    model = Adapted()
    handle = isolate.freeze(model, "backbone")
    try:
        with trace_forward(model) as trace:
            loss = model(torch.randn(2, 4), use_adapter=False).sum()
        assert unreached_by_grad(loss, model) == ("adapter.weight", "adapter.bias")
        cut = cut_off_parameters(loss, model, trace=trace)
        assert cut.parameters == {
            "adapter.weight": "'adapter' (Linear) did not run in the traced forward (a branch "
            "or group the forward skips on this path)",
            "adapter.bias": "'adapter' (Linear) did not run in the traced forward (a branch "
            "or group the forward skips on this path)",
        }
        assert cut.trainable == 4  # the frozen backbone is not checked
        with pytest.raises(CutOffError, match=r"adapter\.weight, adapter\.bias: 'adapter'"):
            assert_reached(loss, model, trace=trace)
        assert_reached(model(torch.randn(2, 4), use_adapter=True).sum(), model)  # control
    finally:
        handle.restore()


def test_a_module_run_under_no_grad() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"teacher": nn.Linear(4, 4), "student": nn.Linear(4, 4)})
    x = torch.randn(2, 4)
    with trace_forward(model) as trace:
        with torch.no_grad():
            target = model["teacher"](x)
        loss = (model["student"](x) - target).pow(2).mean()
    cut = cut_off_parameters(loss, model, trace=trace)
    assert list(cut.parameters) == ["teacher.weight", "teacher.bias"]
    assert cut.parameters["teacher.weight"].startswith(
        "'teacher' (Linear) ran with gradient tracking off (torch.no_grad(), inference_mode)"
    )


def test_a_parameter_read_through_detach_inside_a_module_that_reaches() -> None:
    class Odd(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight.detach(), self.bias)

    model = nn.Sequential(Odd(3, 3))
    with trace_forward(model) as trace:
        loss = model(torch.randn(2, 3)).sum()
    cut = cut_off_parameters(loss, model, trace=trace)
    assert list(cut.parameters) == ["0.weight"] == list(unreached_by_grad(loss, model))
    reason = cut.parameters["0.weight"]
    assert "its output reaches the loss, but not through this parameter" in reason


def test_a_loss_without_graph_cuts_off_everything() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with torch.no_grad():
        loss = model(torch.randn(1, 2)).sum()
    cut = cut_off_parameters(loss, model)
    assert list(cut.parameters) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert set(cut.parameters.values()) == {
        "no loss has a graph (computed under torch.no_grad(), detached, or from frozen "
        "parameters only)"
    }
    assert cut_off_parameters([], model).trainable == 4


# --------------------------------------------------------------------------------------------
# Deliberately unused parameters, ties, zero gradients


class MoE(nn.Module):
    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(4, experts)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        gate = self.router(x).softmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = choice == i
            if rows.any():
                out[rows] = expert(x[rows]) * gate[rows, i : i + 1]
        return out


def test_experts_not_routed_this_batch_can_be_declared() -> None:
    torch.manual_seed(0)
    model = MoE()
    with torch.no_grad():
        model.router.weight.zero_()
        model.router.bias.copy_(torch.tensor([0.0, 1.0, 0.0, 0.0]))  # every token to expert 1
    loss = model(torch.randn(6, 4)).sum()
    unused = ("experts.0.weight", "experts.0.bias", "experts.2.weight", "experts.2.bias")
    unused += ("experts.3.weight", "experts.3.bias")
    assert unreached_by_grad(loss, model) == unused
    assert tuple(cut_off_parameters(loss, model).parameters) == unused
    for declared in ("experts.*", ["experts"], [model.experts[0], "experts.2", "experts.3.*"]):
        cut = cut_off_parameters(loss, model, expected_unused=declared)
        assert cut.clean and cut.parameters == {}
        assert cut.expected_unused == unused
        assert_reached(loss, model, expected_unused=declared)
    partly = cut_off_parameters(loss, model, expected_unused="experts.0")
    assert tuple(partly.parameters) == unused[2:] and partly.expected_unused == unused[:2]
    with pytest.raises(SelectorError, match=r"^assert_reached\(\): 'expert\.\*' matched no"):
        assert_reached(loss, model, expected_unused="expert.*")


def test_a_zero_initialised_vit_head_is_reached_not_cut_off() -> None:
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
    ).train()
    assert torch.count_nonzero(vit.heads.head.weight) == 0
    loss = vit(torch.randn(2, 3, 32, 32)).logsumexp(-1).mean()
    grads = torch.autograd.grad(loss, list(vit.parameters()), retain_graph=True)
    encoder = [g for (n, _), g in zip(vit.named_parameters(), grads, strict=True) if "encoder" in n]
    assert all(torch.count_nonzero(g) == 0 for g in encoder)  # exactly zero, through a live path
    assert cut_off_parameters(loss, vit).clean
    assert_reached(loss, vit)


def test_tied_parameters_are_reached_under_every_name() -> None:
    embed = nn.Embedding(10, 4)
    decoder = nn.Linear(4, 10, bias=False)
    decoder.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "body": nn.Linear(4, 4), "decoder": decoder})
    tokens = torch.tensor([[1, 2]])
    loss = model["decoder"](model["body"](model["embed"](tokens)).detach()).sum()
    cut = cut_off_parameters(loss, model)
    assert list(cut.parameters) == ["body.weight", "body.bias"]  # the tie is reached
    assert cut.trainable == 4
    both = cut_off_parameters(model["body"](torch.randn(1, 4)).sum(), model)
    assert list(both.parameters) == ["embed.weight", "decoder.weight"]


# --------------------------------------------------------------------------------------------
# No false alarms on the torchvision zoo in train mode


ZOO: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), 32),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=10), 32),
    "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(num_classes=10), 32),
    "shufflenet_v2": (lambda: torchvision.models.shufflenet_v2_x0_5(num_classes=10), 32),
    "squeezenet": (lambda: torchvision.models.squeezenet1_1(num_classes=10), 64),
    "densenet121": (lambda: torchvision.models.densenet121(num_classes=10), 32),
    "convnext_tiny": (lambda: torchvision.models.convnext_tiny(num_classes=10), 32),
    "swin_t": (lambda: torchvision.models.swin_t(num_classes=10), 64),
    "vit": (
        lambda: torchvision.models.VisionTransformer(
            image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
        ),
        32,
    ),
}


@pytest.mark.parametrize("arch", list(ZOO))
def test_no_false_alarm_on_the_torchvision_zoo(arch: str) -> None:
    make, size = ZOO[arch]
    torch.manual_seed(0)
    model = make().train()
    with trace_forward(model) as trace:
        loss = model(torch.randn(2, 3, size, size)).logsumexp(-1).mean()
    cut = cut_off_parameters(loss, model, trace=trace)
    assert cut.clean and cut.trainable == len(list(model.named_parameters()))
    assert unreached_by_grad(loss, model) == ()
    assert_reached(loss, model, trace=trace)


def test_googlenet_aux_classifiers_left_out_of_the_loss_are_cut_off() -> None:
    torch.manual_seed(0)
    model = torchvision.models.googlenet(num_classes=10, aux_logits=True, init_weights=False)
    with trace_forward(model.train()) as trace:
        out = model(torch.randn(2, 3, 64, 64))
    main = out.logits.logsumexp(-1).mean()
    cut = cut_off_parameters(main, model, trace=trace)
    expected = names(model.aux1, "aux1.") + names(model.aux2, "aux2.")
    assert tuple(cut.parameters) == expected == unreached_by_grad(main, model)
    everything = [main, out.aux_logits1.sum(), out.aux_logits2.sum()]
    assert cut_off_parameters(everything, model).clean


# --------------------------------------------------------------------------------------------
# The trace, and argument checks


def test_the_trace_leaves_no_hooks_also_on_error() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    with trace_forward(model) as trace:
        assert all(m._forward_hooks and m._forward_pre_hooks for m in model.modules())
        model(torch.randn(1, 2))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert trace.ran(model[1][0]) and trace.watches(model[1][0])
    assert not trace.watches(nn.Linear(1, 1))
    with pytest.raises(KeyError), trace_forward(model):
        raise KeyError("boom")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_trace_does_not_change_outputs_or_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(4, 3)
    plain = model(x).sum()
    with trace_forward(model):
        traced = model(x).sum()
    assert torch.equal(plain, traced)
    a = torch.autograd.grad(plain, list(model.parameters()))
    b = torch.autograd.grad(traced, list(model.parameters()))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_a_trace_of_another_model_falls_back_to_the_graph_alone() -> None:
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    with trace_forward(model["a"]) as trace:
        loss = model["a"](torch.randn(1, 2)).sum()
    cut = cut_off_parameters(loss, model, trace=trace)
    assert "trace_forward" in cut.parameters["b.weight"]  # b was not watched: no claim


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: cut_off_parameters(1.0, m), r"^cut_off_parameters\(\): loss must be"),
        (lambda m: cut_off_parameters(torch.ones(()), [m]), r"^cut_off_parameters\(\): model"),
        (
            lambda m: cut_off_parameters(torch.ones(()), m, trace=object()),
            r"^cut_off_parameters\(\): trace must be the ForwardTrace",
        ),
        (lambda m: assert_reached(torch.ones(()), m, trace=3), r"^assert_reached\(\): trace"),
        (lambda m: trace_forward(3).__enter__(), r"^trace_forward\(\): model must be"),
    ],
)
def test_argument_errors(call: Callable[[nn.Module], Any], message: str) -> None:
    with pytest.raises(IsolationTypeError, match=message):
        call(nn.Linear(1, 1))


def test_cut_off_agrees_with_reachable_parameters() -> None:
    torch.manual_seed(0)
    model = Trunk(detach_at=2)
    main, probe = model(torch.randn(2, 4))
    reached = set(reachable_parameters([main.sum(), probe.sum()], model))
    cut = cut_off_parameters([main.sum(), probe.sum()], model)
    assert set(cut.parameters) == {n for n, _ in model.named_parameters()} - reached
    assert isinstance(cut, CutOff)
    assert str(cut).startswith("2 of 8 trainable parameters get no gradient from any loss:\n  ")


def test_the_trace_never_breaks_a_forward_on_inputs_it_cannot_look_into() -> None:
    class Batch:  # a PyG-style batch: tensors in attributes, no pytree rule
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 3)
            self.unused = nn.Linear(3, 3)

        def forward(self, batch: Batch) -> Batch:
            return Batch(self.body(batch.x))

    model = Net()
    with trace_forward(model) as trace:
        out = model(Batch(torch.randn(2, 3)))
    cut = cut_off_parameters(out.x.sum(), model, trace=trace)
    assert list(cut.parameters) == ["unused.weight", "unused.bias"]  # from the walk alone
    assert cut.parameters["unused.bias"].startswith("'unused' (Linear) did not run")
