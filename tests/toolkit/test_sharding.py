"""Seeing through wrapped and sharded models, in one process: a wrapper whose graph leaves stand
for its parameters but cannot be mapped to them is refused (never a vacuous pass), and foreign
leaves that stand for nothing are ordinary. Sharded runs on 2 processes are in
tests/distributed/test_fsdp.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import isolate
import isolate.errors
import isolate.reachability
from isolate.errors import ShardedGraphError
from isolate.reachability import walk


class FlatViews(nn.Module):
    """A toy wrapper that runs its module on views of one hidden flat leaf, as FSDP1 and
    flat-buffer optimizers do: the registered parameters share the leaf's storage but are
    never in the graph."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        object.__setattr__(self, "_hidden", nn.Parameter(flat))  # a leaf, not registered
        offset = 0
        self._slices: dict[str, tuple[int, torch.Size]] = {}
        for name, p in module.named_parameters():
            p.data = flat[offset : offset + p.numel()].view_as(p)
            self._slices[name] = (offset, p.shape)
            offset += p.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat: torch.Tensor = object.__getattribute__(self, "_hidden")
        views = {n: flat[o : o + s.numel()].view(s) for n, (o, s) in self._slices.items()}
        return functional_call(self.module, views, (x,))  # type: ignore[no-any-return]


def test_wrapper_with_hidden_leaves_is_refused() -> None:
    model = FlatViews(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)))
    loss = model(torch.randn(2, 3)).sum()
    # Negative control: the walk finds none of the registered parameters; without the
    # refusal, "()" and a passing assert_isolated are a vacuous proof.
    found = walk([loss], "raw")
    assert not any(id(p) in found.leaves for p in model.parameters())
    with pytest.raises(ShardedGraphError, match=r"^reachable_parameters\(\): the graph's leaves"):
        isolate.reachability.reachable_parameters(loss, model)
    with pytest.raises(ShardedGraphError, match=r"^assert_isolated\(\): the graph's leaves"):
        isolate.assert_isolated(loss, model.module[0], model=model)
    with pytest.raises(ShardedGraphError, match=r"^gradient_report\(\): "):
        isolate.gradient_report({"main": loss}, model)
    assert issubclass(ShardedGraphError, isolate.errors.BlindSpotError)


def test_foreign_leaves_that_stand_for_nothing_are_fine() -> None:
    # Another model's parameters and inputs that require grad are ordinary foreign leaves.
    encoder, head = nn.Linear(3, 3), nn.Linear(3, 1)
    x = torch.randn(2, 3, requires_grad=True)
    loss = head(encoder(x).detach() + x).sum()
    assert isolate.reachability.reachable_parameters(loss, encoder) == ()
    isolate.assert_isolated(loss, encoder)
    assert isolate.reachability.reachable_parameters(loss, head) == ("weight", "bias")
