"""The ``reversal`` contract's numeric clause (``isolate.spec.reversal``): the gradient at the
features' output against ``-scale`` times the gradient at the classifier's input, to within a
few roundings of the gradients compared, whatever the features return, however small the
gradients; and what it says when the two sides cannot be paired or the factor is no number."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import isolate
from isolate.errors import BlindSpotError, SelectorError
from isolate.spec import IsolationSpec

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def reversal(scale: float = 0.3, classifier: str = "domain.1") -> dict[str, object]:
    return {
        "kind": "reversal",
        "loss": "domain",
        "features": "features",
        "classifier": classifier,
        "scale": scale,
    }


def dann(*layers: nn.Module, dtype: torch.dtype = torch.float32) -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {"features": nn.Linear(4, 4, dtype=dtype), "domain": nn.Sequential(*layers)}
    )


def check(
    model: nn.ModuleDict, contract: dict[str, object], loss_of: object
) -> tuple[dict[str, int], tuple[str, ...]]:
    """Record one forward of ``model`` and check ``contract`` on ``loss_of(features)``."""
    with IsolationSpec(contracts=[contract]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        dtype = next(model["features"].parameters()).dtype
        features = model["features"](torch.randn(8, 4, dtype=dtype))
        loss = loss_of(features)  # type: ignore[operator]
        verification = handle.verify({"domain": loss}, checks=["contracts"], on_violation="warn")
    return verification.contracts, verification.violations


def cross_entropy(model: nn.ModuleDict, factor: float = 1.0) -> object:
    return lambda f: factor * F.cross_entropy(model["domain"](f), torch.arange(8) % 2)


class Features(nn.Module):
    """Features that return the batch's integer ids first, then the float features."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(len(x)), self.linear(x)


class Reverse(nn.Module):
    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.scale = isolate.GradientScale(alpha)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        ids, h = pair
        return ids, self.scale(h)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.linear(pair[1])


@pytest.mark.parametrize(("alpha", "named"), [(-0.3, None), (-0.31, "the scale differs")])
def test_a_reversal_after_an_integer_output_is_judged_at_its_gradients_precision(
    alpha: float, named: str | None
) -> None:
    """The tolerance was taken from the features' first output: an integer one made it 0, and a
    right reversal of scale 0.3 was reported 'is -0.3 times ..., expected -0.3'."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"features": Features(), "domain": nn.Sequential(Reverse(alpha), Classifier())}
    )
    counts, violations = check(model, reversal(), cross_entropy(model))
    assert counts == {"reversal:domain": 3}
    assert [v.rsplit("; ", 1)[1] for v in violations] == ([named] if named else [])


@pytest.mark.parametrize("k", [8, 18])
def test_a_reversal_is_held_to_eight_roundings_of_the_gradients_it_compares(k: int) -> None:
    """float64 gradients of exactly 1 at the classifier's input and -0.5 (1 + k eps) at the
    features: off by k/2 eps, against a tolerance of 8 eps (|a| + |b|) + eps max|b| = 8.5 eps."""
    eps = torch.finfo(torch.float64).eps
    model = dann(isolate.GradientScale(-0.5 * (1 + k * eps)), nn.Identity(), dtype=torch.float64)
    counts, violations = check(model, reversal(0.5), lambda f: model["domain"](f).sum())
    assert counts == {"reversal:domain": 3}
    if k == 8:
        assert violations == ()
    else:
        assert len(violations) == 1
        assert violations[0].endswith(
            "the gradient of loss 'domain' at the output of 'features' is -0.5 times its "
            "gradient at the input of 'domain.1', expected -0.5 (a reversal of scale 0.5); "
            "the scale differs"
        )


def test_a_wrong_scale_is_found_however_small_the_gradients() -> None:
    model = dann(isolate.GradientScale(-0.1), nn.Linear(4, 2))
    _, violations = check(model, reversal(), cross_entropy(model, 1e-9))
    assert len(violations) == 1 and "is -0.1 times" in violations[0]
    assert violations[0].endswith("expected -0.3 (a reversal of scale 0.3); the scale differs")


def test_a_loss_that_sends_back_only_zeros_finds_the_reversal_exact() -> None:
    model = dann(isolate.GradientScale(-0.3), nn.Linear(4, 2))
    assert check(model, reversal(), cross_entropy(model, 0.0)) == ({"reversal:domain": 3}, ())


def test_features_read_past_the_classifier_alone_are_named_with_no_factor() -> None:
    model = dann(isolate.GradientScale(-0.3), nn.Linear(4, 2))
    loss = cross_entropy(model, 0.0)
    _, violations = check(model, reversal(), lambda f: loss(f) + f.sum())  # type: ignore[operator]
    assert violations == (
        "IsolationSpec: at epoch 0, step 0, contract 'reversal:domain' (reversal) breaks its "
        "clause 'reversed at the features': the gradient of loss 'domain' at the output of "
        "'features' is +nan times its gradient at the input of 'domain.1', expected -0.3 (a "
        "reversal of scale 0.3); the scale differs",
    )


def test_a_second_forward_the_loss_does_not_use_counts_as_no_gradient() -> None:
    model = dann(isolate.GradientScale(-0.3), nn.Linear(4, 2))

    def loss_of(features: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy(model)(features)  # type: ignore[operator]
        model["domain"](model["features"](torch.randn(8, 4)))  # a metric's forward, not a loss
        return loss  # type: ignore[no-any-return]

    assert check(model, reversal(), loss_of) == ({"reversal:domain": 3}, ())


def test_sides_of_different_sizes_cannot_be_checked() -> None:
    class Half(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, :2]

    model = dann(isolate.GradientScale(-0.3), Half(), nn.Linear(2, 2))
    with IsolationSpec(contracts=[reversal(classifier="domain.2")]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        loss = F.cross_entropy(
            model["domain"](model["features"](torch.randn(8, 4))), torch.arange(8) % 2
        )
        with pytest.raises(BlindSpotError) as raised:
            handle.verify({"domain": loss}, checks=["contracts"])
    assert str(raised.value) == (
        "IsolationSpec: at epoch 0, step 0, contract 'reversal:domain' (reversal) cannot check "
        "its clause 'reversed at the features': the outputs of 'features' (32 numbers) and the "
        "inputs of 'domain.2' (16) cannot be paired element for element; name the modules on "
        "either side of the reversal"
    )


@pytest.mark.parametrize(
    ("scale", "alpha", "named"),
    [
        (10.0, 10.005, "the sign is wrong"),  # within a thousandth of +scale, relative
        (0.5, 0.5015, "the scale differs"),  # a small scale: within 0.001, absolute
        (1000.0, 1001.0, "the scale differs"),  # exactly a thousandth off is off
    ],
)
def test_a_sign_error_is_named_within_a_thousandth_of_plus_scale(
    scale: float, alpha: float, named: str
) -> None:
    model = dann(isolate.GradientScale(alpha), nn.Identity(), dtype=torch.float64)
    _, violations = check(model, reversal(scale), lambda f: model["domain"](f).sum())
    assert len(violations) == 1
    assert violations[0].endswith(
        f"expected {-scale:+.4g} (a reversal of scale {scale:g}); {named}"
    )


def test_a_loss_that_reaches_no_feature_parameter_is_named() -> None:
    model = dann(isolate.GradientScale(-0.3), nn.Linear(4, 2))
    _, violations = check(model, reversal(), lambda f: cross_entropy(model)(f.detach()))  # type: ignore[operator]
    assert violations == (
        "IsolationSpec: at epoch 0, step 0, contract 'reversal:domain' (reversal) breaks its "
        "clause 'reaches the features': loss 'domain' reaches no parameter of 'features'",
    )


@pytest.mark.parametrize(("side", "name"), [("features", "feature"), ("classifier", "domain.2")])
def test_a_side_that_is_no_submodule_is_refused_in_the_contract_s_name(
    side: str, name: str
) -> None:
    model = dann(isolate.GradientScale(-0.3), nn.Linear(4, 2))
    with pytest.raises(
        SelectorError,
        match=rf"^IsolationSpec\(contract 'reversal:domain'\): '{name}' is not a submodule of ",
    ):
        IsolationSpec(contracts=[{**reversal(), side: name}]).apply(model)


def test_a_forward_not_recorded_cannot_be_checked_and_names_the_features() -> None:
    model = dann(isolate.GradientScale(-0.3), nn.Linear(4, 2))
    with IsolationSpec(contracts=[reversal()]).applied(model) as handle:
        handle.step(epoch=0, step=0, record=False)
        loss = cross_entropy(model)(model["features"](torch.randn(8, 4)))  # type: ignore[operator]
        with pytest.raises(BlindSpotError) as raised:
            handle.verify({"domain": loss}, checks=["contracts"])
    assert str(raised.value).endswith(
        "cannot check its clause 'reversed at the features': 'features' did not run while the "
        "check recorded"
    )


class KeywordClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, *, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("scale", [0.3, 0.1])
def test_a_classifier_called_with_a_keyword_argument_is_checked(scale: float) -> None:
    model = dann(isolate.GradientScale(-scale), KeywordClassifier())
    with IsolationSpec(contracts=[reversal(classifier="domain.1")]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        h = model["domain"][0](model["features"](torch.randn(8, 4)))
        loss = F.cross_entropy(model["domain"][1](h=h), torch.arange(8) % 2)
        verification = handle.verify({"domain": loss}, checks=["contracts"], on_violation="warn")
    assert verification.contracts == {"reversal:domain": 3}
    assert verification.violations == (
        ()
        if scale == 0.3
        else (
            "IsolationSpec: at epoch 0, step 0, contract 'reversal:domain' (reversal) breaks "
            "its clause 'reversed at the features': the gradient of loss 'domain' at the output "
            "of 'features' is -0.1 times its gradient at the input of 'domain.1', expected -0.3 "
            "(a reversal of scale 0.3); the scale differs",
        )
    )


class ConjugateReverse(torch.autograd.Function):
    """Sends back ``-0.3`` times the conjugate: the real parts of a right reversal, the
    imaginary parts of no reversal at all."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return -0.3 * grad.conj()


class ComplexDomain(nn.Module):
    def __init__(self, conjugate: bool) -> None:
        super().__init__()
        self.conjugate = conjugate
        self.scale = isolate.GradientScale(-0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return ConjugateReverse.apply(h) if self.conjugate else self.scale(h)


class ComplexClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2, dtype=torch.cfloat)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h).abs()


@pytest.mark.parametrize("conjugate", [False, True])
def test_complex_gradients_are_compared_in_both_parts(conjugate: bool) -> None:
    """A reversal of complex features is judged on the real and the imaginary parts of its
    gradients (only the real part was compared, so a reversal that conjugates passed)."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "features": nn.Linear(4, 4, dtype=torch.cfloat),
            "domain": nn.Sequential(ComplexDomain(conjugate), ComplexClassifier()),
        }
    )
    counts, violations = check(model, reversal(), cross_entropy(model))
    assert counts == {"reversal:domain": 3}
    if not conjugate:
        assert violations == ()
    else:
        assert len(violations) == 1
        assert violations[0].endswith("(a reversal of scale 0.3); the scale differs")


class Ids(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).argmax(-1)


def test_sides_where_no_gradient_can_flow_cannot_be_checked() -> None:
    """Features that return only integer ids (the loss reaching their weights another way):
    nothing on either side carries a gradient (``torch.autograd.grad`` of no tensor crashed
    the check with a ``RuntimeError``)."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"features": Ids(), "domain": nn.Sequential(nn.Identity(), nn.Identity())}
    )

    with IsolationSpec(contracts=[reversal()]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        ids = model["domain"](model["features"](torch.randn(8, 4)))
        loss = ids.float().mean() + model["features"].linear.weight.sum()
        with pytest.raises(BlindSpotError) as error:
            handle.verify({"domain": loss}, checks=["contracts"])
    assert str(error.value) == (
        "IsolationSpec: at epoch 0, step 0, contract 'reversal:domain' (reversal) cannot check "
        "its clause 'reversed at the features': neither the outputs of 'features' nor the "
        "inputs of 'domain.1' carry a gradient (they are integer or were computed under "
        "no_grad); name the modules on either side of the reversal"
    )


class ReverseLayerF(torch.autograd.Function):
    """A gradient reversal written by hand, as DANN implementations do."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * -0.3


class HandReversal(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ReverseLayerF.apply(x)  # type: ignore[no-any-return]


def test_a_hand_written_reversal_on_every_route_past_the_classifier_cannot_be_checked() -> None:
    model = dann(HandReversal(), nn.Linear(4, 2), HandReversal())
    with IsolationSpec(contracts=[reversal()]).applied(model) as handle:
        handle.step(epoch=0, step=0)
        loss = F.cross_entropy(
            model["domain"](model["features"](torch.randn(8, 4))), torch.arange(8) % 2
        )
        with pytest.raises(BlindSpotError) as raised:
            handle.verify({"domain": loss}, checks=["contracts"])
    # brute force: the classifier's gradient is the unreversed one times -0.3
    features, labels = model["features"](torch.randn(8, 4)), torch.arange(8) % 2
    weight = model["domain"][1].weight
    (got,) = torch.autograd.grad(F.cross_entropy(model["domain"](features), labels), weight)
    plain = F.cross_entropy(model["domain"][1](features), labels)
    assert torch.allclose(got, -0.3 * torch.autograd.grad(plain, weight)[0])
    assert str(raised.value) == (
        "IsolationSpec: at epoch 0, step 0, contract 'reversal:domain' (reversal) cannot check "
        "its clause 'the classifier gets it unreversed': every route from loss 'domain' to the "
        "output of 'domain.1' passes ['ReverseLayerFBackward'], a custom autograd Function "
        "whose backward isolate cannot read: it may reverse the gradient the classifier gets; "
        "reverse with isolate.GradientScale or isolate.scale_gradient, which the check reads"
    )


def test_a_hand_written_reversal_before_the_classifier_alone_holds() -> None:
    model = dann(HandReversal(), nn.Linear(4, 2))
    assert check(model, reversal(), cross_entropy(model)) == ({"reversal:domain": 3}, ())
