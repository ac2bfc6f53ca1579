"""The walk of an autograd graph every audit shares (``isolate._autograd``): what it finds,
the routes it records, and how it names the operation that consumes a parameter."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from isolate._autograd import walk
from isolate.errors import BlindSpotError, ShardedGraphError
from isolate.gradients import gradient_invariance, gradient_report
from tests.toolkit._shared import freed_checkpoint
from tests.toolkit.test_reachability import DTensor
from tests.toolkit.test_sharding import _old_layout_unit

# Each backward node that only changes a tensor's layout, and a view of a leaf that makes it.
_LAYOUT: dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]] = {
    "TBackward0": ((2, 3), lambda w: w.t()),
    "TransposeBackward0": ((2, 3), lambda w: w.transpose(0, 1)),
    "PermuteBackward0": ((2, 3), lambda w: w.permute(1, 0)),
    "ViewBackward0": ((2, 3), lambda w: w.view(-1)),
    "UnsafeViewBackward0": ((2, 3), lambda w: torch.ops.aten._unsafe_view(w, [6])),
    "ReshapeAliasBackward0": ((2, 3), lambda w: torch.ops.aten._reshape_alias(w, [6], [1])),
    "ExpandBackward0": ((2, 3), lambda w: w.expand(4, 2, 3)),
    "UnsqueezeBackward0": ((2, 3), lambda w: w.unsqueeze(0)),
    "SqueezeBackward0": ((1, 1, 3), lambda w: w.squeeze()),
    "SqueezeBackward1": ((1, 1, 3), lambda w: w.squeeze(0)),
    "SqueezeBackward2": ((1, 1, 3), lambda w: w.squeeze((0, 1))),
    "SelectBackward0": ((2, 3), lambda w: w[0]),
    "SliceBackward0": ((2, 3), lambda w: w[1:]),
    "AsStridedBackward0": ((2, 3), lambda w: w.as_strided((3,), (1,))),
    "AliasBackward0": ((2, 3), lambda w: torch.ops.aten.alias(w)),
    "CloneBackward0": ((2, 3), lambda w: w.clone()),
    "ToCopyBackward0": ((2, 3), lambda w: w.to(torch.float64)),
    "UnbindBackward0": ((2, 3), lambda w: w.unbind(0)[0]),
    "SplitBackward0": ((2, 3), lambda w: w.split(1)[0]),
    "SplitWithSizesBackward0": ((2, 3), lambda w: w.split([1, 1])[0]),
}


@pytest.mark.parametrize("op", list(_LAYOUT))
def test_an_operation_that_only_changes_the_layout_is_looked_through(op: str) -> None:
    shape, view = _LAYOUT[op]
    weight = torch.ones(shape, requires_grad=True)
    found = walk([(view(weight) * 2.0).sum()], "audit()")
    assert found.connecting_ops(weight) == [f"MulBackward0 (through {op})"]


def test_an_output_that_is_a_leaf_itself_is_found_as_that_leaf() -> None:
    weight = nn.Parameter(torch.ones(2))
    found = walk([weight, torch.ones(2)], "audit()")
    assert list(found.leaves) == [id(weight)] and found.leaves[id(weight)] is weight
    assert found.consumers == {} and found.parent == {}


def test_a_node_the_walk_stops_at_is_recorded_but_not_walked_through() -> None:
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    scaled = a * 2.0
    assert scaled.grad_fn is not None
    found = walk([(scaled + b).sum()], "audit()", stop=lambda node: node is scaled.grad_fn)
    assert scaled.grad_fn in found.parent
    assert list(found.leaves) == [id(b)]


# --------------------------------------------------------------------------------------------
# The gradient audits' inputs (graph_inputs): refused in the caller's name


def test_a_model_holding_flat_parameters_is_refused_even_where_the_loss_reaches_none() -> None:
    # The walk meets no FlatParameter (the loss reaches no parameter), so only the model's
    # own parameters can tell that its gradients are slices of a flat one.
    model = nn.Linear(2, 2)
    model.weight._is_flat_param = True  # type: ignore[attr-defined]
    loss = (torch.ones(2, requires_grad=True) * 2.0).sum()
    with pytest.raises(ShardedGraphError) as caught:
        gradient_report({"main": loss}, model)
    assert str(caught.value) == (
        "gradient_report(): the model holds FSDP1 FlatParameters (FullyShardedDataParallel): "
        "the gradient of one parameter is a slice of a flat gradient that autograd cannot "
        "return alone; compute the report on the model before wrapping it, or shard it with "
        "fully_shard (FSDP2)"
    )


def test_a_gradient_audit_refuses_a_segment_that_cannot_be_re_run_in_its_own_name() -> None:
    lin = nn.Linear(3, 2)
    out = freed_checkpoint(lin)
    with pytest.raises(BlindSpotError, match=r"^gradient_report\(\): cannot re-run .* saved"):
        gradient_report({"main": out}, lin)
    with pytest.raises(BlindSpotError, match=r"^gradient_invariance\(\): cannot re-run .* saved"):
        gradient_invariance(out, out, lin)


def test_a_gradient_audit_refuses_an_unreadable_fsdp2_unit_in_its_own_name() -> None:
    param = SimpleNamespace(_unsharded_param=torch.zeros(2, 2, requires_grad=True))
    unit = _old_layout_unit(SimpleNamespace(fsdp_params=[param]))
    loss = unit(torch.ones(2)).sum()
    with pytest.raises(ShardedGraphError) as caught:
        gradient_report({"main": loss}, unit)
    assert str(caught.value) == (
        "gradient_report(): an FSDP2 parameter of FSDPLinear has no sharded parameter isolate "
        "can find; the audit refuses rather than guess"
    )


def test_gradient_invariance_of_a_sharded_parameter_no_module_passed_owns_is_refused() -> None:
    sharded = DTensor(torch.zeros(2))
    temporary = torch.zeros(2, requires_grad=True)  # what FSDP2 would put in the graph
    loss = (temporary * 2).sum()
    with pytest.raises(ShardedGraphError) as caught:
        gradient_invariance(loss, loss * 2, [sharded])
    assert str(caught.value).startswith(
        "gradient_invariance(): 1 of the parameters audited are sharded (DTensor), and no "
        "fully_shard unit passed owns them"
    )
