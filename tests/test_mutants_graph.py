"""What the leak report of ``assert_isolated`` says, to the word: the operations that consume
a protected parameter, the route from the loss, where a long route is shortened, and the
re-run of a reentrant checkpoint. Written to kill the mutants of isolate/graph.py that the
rest of the suite let through (see the README's development section)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from isolate import assert_isolated
from isolate.errors import GradientLeakError
from isolate.reachability import reachable_parameters

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
