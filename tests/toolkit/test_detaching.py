"""stop_gradient / Detached / scale_gradient / GradientScale: cutting and scaling gradient,
and the guard that catches a branch editing its input in place (isolate's answer to the traps
of ``detach()`` pinned in tests/test_upstream_traps.py)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
from torch import nn

import isolate
import isolate.reachability
from isolate import Cloned, Detached, GradientScale, clone, scale_gradient, stop_gradient
from isolate.errors import InplaceModificationError, IsolationTypeError, WrappingError
from tests.toolkit._shared import ZeroInPlace


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


def _a() -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 3.0], requires_grad=True)


def test_stop_gradient_shares_storage_like_detach() -> None:
    # The trap is inherited on purpose (no copy per call); the Note of stop_gradient says so.
    out = _a().sigmoid()
    cut = isolate.stop_gradient(out)
    assert cut.data_ptr() == out.data_ptr() and cut.grad_fn is None and not cut.requires_grad


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


class _EditsBoth(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.zero_()
        b.mul_(2)
        return a + 1


def test_the_guard_lists_every_edited_input() -> None:
    a = torch.ones(2, requires_grad=True) * 1
    b = torch.ones(3, requires_grad=True) * 1
    with pytest.raises(
        isolate.errors.InplaceModificationError,
        match=r"^Detached\(_EditsBoth\): the branch edited input 0 \(shape \[2\]\), "
        r"input 1 \(shape \[3\]\) in place; ",
    ):
        isolate.Detached(_EditsBoth())(a, b)


def test_the_guard_catches_the_edit_first_and_names_the_branch() -> None:
    a = _a()
    out = a.sigmoid()
    kept = out.detach().clone()
    branch = Detached(ZeroInPlace(), name="probe")
    with pytest.raises(InplaceModificationError, match=r"^Detached\(probe\): .*in place") as info:
        branch(out)
    assert "Cloned" in str(info.value) and "inplace='copy'" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    # The guard reports the edit; it cannot undo it: the main values are zeros now.
    assert torch.equal(out, torch.zeros(3)) and not torch.equal(kept, torch.zeros(3))


def test_the_silent_case_is_caught_too() -> None:
    # AddBackward saves no input, so autograd never notices this edit (see
    # test_upstream_traps.py); the version-counter guard does.
    features = _a() * 1.0
    main = features + 1.0
    with pytest.raises(InplaceModificationError, match=r"^Detached\(ZeroInPlace\): "):
        Detached(ZeroInPlace())(features)
    assert main.grad_fn is not None


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


@pytest.mark.parametrize("alpha", [1.0, 0.5, -1.0, -2.0, -2.5])
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


def test_scale_gradient_takes_a_one_element_tensor_and_refuses_a_longer_one() -> None:
    x = torch.ones(2, requires_grad=True)
    isolate.scale_gradient(x * 1, torch.tensor(-0.5)).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), -0.5))  # type: ignore[arg-type]
    with pytest.raises(
        IsolationTypeError,
        match=r"^scale_gradient\(\): alpha must be a finite real number, "
        r"got tensor\(\[1\., 2\.\]\)",
    ):
        isolate.scale_gradient(x, torch.tensor([1.0, 2.0]))  # type: ignore[arg-type]
    with pytest.raises(IsolationTypeError, match=r"^scale_gradient\(\): expected a tensor"):
        isolate.scale_gradient("x", 1.0)


# An in-place op right after the scale: autograd must not see the scale's output edited.


# Powers of two, so that alpha * grad is exact and the gradients can be compared bitwise.
@pytest.mark.parametrize("alpha", [1.0, -0.5, 4.0, 0.0])
def test_gradient_scale_followed_by_an_inplace_op(alpha: float) -> None:
    torch.manual_seed(0)
    trunk = nn.Linear(4, 4)
    x = torch.randn(6, 4)
    head = nn.Sequential(GradientScale(alpha), nn.ReLU(inplace=True), nn.Linear(4, 1))
    reference_head = nn.Sequential(nn.ReLU(), head[2])
    reference_head(trunk(x)).sum().backward()
    reference = [p.grad.clone() for p in trunk.parameters()]  # type: ignore[union-attr]
    expected_out = reference_head(trunk(x))
    trunk.zero_grad(set_to_none=True)
    out = head(trunk(x))
    assert torch.equal(out, expected_out)  # the in-place ReLU ran
    out.sum().backward()
    if alpha == 0.0:
        assert all(p.grad is None for p in trunk.parameters())  # a real cut
        assert isolate.reachability.reachable_parameters(head(trunk(x)).sum(), trunk) == ()
    else:
        grads = [p.grad for p in trunk.parameters()]
        assert all(
            torch.equal(g, alpha * r)  # type: ignore[arg-type]
            for g, r in zip(grads, reference, strict=True)
        )


def test_gradient_scale_never_writes_into_a_parameter() -> None:
    weight = nn.Parameter(torch.tensor([-1.0, 2.0, -3.0]))
    out = scale_gradient(weight, 2.0).relu_()  # a leaf: the scale hands out a copy
    assert torch.equal(weight.detach(), torch.tensor([-1.0, 2.0, -3.0]))
    out.sum().backward()
    assert torch.equal(weight.grad, torch.tensor([0.0, 2.0, 0.0]))  # type: ignore[arg-type]


def test_gradient_scale_output_aliases_its_input_like_identity() -> None:
    h = torch.tensor([-1.0, 2.0], requires_grad=True) * 1
    out = scale_gradient(h, -1.0)
    assert out.data_ptr() == h.data_ptr() and out._version == h._version
    saved = h.exp()  # exp saves its output, not h: the edit below is legal and shared
    out.mul_(3)
    assert torch.equal(h, torch.tensor([-3.0, 6.0]))  # as nn.Identity() would
    assert saved.grad_fn is not None


# Per-sample gradients with torch.func (vmap of grad): the scale works under functorch.


@pytest.mark.parametrize("alpha", [1.0, -1.0, 0.25, 0.0])
def test_scale_gradient_under_vmap_of_grad(alpha: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    head = nn.Linear(4, 1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs, ys = torch.randn(5, 3), torch.randn(5, 1)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, a: float) -> Any:
        features = torch.func.functional_call(model, p, (x[None],))
        features = scale_gradient(features, a) if a != 1.0 else features
        return ((head(features) - y[None]) ** 2).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, None))
    scaled = per_sample(params, xs, ys, alpha)
    plain = per_sample(params, xs, ys, 1.0)
    for name in params:
        assert scaled[name].shape == (5, *params[name].shape)
        torch.testing.assert_close(scaled[name], alpha * plain[name], rtol=0, atol=0)
    layer = GradientScale(alpha)
    grads = torch.func.vmap(torch.func.grad(lambda t: (layer(t) ** 2).sum()))(xs)
    torch.testing.assert_close(grads, alpha * 2 * xs, rtol=0, atol=0)


def test_a_reversal_negates_every_gradient_exactly_even_an_infinite_complex_one() -> None:
    # A multiplication by -1 + 0j would turn an infinite component into NaN; a negation
    # keeps every value, so the reversed gradient is exactly the negated one.
    z = torch.zeros(2, dtype=torch.cfloat, requires_grad=True)
    upstream = torch.tensor([complex(1.0, float("inf")), complex(float("inf"), 2.0)])
    scale_gradient(z, -1.0).backward(upstream)
    assert torch.equal(z.grad, -upstream)  # type: ignore[arg-type]


class Holder:
    """A plain object keeping a tensor where no walk of containers reaches it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@pytest.mark.parametrize(
    ("call", "caller"),
    [
        (lambda h: Detached(nn.Identity())(torch.ones(1), extra=[h]), r"Detached\(Identity\)"),
        (lambda h: Cloned(nn.Identity())(torch.ones(1), extra=[h]), r"Cloned\(Identity\)"),
        (lambda h: scale_gradient([h], 0.0), r"scale_gradient\(\)"),
        (lambda h: GradientScale(0.0)([h]), r"GradientScale\(\)"),
        (lambda h: GradientScale(0.5)([h]), r"GradientScale\(\)"),
    ],
)
def test_a_tensor_out_of_reach_inside_a_container_is_refused_in_the_callers_name(
    call: Any, caller: str
) -> None:
    held = Holder(torch.ones(2, requires_grad=True))
    with pytest.raises(IsolationTypeError, match=rf"^{caller}: cannot see into .*Holder"):
        call(held)
