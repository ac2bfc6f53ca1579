"""stop_gradient / Detached / scale_gradient / GradientScale / clone / Cloned."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from isolate import (
    Cloned,
    Detached,
    GradientScale,
    InplaceModificationError,
    IsolationTypeError,
    WrappingError,
    clone,
    scale_gradient,
    stop_gradient,
)


class Model(nn.Module):
    """A trunk, a main head and an auxiliary branch; the branch is attached as given."""

    def __init__(self, aux: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.aux = aux

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.trunk(x)
        main = nn.functional.cross_entropy(self.head(features), y)
        aux = self.aux(features).pow(2).mean()
        return main, aux


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, generator=generator), torch.randint(0, 3, (32,), generator=generator)


def _trunk_grads(model: Model, with_aux: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    main, aux = model.losses(*_data())
    (main + aux if with_aux else main).backward()
    return [p.grad.clone() for p in model.trunk.parameters()]  # type: ignore[union-attr]


def test_detached_branch_leaves_trunk_gradients_bitwise_equal() -> None:
    model = Model(Detached(nn.Linear(16, 4)))
    reference = _trunk_grads(model, with_aux=False)
    combined = _trunk_grads(model, with_aux=True)
    assert all(torch.equal(a, b) for a, b in zip(reference, combined, strict=True))
    assert model.aux.module.weight.grad is not None
    assert model.aux.module.weight.grad.abs().sum() > 0  # the branch still learns


def test_plainly_attached_branch_changes_trunk_gradients() -> None:
    model = Model(nn.Linear(16, 4))  # the negative control
    reference = _trunk_grads(model, with_aux=False)
    combined = _trunk_grads(model, with_aux=True)
    delta = max((a - b).abs().max().item() for a, b in zip(reference, combined, strict=True))
    assert delta > 1e-4


def test_wrapping_does_not_change_forward_outputs() -> None:
    branch = nn.Sequential(nn.Linear(16, 4), nn.ReLU())
    x = torch.randn(5, 16)
    expected = branch(x)
    for wrapper in (Detached(branch), Cloned(branch)):
        assert torch.equal(wrapper(x), expected)
        assert list(wrapper.state_dict()) == list(branch.state_dict())
        assert [id(p) for p in wrapper.parameters()] == [id(p) for p in branch.parameters()]
        assert wrapper.unwrap() is branch


@dataclasses.dataclass(frozen=True)
class Features:
    low: torch.Tensor
    high: torch.Tensor
    tag: str = "f"


Pair = namedtuple("Pair", "left right")


def test_stop_gradient_keeps_nested_structure() -> None:
    a = torch.ones(2, requires_grad=True)
    tree = {
        "list": [a * 1, (a * 2, 7)],
        "pair": Pair(a * 3, None),
        "dc": Features(a * 4, a * 5),
        "od": OrderedDict(z=a * 6),
    }
    out = stop_gradient(tree)
    assert (
        type(out["pair"]) is Pair and type(out["dc"]) is Features and type(out["od"]) is OrderedDict
    )
    assert out["list"][1][1] == 7 and out["pair"].right is None and out["dc"].tag == "f"
    leaves = [
        out["list"][0],
        out["list"][1][0],
        out["pair"].left,
        out["dc"].low,
        out["dc"].high,
        out["od"]["z"],
    ]
    assert all(t.grad_fn is None and not t.requires_grad for t in leaves)
    assert [t.tolist() for t in leaves] == [[k, k] for k in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)]
    assert tree["dc"].low.requires_grad  # the input is not modified


def test_stop_gradient_rejects_non_tensors() -> None:
    with pytest.raises(
        IsolationTypeError, match=r"^stop_gradient\(\): expected a tensor .* got str"
    ):
        stop_gradient("features")
    with pytest.raises(IsolationTypeError, match=r"^clone\(\): expected a tensor .* got int"):
        clone(3)


class _EditKwarg(nn.Module):
    def forward(self, x: torch.Tensor, *, extra: torch.Tensor) -> torch.Tensor:
        extra.mul_(2)
        return x + extra


def test_guard_watches_keyword_and_nested_inputs() -> None:
    x, extra = torch.ones(3, requires_grad=True) * 1, torch.ones(3, requires_grad=True) * 1
    with pytest.raises(InplaceModificationError, match=r"edited input 1 \(shape \[3\]\) in place"):
        Detached(_EditKwarg())(x, extra=extra)


def test_guard_passes_out_of_place_branches_and_costs_no_copy() -> None:
    x = torch.randn(4, 16, requires_grad=True) * 1
    seen: list[int] = []

    class Probe(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            seen.append(t.data_ptr())
            return t.relu()

    Detached(Probe())(x)
    assert seen == [x.data_ptr()]  # the guard shares storage: no copy was made
    Detached(Probe(), inplace="copy")(x)
    assert seen[1] != x.data_ptr()


def test_guard_under_inference_mode_copies_instead() -> None:
    branch = Detached(nn.ReLU(inplace=True))
    with torch.inference_mode():
        x = torch.randn(6)
        kept = x.clone()
        branch(x)
    assert torch.equal(x, kept)


def test_detached_options_are_validated() -> None:
    with pytest.raises(IsolationTypeError, match=r"^Detached\(\): inplace='clone' is not a policy"):
        Detached(nn.ReLU(), inplace="clone")  # type: ignore[arg-type]
    branch = nn.ReLU()
    wrapper = Detached(branch)
    with pytest.raises(WrappingError, match=r"^Detached\(\): this ReLU is already wrapped"):
        Detached(branch)
    with pytest.raises(
        WrappingError, match=r"^Cloned\(\): the module is already wrapped in Detached"
    ):
        Cloned(wrapper)
    assert "inplace='error'" in repr(wrapper)


def test_cloned_branch_sends_gradient_back_and_keeps_the_source_intact() -> None:
    a = torch.tensor([-1.0, 2.0, -3.0], requires_grad=True)
    shared = a * 1
    out = Cloned(nn.ReLU(inplace=True))(shared)
    assert torch.equal(shared, torch.tensor([-1.0, 2.0, -3.0]))
    (shared.sum() + out.sum()).backward()
    assert torch.equal(a.grad, torch.tensor([1.0, 2.0, 1.0]))  # type: ignore[arg-type]


@pytest.mark.parametrize("alpha", [1.0, 0.5, -1.0, -2.5])
def test_scale_gradient_multiplies_the_gradient(alpha: float) -> None:
    a = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = scale_gradient(a.sigmoid(), alpha)
    assert torch.equal(out, a.sigmoid())
    out.sum().backward()
    reference = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    reference.sigmoid().sum().backward()
    torch.testing.assert_close(a.grad, alpha * reference.grad, rtol=1e-6, atol=0)  # type: ignore[operator]


def test_scale_gradient_zero_stops_the_gradient() -> None:
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    (scale_gradient(a * 2, 0.0).sum() + b.sum()).backward()
    assert a.grad is None and b.grad is not None


def test_gradient_scale_alpha_changes_during_training() -> None:
    layer = GradientScale(1.0)
    grads = []
    for alpha in (1.0, -1.0, 0.25):
        layer.alpha = alpha
        a = torch.ones(2, requires_grad=True)
        layer(a * 4).sum().backward()
        grads.append(a.grad.tolist())  # type: ignore[union-attr]
    assert grads == [[4.0, 4.0], [-4.0, -4.0], [1.0, 1.0]]
    assert not list(layer.state_dict())


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), "1", None, True])
def test_scale_gradient_rejects_bad_alpha(alpha: object) -> None:
    with pytest.raises(
        IsolationTypeError, match=r"^scale_gradient\(\): alpha must be a finite real"
    ):
        scale_gradient(torch.ones(1), alpha)  # type: ignore[arg-type]
    with pytest.raises(
        IsolationTypeError, match=r"^GradientScale\(\): alpha must be a finite real"
    ):
        GradientScale(alpha)  # type: ignore[arg-type]
