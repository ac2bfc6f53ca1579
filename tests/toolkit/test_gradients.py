"""gradient_report and gradient_invariance in every precision, with sparse gradients, and
what the report says when a value is undefined: each number against a float64 reference
computed by hand from the same gradients."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import isolate
from isolate import assert_isolated, freeze, gradient_report
from isolate.cutoff import cut_off_parameters
from isolate.errors import (
    BlindSpotError,
    GradientLeakError,
    IsolationTypeError,
    SelectorError,
    ShardedGraphError,
)
from isolate.gradients import GradientReport, gradient_invariance
from isolate.reachability import reachable_parameters
from tests.toolkit._shared import Net, TanhOnce, X

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(
    losses: dict[str, torch.Tensor], groups: dict[str, list[nn.Parameter]]
) -> dict[str, dict[str, object]]:
    """Norms, shares and cosines per group, from autograd.grad, all arithmetic in float64."""
    everything = list({id(p): p for ps in groups.values() for p in ps}.values())
    flat: dict[str, dict[int, torch.Tensor | None]] = {}
    for name, loss in losses.items():
        grads = torch.autograd.grad(loss, everything, retain_graph=True, allow_unused=True)
        flat[name] = {
            id(p): None if g is None else g.to_dense().double().flatten()
            for p, g in zip(everything, grads, strict=True)
        }
    totals = {
        name: sum(float(g @ g) for g in flat[name].values() if g is not None) for name in losses
    }
    out: dict[str, dict[str, object]] = {}
    for group, params in groups.items():
        norms: dict[str, float | None] = {}
        vectors: dict[str, torch.Tensor] = {}
        for name in losses:
            gs = [flat[name][id(p)] for p in params]
            if all(g is None for g in gs):
                norms[name] = None
                continue
            vectors[name] = torch.cat(
                [torch.zeros(p.numel(), dtype=torch.float64) if g is None else g
                 for p, g in zip(params, gs, strict=True)]
            )  # fmt: skip
            norms[name] = float(vectors[name].norm())
        shares = {n: None if v is None else v**2 / totals[n] for n, v in norms.items()}
        names = list(losses)
        cosines: dict[tuple[str, str], float | None] = {}
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                shared = any(
                    flat[a][id(p)] is not None and flat[b][id(p)] is not None for p in params
                )
                na, nb = norms[a], norms[b]
                cosines[(a, b)] = (
                    float(vectors[a] @ vectors[b]) / (na * nb) if shared and na and nb else None
                )
        out[group] = {"norms": norms, "shares": shares, "cosines": cosines}
    return out


def assert_matches(report: GradientReport, expected: dict[str, dict[str, object]], rel: float):
    for group, values in expected.items():
        stats = report.total if group == "total" else report[group]
        for field in ("norms", "shares", "cosines"):
            got, want = getattr(stats, field), values[field]
            assert set(got) == set(want)  # type: ignore[arg-type]
            for key, w in want.items():  # type: ignore[attr-defined]
                if w is None:
                    assert got[key] is None, (group, field, key)
                else:
                    assert got[key] == pytest.approx(w, rel=rel, abs=1e-12), (group, field, key)


class ThreeLosses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)
        self.probe = nn.Linear(16, 2)

    def losses(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.encoder(x)
        return {
            "main": self.head(features).pow(2).mean(),
            "probe": self.probe(features.detach()).pow(2).mean(),
            "both": self.head(features).mean() + self.probe(features).mean(),
        }


def groups_of(net: ThreeLosses) -> dict[str, list[nn.Parameter]]:
    return {
        "encoder": list(net.encoder.parameters()),
        "head": list(net.head.parameters()),
        "probe": list(net.probe.parameters()),
        "total": list(net.parameters()),
    }


PRECISIONS: dict[str, tuple[torch.dtype, Callable[[], object]]] = {
    "fp32": (torch.float32, lambda: torch.autocast("cpu", enabled=False)),
    "fp16": (torch.float16, lambda: torch.autocast("cpu", enabled=False)),
    "bf16": (torch.bfloat16, lambda: torch.autocast("cpu", enabled=False)),
    "fp64": (torch.float64, lambda: torch.autocast("cpu", enabled=False)),
    "autocast-bf16": (torch.float32, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_report_matches_a_float64_reference_in_every_precision(precision: str) -> None:
    dtype, context = PRECISIONS[precision]
    torch.manual_seed(0)
    net = ThreeLosses().to(dtype)
    x = torch.randn(8, 6, dtype=dtype)
    with context():  # type: ignore[attr-defined]
        losses = net.losses(x)
    if precision == "autocast-bf16":
        assert net.head(net.encoder(x)).dtype == torch.float32  # outside: fp32 again
    report = gradient_report(
        losses, net, groups={"encoder": "encoder", "head": "head", "probe": "probe"}
    )
    # Gradients in half precision are widened exactly; only the float32 sums round.
    assert_matches(report, reference(losses, groups_of(net)), rel=1e-5)
    assert report["probe"].norms["main"] is None
    assert report["encoder"].cosines[("main", "probe")] is None  # probe never reaches it


def test_a_half_precision_norm_beyond_the_half_range_is_not_inf() -> None:
    """Norms are summed in float32 or wider: 2048^2 + 64^2 + 1 = 2049^2 overflows float16
    (max 65504), yet the norm itself fits."""
    p = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    model = nn.ParameterDict({"p": p})
    loss = (p * torch.tensor([2048.0, 64.0, 1.0], dtype=torch.float16)).sum()
    (grad,) = torch.autograd.grad(loss, p, retain_graph=True)
    assert grad.dtype == torch.float16 and torch.isinf(grad @ grad)  # the trap
    report = gradient_report({"loss": loss, "twice": 2 * loss}, model)
    assert report.total.norms == {"loss": 2049.0, "twice": 4098.0}  # exact
    assert report.total.cosines[("loss", "twice")] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_of_squares_beyond_the_float32_range_are_redone_in_float64(
    dtype: torch.dtype,
) -> None:

    p = nn.Parameter(torch.zeros(4, dtype=dtype))
    loss = (p * torch.full((4,), 1e25, dtype=dtype)).sum()
    (grad,) = torch.autograd.grad(loss, p, retain_graph=True)
    assert torch.isinf(grad.float() @ grad.float())  # float32 cannot hold (1e25)^2
    report = gradient_report({"loss": loss}, nn.ParameterDict({"p": p}))
    expected = float(grad.double().norm())
    assert report.total.norms["loss"] == pytest.approx(expected, rel=1e-12)
    assert report.total.shares["loss"] == pytest.approx(1.0)


def test_an_inf_gradient_is_reported_as_inf() -> None:
    p = nn.Parameter(torch.ones(2))
    loss = (p * torch.tensor([math.inf, 1.0])).sum()
    report = gradient_report({"loss": loss}, nn.ParameterDict({"p": p}))
    assert report.total.norms["loss"] == math.inf


# --------------------------------------------------------------------------------------------
# Sparse gradients (an embedding with sparse=True): the same numbers as dense ones


class Bag(nn.Module):
    def __init__(self, *, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 4, sparse=sparse)
        self.head = nn.Linear(4, 1)

    def losses(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(tokens)  # repeated tokens: a sparse gradient with duplicate indices
        return {"main": self.head(h).pow(2).mean(), "aux": h.pow(3).mean()}


TOKENS = torch.tensor([[1, 2, 2, 7], [7, 7, 3, 1]])


def test_report_with_sparse_gradients_equals_the_dense_one() -> None:
    sparse, dense = Bag(sparse=True), Bag(sparse=False)
    losses_s, losses_d = sparse.losses(TOKENS), dense.losses(TOKENS)
    (g,) = torch.autograd.grad(losses_s["main"], sparse.embed.weight, retain_graph=True)
    assert g.is_sparse
    report_s = gradient_report(losses_s, sparse)
    report_d = gradient_report(losses_d, dense)
    _close(report_s, report_d)
    groups = {"embed": list(sparse.embed.parameters()), "head": list(sparse.head.parameters())}
    groups["total"] = list(sparse.parameters())
    assert_matches(report_s, reference(losses_s, groups), rel=1e-6)


def _close(a: GradientReport, b: GradientReport) -> None:
    for name in [*a.groups, "total"]:
        sa, sb = (a.total, b.total) if name == "total" else (a[name], b[name])
        for field in ("norms", "shares", "cosines"):
            for key, value in getattr(sa, field).items():
                other = getattr(sb, field)[key]
                assert (value is None) == (other is None)
                if value is not None:
                    assert value == pytest.approx(other, rel=1e-6)


def test_invariance_with_sparse_gradients() -> None:
    bag = Bag(sparse=True)
    h = bag.embed(TOKENS)
    main = bag.head(h.detach()).sum() + h.sum()
    isolated = gradient_invariance(main, main + bag.head(h.detach()).pow(2).sum(), bag.embed)
    assert isolated.isolated and isolated.deltas == {"weight": 0.0}
    leak = h.pow(2).sum()
    result = gradient_invariance(main, main + leak, bag.embed)
    (g,) = torch.autograd.grad(leak, bag.embed.weight, retain_graph=True)
    assert result.max_delta == pytest.approx(float(g.to_dense().abs().max()), rel=1e-6)


def test_report_on_complex_parameters_measures_both_parts_of_each_gradient() -> None:
    """A complex gradient is a vector of twice as many reals: |g|^2 sums |g_i|^2 and the
    cosine is that of the real vectors, never above 1."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, dtype=torch.cfloat))
    model = nn.ParameterDict({"p": p, "q": nn.Parameter(torch.randn(2))})
    z = torch.randn(4, dtype=torch.cfloat)
    losses = {
        "a": (p * z).abs().sum() + model["q"].sum(),
        "b": (p.conj() * p).real.sum() + (p * 1j).real.sum(),
        "c": p.conj().sum().real,
    }
    a, b, c = (torch.autograd.grad(loss, p, retain_graph=True)[0] for loss in losses.values())
    assert c.is_conj()  # a lazy conjugate, which view_as_real refuses unresolved
    ra, rb = (torch.view_as_real(g).double().flatten() for g in (a, b))
    report = gradient_report(losses, model, groups={"p": "p"})
    assert report["p"].norms == {
        "a": pytest.approx(float(ra.norm()), rel=1e-6),
        "b": pytest.approx(float(rb.norm()), rel=1e-6),
        "c": 2.0,  # |1| in each of 4 places
    }
    cosine = float(ra @ rb) / float(ra.norm() * rb.norm())
    assert report["p"].cosines[("a", "b")] == pytest.approx(cosine, rel=1e-6)
    assert report["p"].shares["a"] == pytest.approx(float(ra @ ra) / (float(ra @ ra) + 2.0))
    assert report["p"].shares["b"] == 1.0


# --------------------------------------------------------------------------------------------
# Undefined cosines and frozen groups: what the report says when a value does not exist


def test_cosine_of_losses_that_share_no_parameter_is_undefined() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 1), "b": nn.Linear(3, 1)})
    x = torch.randn(4, 3)
    losses = {"a": model["a"](x).sum(), "b": model["b"](x).sum()}
    report = gradient_report(losses, model)
    assert report.total.cosines[("a", "b")] is None
    assert str(report).splitlines()[-1].split()[-1] == "-"
    # Sharing one parameter makes it defined, and it is the plain cosine of the vectors.
    shared = {"a": losses["a"], "ab": model["a"].bias.sum() + losses["b"]}
    cosine = gradient_report(shared, model).total.cosines[("a", "ab")]
    four = torch.full((1,), 4.0)  # d(sum over 4 rows)/d(bias)
    g_a = torch.cat([x.sum(0), four, torch.zeros(4)]).double()
    g_ab = torch.cat([torch.zeros(3), torch.ones(1), x.sum(0), four]).double()
    assert cosine == pytest.approx(float(g_a @ g_ab / (g_a.norm() * g_ab.norm())), rel=1e-6)


def test_a_frozen_group_reads_as_frozen_not_empty() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"trunk": nn.Linear(3, 4), "head": nn.Linear(4, 1)})
    handle = freeze(model, "trunk")
    try:
        loss = model["head"](model["trunk"](torch.randn(2, 3))).sum()
        report = gradient_report({"main": loss}, model)
        assert list(report.groups) == ["trunk", "head"]
        trunk = report["trunk"]
        assert trunk.numel == 0 and trunk.frozen_numel == 16 and trunk.parameters == ()
        assert trunk.frozen == ("trunk.weight", "trunk.bias")
        assert trunk.size == "frozen (16)" and report["head"].size == "5"
        assert report.total.size == "5 (+16 frozen)"
        rows = {line.split()[0]: line for line in str(report).splitlines()}
        assert rows["trunk"].split()[1:4] == ["frozen", "(16)", "-"]
        data = json.loads(report.to_json())
        assert data["groups"]["trunk"]["frozen"] == ["trunk.weight", "trunk.bias"]
        assert data["groups"]["trunk"]["frozen_numel"] == 16
        by_name = gradient_report({"main": loss}, model, groups=["trunk"])
        assert by_name["trunk"].size == "frozen (16)" and list(by_name.groups) == [
            "trunk",
            "(rest)",
        ]
    finally:
        handle.restore()


# --------------------------------------------------------------------------------------------
# gradient_invariance and the graph audits in every precision


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_invariance_matches_a_float64_reference_in_every_precision(precision: str) -> None:
    dtype, context = PRECISIONS[precision]
    torch.manual_seed(0)
    net = ThreeLosses().to(dtype)
    with context():  # type: ignore[attr-defined]
        features = net.encoder(torch.randn(8, 6, dtype=dtype))
        main = net.head(features).pow(2).mean()
        isolated = main + net.probe(features.detach()).pow(2).mean()
        leaky = main + net.probe(features).pow(2).mean()
    assert gradient_invariance(main, isolated, net.encoder).max_delta == 0.0
    result = gradient_invariance(main, leaky, net.encoder)
    params = list(net.encoder.parameters())
    before = torch.autograd.grad(main, params, retain_graph=True)
    after = torch.autograd.grad(leaky, params, retain_graph=True)
    names = [n for n, _ in net.encoder.named_parameters()]
    for name, b, a in zip(names, before, after, strict=True):
        expected = float((a.double() - b.double()).abs().max())
        assert result.deltas[name] == expected  # exact: differences of the same numbers
    assert result.max_delta > 0


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_graph_audits_in_every_precision(precision: str) -> None:
    dtype, context = PRECISIONS[precision]
    torch.manual_seed(0)
    net = ThreeLosses().to(dtype)
    with context():  # type: ignore[attr-defined]
        losses = net.losses(torch.randn(8, 6, dtype=dtype))
    assert reachable_parameters(losses["probe"], net) == ("probe.weight", "probe.bias")
    assert_isolated(losses["probe"], net.encoder)
    cut = cut_off_parameters(losses["main"], net)
    assert list(cut.parameters) == ["probe.weight", "probe.bias"]
    assert cut_off_parameters(list(losses.values()), net).clean


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


# --------------------------------------------------------------------------------------------
# gradient_report on a small model, against autograd.grad


def _flat_grads(loss: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    return list(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))


def test_report_values_match_a_direct_computation(net: Net) -> None:
    main, probe = net(X)
    losses = {"main": main.pow(2).mean(), "probe": probe.pow(2).mean()}
    report = gradient_report(losses, net)
    assert isinstance(report, GradientReport)
    assert list(report.groups) == ["(root)", "encoder", "head", "probe"]
    assert report.losses == ("main", "probe")
    enc = list(net.encoder.parameters())
    g_main = _flat_grads(losses["main"], enc)
    expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in g_main if g is not None))
    assert report["encoder"].norms["main"] == pytest.approx(expected, rel=1e-6)
    assert report["encoder"].norms["probe"] is None  # no path at all
    assert report["encoder"].shares["probe"] is None
    assert report["probe"].norms["main"] is None
    assert report["probe"].shares["probe"] == pytest.approx(1.0)
    shares = [s.shares["main"] for s in report.groups.values() if s.shares["main"] is not None]
    assert sum(shares) == pytest.approx(1.0)
    assert report.total.numel == sum(p.numel() for p in net.parameters())
    assert report["encoder"].parameters == tuple(
        f"encoder.{n}" for n, _ in net.encoder.named_parameters()
    )
    assert report["head"].cosines[("main", "probe")] is None
    # The two losses share no parameter: their cosine is undefined, not 0.
    assert report.total.cosines[("main", "probe")] is None


def test_report_cosines(net: Net) -> None:
    main, _ = net(X)
    base = main.pow(2).mean()
    report = gradient_report({"a": base, "twice": 2 * base, "minus": -base}, net)
    enc = report["encoder"].cosines
    assert enc[("a", "twice")] == pytest.approx(1.0)
    assert enc[("a", "minus")] == pytest.approx(-1.0)
    assert report["encoder"].norms["twice"] == pytest.approx(2 * report["encoder"].norms["a"])


def test_report_touches_no_grad_and_keeps_the_graph(net: Net) -> None:
    main, probe = net(X)
    loss = main.sum() + probe.sum()
    for p in net.parameters():
        p.grad = torch.full_like(p, 7.0)
    gradient_report({"loss": loss}, net)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in net.parameters())
    loss.backward()  # the graph is still there


def test_report_groups_by_selector(net: Net) -> None:
    main, probe = net(X)
    losses = {"main": main.sum(), "probe": probe.sum()}
    by_list = gradient_report(losses, net, groups=["encoder", "*.bias"])
    assert list(by_list.groups) == ["encoder", "*.bias", "(rest)"]
    assert by_list["*.bias"].parameters == (
        "encoder.0.bias",
        "encoder.2.bias",
        "head.bias",
        "probe.bias",
    )
    assert by_list["(rest)"].parameters == ("scale", "head.weight", "probe.weight")
    by_map = gradient_report(
        losses, net, groups={"trunk": ["encoder.0", "encoder.2"], "top": "head"}
    )
    assert by_map["trunk"].parameters == by_list["encoder"].parameters
    assert by_map["top"].norms["probe"] is None
    with pytest.raises(SelectorError, match=r"^gradient_report\(\): 'decoder' matched no"):
        gradient_report(losses, net, groups=["decoder"])


def test_report_prints_an_aligned_table_and_converts(net: Net) -> None:
    main, probe = net(X)
    report = gradient_report({"main": main.sum(), "probe": probe.sum()}, net)
    lines = str(report).splitlines()
    assert lines[0].split() == [
        "group",
        "params",
        "|g|",
        "main",
        "share",
        "main",
        "|g|",
        "probe",
        "share",
        "probe",
        "cos(main,probe)",
    ]
    assert len({len(line) for line in lines}) == 1  # every row as wide as the header
    assert [line.split()[0] for line in lines if not line.startswith("-")] == [
        "group",
        "(root)",
        "encoder",
        "head",
        "probe",
        "total",
    ]
    probe_row = next(line for line in lines if line.startswith("probe"))
    assert probe_row.split()[2] == "-"  # main does not reach the probe: no norm at all
    data = json.loads(report.to_json())
    assert data == report.to_dict()
    assert data["groups"]["encoder"]["norm"]["probe"] is None
    assert data["groups"]["encoder"]["cosine"] == {"main|probe": None}
    assert data["total"]["numel"] == report.total.numel


def test_report_of_a_loss_without_graph(net: Net) -> None:
    main, _ = net(X)
    report = gradient_report({"main": main.sum(), "constant": torch.tensor(3.0)}, net)
    assert report.total.norms["constant"] is None
    assert report.total.shares["constant"] is None
    assert report.total.cosines[("main", "constant")] is None
    grads = _flat_grads(main.sum(), list(net.parameters()))
    by_hand = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    assert report.total.norms["main"] == pytest.approx(by_hand, rel=1e-6)
    assert report.total.shares["main"] == 1.0


@pytest.mark.parametrize(
    ("losses", "groups", "message"),
    [
        ({"a": torch.ones(3, requires_grad=True)}, None, r"loss 'a' must be a scalar .*\(3,\)"),
        ({}, None, r"losses must be a non-empty mapping"),
        ([torch.ones(())], None, r"losses must be a non-empty mapping"),
        ({"a": 1.0}, None, r"loss 'a' must be a scalar tensor, got float"),
        ({"a": torch.ones(())}, 3, r"groups must be None"),
        ({"a": torch.ones(())}, [nn.Linear(1, 1)], r"a list of groups must hold selector strings"),
    ],
)
def test_report_errors(net: Net, losses: Any, groups: Any, message: str) -> None:
    with pytest.raises(IsolationTypeError, match=r"^gradient_report\(\): " + message):
        gradient_report(losses, net, groups=groups)


# --------------------------------------------------------------------------------------------
# gradient_invariance


def test_invariance_is_exactly_zero_when_isolated(net: Net) -> None:
    main, probe = net(X)
    main_loss = main.pow(2).mean()
    total = main_loss + 0.3 * probe.pow(2).mean()
    result = gradient_invariance(main_loss, total, net.encoder, model=net)
    assert result.max_delta == 0.0
    assert result.isolated
    assert result.deltas == dict.fromkeys(
        ("encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"), 0.0
    )
    assert result.changed() == {}


def test_invariance_measures_a_leak(net: Net) -> None:
    features = net.encoder(X)
    main_loss = net.head(features).pow(2).mean()
    aux = net.probe(features).pow(2).mean()
    result = gradient_invariance(main_loss, main_loss + aux, net.encoder, model=net)
    assert not result.isolated
    aux_grad = torch.autograd.grad(aux, net.encoder[2].bias, retain_graph=True)[0]
    assert result.deltas["encoder.2.bias"] == pytest.approx(float(aux_grad.abs().max()), rel=1e-5)
    assert result.max_delta == max(result.deltas.values())
    assert list(result.changed()) == sorted(result.deltas, key=lambda n: -result.deltas[n])


def test_invariance_on_a_parameter_only_the_aux_loss_reaches(net: Net) -> None:
    main, probe = net(X)
    main_loss = main.sum()
    result = gradient_invariance(main_loss, main_loss + probe.sum(), net.probe.bias)
    assert result.max_delta == float(torch.full((3,), 5.0).max())  # d(sum)/d(bias) = batch size
    frozen = gradient_invariance(main_loss, main_loss, net.encoder.requires_grad_(False))
    assert frozen.max_delta == 0.0 and len(frozen.deltas) == 4


def test_invariance_note_main_loss_must_have_weight_one(net: Net) -> None:
    main, _ = net(X)
    main_loss = main.pow(2).mean()
    assert gradient_invariance(main_loss, 0.5 * main_loss, net.encoder).max_delta > 0


def test_invariance_errors(net: Net) -> None:
    main, _ = net(X)
    with pytest.raises(IsolationTypeError, match=r"^gradient_invariance\(\): main_loss must be"):
        gradient_invariance(main, main.sum(), net)
    with pytest.raises(IsolationTypeError, match=r"^gradient_invariance\(\): total_loss must be"):
        gradient_invariance(main.sum(), 1.0, net)  # type: ignore[arg-type]


def test_gradient_report_refuses_group_names_that_are_not_strings() -> None:
    model = nn.Linear(2, 1)
    loss = model(torch.ones(1, 2)).sum()
    with pytest.raises(
        IsolationTypeError, match=r"^gradient_report\(\): group names must be strings, got 1$"
    ):
        isolate.gradient_report({"main": loss}, model, groups={1: "weight"})  # type: ignore[dict-item]


# --------------------------------------------------------------------------------------------
# The report as a table and as data, number for number


def _exact_report() -> GradientReport:
    """Gradients 3 and 4 (main), -6 and 8 (aux) on two one-weight groups, a frozen third."""
    model = nn.ModuleDict(
        {
            "a": nn.Linear(1, 1, bias=False),
            "b": nn.Linear(1, 1, bias=False),
            "c": nn.Linear(2, 1, bias=False),
        }
    )
    model["c"].requires_grad_(False)
    a, b = model["a"].weight.sum(), model["b"].weight.sum()
    return gradient_report({"main": 3 * a + 4 * b, "aux": -6 * a + 8 * b}, model)


def test_the_table_shows_each_norm_share_and_signed_cosine() -> None:
    assert str(_exact_report()).splitlines() == [
        "group         params   |g| main  share main    |g| aux  share aux  cos(main,aux)",
        "-" * 80,
        "a                  1  3.000e+00       36.0%  6.000e+00      36.0%         -1.000",
        "b                  1  4.000e+00       64.0%  8.000e+00      64.0%         +1.000",
        "c         frozen (2)          -           -          -          -              -",
        "-" * 80,
        "total  2 (+2 frozen)  5.000e+00      100.0%  1.000e+01     100.0%         +0.280",
    ]


def test_the_table_has_no_trailing_blanks_even_after_a_loss_name_ending_in_one() -> None:
    p = nn.Parameter(torch.ones(()))
    report = gradient_report({"main ": 2 * p}, nn.ParameterDict({"p": p}))
    lines = str(report).splitlines()
    assert lines[0] == "group   params  |g| main   share main"
    assert all(line == line.rstrip() for line in lines)


def test_the_report_as_data_keeps_every_field_and_its_json_is_indented_by_two() -> None:
    report = _exact_report()

    def group(params, frozen, norms, shares, cosine):  # type: ignore[no-untyped-def]
        return {
            "parameters": params,
            "numel": len(params),
            "frozen": frozen,
            "frozen_numel": 2 * len(frozen),
            "norm": dict(zip(("main", "aux"), norms, strict=True)),
            "share": dict(zip(("main", "aux"), shares, strict=True)),
            "cosine": {"main|aux": cosine},
        }

    expected = {
        "losses": ["main", "aux"],
        "groups": {
            "a": group(["a.weight"], [], (3.0, 6.0), (0.36, 0.36), -1.0),
            "b": group(["b.weight"], [], (4.0, 8.0), (0.64, 0.64), 1.0),
            "c": group([], ["c.weight"], (None, None), (None, None), None),
        },
        "total": group(["a.weight", "b.weight"], ["c.weight"], (5.0, 10.0), (1.0, 1.0), 0.28),
    }
    assert report.to_dict() == expected
    assert report.to_json() == json.dumps(expected, indent=2)
    assert report.to_json(indent=None) == json.dumps(expected)


def test_an_inf_gradient_leaves_its_share_and_cosine_undefined_as_nan_in_lower_case() -> None:
    p = nn.Parameter(torch.ones(2))
    loss = (p * torch.tensor([math.inf, 1.0])).sum()
    report = gradient_report({"loss": loss, "twice": 2 * loss}, nn.ParameterDict({"p": p}))
    assert math.isnan(report.total.cosines[("loss", "twice")])
    assert str(report).splitlines()[-1].split() == [
        "total",
        "2",
        "inf",
        "nan%",
        "inf",
        "nan%",
        "+nan",
    ]


def test_a_total_loss_that_leaves_out_the_main_loss_changes_its_gradients_by_all_of_them() -> None:
    weight = nn.Parameter(torch.tensor([1.0, -4.0]))
    main = (weight * torch.tensor([2.0, -3.0])).sum()  # gradient (2, -3)
    for total in (torch.tensor(0.0), nn.Parameter(torch.ones(())).sum()):  # no path to weight
        result = gradient_invariance(main, total, {"weight": weight})
        assert result.deltas == {"weight": 3.0} and not result.isolated


def test_invariance_refuses_a_wrapper_whose_graph_leaves_stand_for_its_parameters() -> None:
    """Without the refusal every gradient is None, every delta 0.0: a vacuous proof."""
    from tests.toolkit.test_sharding import FlatViews

    model = FlatViews(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)))
    main = model(torch.randn(2, 3)).sum()
    total = main + model(torch.randn(2, 3)).pow(2).sum()
    for protected, whole in ((model.module[0], None), ("module.0", model)):
        with pytest.raises(ShardedGraphError, match=r"^gradient_invariance\(\): the graph's"):
            gradient_invariance(main, total, protected, model=whole)


def test_invariance_names_the_shape_or_type_of_a_loss_that_is_no_scalar(net: Net) -> None:
    main, _ = net(X)
    with pytest.raises(
        IsolationTypeError,
        match=r"^gradient_invariance\(\): main_loss must be a scalar tensor, got shape \(5, 2\);",
    ):
        gradient_invariance(main, main.sum(), net)
    with pytest.raises(
        IsolationTypeError, match=r"total_loss must be a scalar tensor, got float; reduce it first"
    ):
        gradient_invariance(main.sum(), 1.0, net)  # type: ignore[arg-type]


def test_a_complex_scalar_loss_is_refused_by_the_report_and_the_invariance() -> None:
    """autograd differentiates real losses only; a complex one crashed inside torch."""
    p = nn.Parameter(torch.ones(3, dtype=torch.cfloat))
    model = nn.ParameterDict({"p": p})
    loss = (2 * p).sum()
    with pytest.raises(RuntimeError, match="only for real scalar outputs"):
        torch.autograd.grad(loss, p)  # the brute force
    with pytest.raises(
        IsolationTypeError,
        match=r"^gradient_report\(\): loss 'c' must be a real scalar tensor, got a complex64 "
        r"scalar; take its real part or its absolute value first \(e\.g\. \.abs\(\)\)$",
    ):
        gradient_report({"real": loss.real, "c": loss}, model)
    with pytest.raises(
        IsolationTypeError,
        match=r"^gradient_invariance\(\): total_loss must be a real scalar tensor, got a "
        r"complex64 scalar; take its real part or its absolute value first",
    ):
        gradient_invariance(loss.real, loss, model)
    norms = gradient_report({"abs": loss.abs()}, model).total.norms
    assert norms == {"abs": pytest.approx(2 * 3**0.5)}  # |2| in each of 3 places


def test_a_nan_delta_after_a_finite_one_makes_the_max_delta_nan() -> None:
    first, second = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    main = first.sum() + second.sum()
    aux = first.sum() + second.sum() * torch.tensor(math.nan)  # gradients 1 and NaN
    result = gradient_invariance(main, main + aux, {"first": first, "second": second})
    assert result.deltas["first"] == 1.0 and math.isnan(result.deltas["second"])
    assert math.isnan(result.max_delta) and not result.isolated


@pytest.mark.parametrize(
    ("dtype", "norm"),
    [(torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float64, math.sqrt(1 + 2**-24))],
)
def test_products_are_summed_in_float32_unless_the_gradients_are_wider(
    dtype: torch.dtype, norm: float
) -> None:
    """1 + 2**-24 rounds to 1 in float32: the cheap matmul is kept where it does not overflow
    (the float64 redo is for sums beyond the float32 range only)."""
    p = nn.Parameter(torch.zeros(2, dtype=dtype))
    loss = (p * torch.tensor([1.0, 2**-12], dtype=dtype)).sum()
    assert gradient_report({"loss": loss}, nn.ParameterDict({"p": p})).total.norms["loss"] == norm


def test_one_selector_string_makes_one_group_and_the_rest(net: Net) -> None:
    main, probe = net(X)
    report = gradient_report({"main": main.sum(), "probe": probe.sum()}, net, groups="encoder")
    assert list(report.groups) == ["encoder", "(rest)"]
    assert report["encoder"].parameters == tuple(
        f"encoder.{n}" for n, _ in net.encoder.named_parameters()
    )


def test_a_list_of_groups_holding_no_string_is_refused_with_its_type(net: Net) -> None:
    main, _ = net(X)
    with pytest.raises(
        IsolationTypeError,
        match=r"^gradient_report\(\): a list of groups must hold selector strings, got Linear;",
    ):
        gradient_report({"main": main.sum()}, net, groups=[net.head])


def test_the_cosine_of_the_second_and_third_loss_needs_a_parameter_both_reach() -> None:
    x, y = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    losses = {"a": (x + y).sum(), "b": 2 * x.sum(), "c": 3 * y.sum()}
    report = gradient_report(losses, nn.ParameterDict({"x": x, "y": y}))
    assert report.total.cosines == {
        ("a", "b"): pytest.approx(math.sqrt(0.5)),
        ("a", "c"): pytest.approx(math.sqrt(0.5)),
        ("b", "c"): None,  # b reaches x only, c y only: undefined, not 0
    }


@pytest.mark.parametrize(
    ("model", "losses", "groups", "message"),
    [
        ("model", {}, None, r"model must be a torch\.nn\.Module, got str;"),
        (None, [1.0], None, r"losses must be a non-empty mapping .*, got list;"),
        (None, None, 3, r"groups must be None, .* \{name: selector\(s\)\}, got int$"),
    ],
)
def test_report_arguments_of_the_wrong_type_are_named_with_their_type(
    net: Net, model: Any, losses: Any, groups: Any, message: str
) -> None:
    main, _ = net(X)
    with pytest.raises(IsolationTypeError, match=r"^gradient_report\(\): " + message):
        gradient_report(
            {"main": main.sum()} if losses is None else losses,
            net if model is None else model,
            groups=groups,
        )


def test_a_report_on_a_graph_freed_by_backward_is_refused_in_its_name() -> None:
    model = nn.Linear(2, 1)
    loss = model(torch.ones(1, 2)).pow(2).sum()
    loss.backward()
    with pytest.raises(BlindSpotError, match=r"^gradient_report\(\): part of the loss's graph"):
        gradient_report({"main": loss}, model)


def test_a_report_where_no_loss_reaches_any_parameter_has_every_value_undefined(net: Net) -> None:
    net.requires_grad_(False)
    main, _ = net(X)
    report = gradient_report({"main": main.sum(), "constant": torch.tensor(3.0)}, net)
    assert report.total.numel == 0 and report.total.norms == {"main": None, "constant": None}
    assert report.total.shares == {"main": None, "constant": None}
    assert report["encoder"].size == "frozen (112)"


def test_a_gradient_penalty_through_a_once_differentiable_function_is_refused() -> None:
    """Differentiating its backward again leads to a node that raises, whose edges go to
    stand-in leaves: autograd.grad returns the other paths' part of the gradient only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(2, 3, requires_grad=True)
    (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    main = g.pow(2).sum()
    (g,) = torch.autograd.grad(model[2](TanhOnce.apply(model[0](x))).sum(), x, create_graph=True)
    penalty = g.pow(2).sum()
    assert penalty.item() == pytest.approx(main.item())
    (partial,) = torch.autograd.grad(penalty, model[2].weight, retain_graph=True, allow_unused=True)
    assert partial is None  # the trap: the penalty does depend on it
    message = (
        r"^gradient_report\(\): the loss's graph runs through "
        r"torch::autograd::Error \(consumed by MmBackward0\), whose backward raises"
    )
    with pytest.raises(BlindSpotError, match=message):
        gradient_report({"main": main, "penalty": penalty}, model)
    with pytest.raises(BlindSpotError, match=r"^gradient_invariance\(\): the loss's graph runs"):
        gradient_invariance(main, main + penalty, model[2])
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        penalty.backward()  # a real backward fails there too


def test_a_report_through_a_derivative_torch_does_not_implement_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    log_probs = model(torch.randn(6, 2, 4)).log_softmax(-1)
    lengths = torch.tensor([6, 6])
    loss = nn.functional.ctc_loss(log_probs, torch.tensor([[1, 2], [3, 4]]), lengths, lengths // 3)
    (g,) = torch.autograd.grad(loss, log_probs, create_graph=True)
    penalty = g.pow(2).sum()
    with pytest.raises(
        BlindSpotError,
        match=r"^gradient_report\(\): the loss's graph runs through "
        r"torch::autograd::NotImplemented \(consumed by PowBackward0\), whose backward raises",
    ):
        gradient_report({"loss": loss, "penalty": penalty}, model)
    assert reachable_parameters(penalty, model) == ("weight", "bias")  # an upper bound
    with pytest.raises(GradientLeakError, match=r"the loss reaches 2 of 2 protected"):
        assert_isolated(penalty, model)  # the walk reads the node's real edges


def test_a_report_after_an_optimizer_step_changed_saved_tensors_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    loss = model(torch.randn(2, 3)).pow(2).sum()
    loss.backward(retain_graph=True)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)  # brute force
    message = (
        r"^gradient_report\(\): a tensor the loss's graph saved was changed in place since the "
        r"forward \(an optimizer\.step\(\), an in-place operation\), so its gradients cannot be "
        r"computed: one of the variables needed .* is at version 2; expected version 1 instead\. "
        r"Fix: run the audit before the optimizer step, or on the loss of a new forward$"
    )
    with pytest.raises(BlindSpotError, match=message):
        gradient_report({"main": loss}, model)
    with pytest.raises(BlindSpotError, match=r"^gradient_invariance\(\): a tensor the loss's"):
        gradient_invariance(loss, loss, model)
