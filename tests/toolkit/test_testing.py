"""isolate.testing: the assertion helpers, and the module as a pytest plugin."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch
from torch import nn

import isolate.testing as plugin
from isolate.cutoff import assert_reached as core_assert_reached
from isolate.drift import Snapshot, snapshot
from isolate.errors import (
    CutOffError,
    DriftError,
    GradientLeakError,
    IsolationTypeError,
    SelectorError,
)
from isolate.reachability import assert_isolated as auditing_assert_isolated
from isolate.testing import (
    assert_gradient_invariance,
    assert_isolated,
    assert_reached,
    assert_trains,
    assert_unchanged,
)
from tests._launch import REPO, launch

pytest_plugins = ["pytester"]


def test_assert_isolated_is_the_auditing_one() -> None:
    assert assert_isolated is auditing_assert_isolated
    assert assert_reached is core_assert_reached


def test_assert_trains_names_the_cut_off_with_the_traced_reason() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(3, 3), "head": nn.Linear(3, 1)})
    x = torch.randn(2, 3)
    assert_trains(model, lambda: model["head"](model["body"](x)).sum())
    with pytest.raises(CutOffError, match=r"^assert_reached\(\): 2 of 4 trainable") as info:
        assert_trains(model, lambda: model["head"](model["body"](x).detach()).sum())
    assert "\n  body.weight, body.bias: 'body' (Linear) ran, but its output does not" in str(
        info.value
    )
    assert "starts again at 'head' (Linear)" in str(info.value)
    with pytest.raises(CutOffError, match=r"'body' \(Linear\) did not run in the traced"):
        assert_trains(model, lambda: {"main": model["head"](x).sum()})
    assert_trains(model, lambda: [model["head"](x).sum()], expected_unused="body")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_assert_unchanged_passes_and_yields_the_snapshot() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model[1].eval()
    with assert_unchanged(model[:2]) as snap:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 3)).pow(2).mean().backward()
            opt.step()
    assert isinstance(snap, Snapshot)
    assert snap.names[-1] == "1.num_batches_tracked"


def test_assert_unchanged_names_what_moved() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    with (
        pytest.raises(DriftError, match=r"^assert_unchanged\(\): 2 of 2 tensors changed") as info,
        assert_unchanged(model, parameters="frozen"),
    ):
        for p in model[0].parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    assert "0.weight" in str(info.value) and "in 9 of 9 elements" in str(info.value)


def test_an_assertion_over_no_tensor_is_refused_before_the_block_runs() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())  # nothing frozen yet
    ran = []
    with (
        pytest.raises(SelectorError, match=r"snapshot of Sequential recorded no tensor, so"),
        assert_unchanged(model, parameters="frozen", buffers=False),
    ):
        ran.append(True)
    assert ran == []
    with (
        pytest.raises(SelectorError, match=r"snapshot of ReLU recorded no tensor"),
        assert_unchanged(model[1]),
    ):
        ran.append(True)
    assert ran == []
    snap = snapshot(model, names=[])  # a query on it answers: nothing changed
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert snap.changed() == {}
    with pytest.raises(SelectorError, match=r"^assert_unchanged\(\): the snapshot of Sequent"):
        snap.assert_unchanged()


def test_an_assertion_with_nothing_trainable_to_prove_is_refused() -> None:
    torch.manual_seed(0)
    encoder, head, probe = nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(3, 2)
    model = nn.Sequential(encoder, head)
    x = torch.randn(4, 3)
    encoder.requires_grad_(False)
    features = encoder(x)
    main = head(features).mean()
    # The probe reads the features undetached: trainable, the encoder would learn from it.
    with pytest.raises(SelectorError, match=r"none of the 2 protected parameters requires gr"):
        assert_gradient_invariance(main, main + probe(features).mean(), encoder)
    model.requires_grad_(False)
    with pytest.raises(SelectorError, match=r"nothing to prove: 0 of the 4 parameters of Seq"):
        assert_trains(model, lambda: model(x).sum())
    with pytest.raises(SelectorError, match=r"and 2 of them expected unused, so this"):
        head.requires_grad_(True)
        assert_reached(model(x).sum().detach(), model, expected_unused="1")
    # With the parameters trainable, each assertion proves something and passes or fails.
    model.requires_grad_(True)
    assert_trains(model, lambda: model(x).sum())
    features = encoder(x)
    main = head(features).mean()
    with pytest.raises(GradientLeakError, match=r"change the gradient of 2 of 2 protected"):
        assert_gradient_invariance(main, main + probe(features).mean(), encoder)


def test_assert_unchanged_lets_the_block_exception_through() -> None:
    bn = nn.BatchNorm1d(2)
    with pytest.raises(KeyError), assert_unchanged(bn):
        bn(torch.randn(4, 2))  # moves the statistics, but the KeyError is what the user sees
        raise KeyError("boom")


def test_assert_unchanged_with_atol() -> None:
    model = nn.Linear(2, 1)
    with assert_unchanged(model, atol=0.1), torch.no_grad():
        model.bias.add_(0.05)


def test_assert_gradient_invariance() -> None:
    torch.manual_seed(0)
    encoder, head, probe = nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(3, 2)
    model = nn.ModuleDict({"encoder": encoder, "head": head, "probe": probe})
    features = encoder(torch.randn(4, 3))
    main = head(features).pow(2).mean()
    assert_gradient_invariance(main, main + probe(features.detach()).pow(2).mean(), encoder)
    leaky = main + probe(features).pow(2).mean()
    with pytest.raises(
        GradientLeakError, match=r"^assert_gradient_invariance\(\): the auxiliary losses change"
    ) as info:
        assert_gradient_invariance(main, leaky, "encoder", model=model)
    message = str(info.value)
    assert "2 of 2 protected parameters (atol=0.0)" in message
    assert "\n  encoder.weight  max|Δ|=" in message and "encoder.bias" in message
    assert message.endswith(
        "\nFix: find the path with assert_isolated(aux_loss, protected) for each auxiliary "
        "loss, and cut it with isolate.stop_gradient or isolate.Detached"
    )
    assert_gradient_invariance(main, leaky, "encoder", model=model, atol=1e6)
    # Reaching the head, not the encoder, is fine.
    assert_gradient_invariance(main, main + head.weight.sum(), encoder)


@pytest.mark.parametrize("atol", [-1.0, float("nan"), float("inf"), "0", None, torch.tensor(0.0)])
def test_assert_gradient_invariance_refuses_a_tolerance_that_is_not_a_number_at_least_zero(
    atol: object,
) -> None:
    """A negative or NaN tolerance failed an exact isolation (0.0 > -1); a string or None
    crashed in the comparison. Refused as assert_unchanged refuses them, before any grad."""
    torch.manual_seed(0)
    encoder, head, probe = nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(3, 2)
    features = encoder(torch.randn(4, 3))
    main = head(features).mean()
    isolated = main + probe(features.detach()).mean()
    with pytest.raises(
        IsolationTypeError,
        match=rf"^assert_gradient_invariance\(\): atol must be a number >= 0, got "
        rf"{re.escape(repr(atol))}$",
    ):
        assert_gradient_invariance(main, isolated, encoder, atol=atol)  # type: ignore[arg-type]
    assert encoder.weight.grad is None and probe.weight.grad is None
    assert_gradient_invariance(main, isolated, encoder, atol=0)


def test_fixture_from_the_installed_plugin(isolation_snapshot: Callable[..., Snapshot]) -> None:
    model = nn.Linear(2, 2)
    snap = isolation_snapshot(model, buffers=False)
    assert isinstance(snap, Snapshot) and snap.names == ("weight", "bias")
    snap.assert_unchanged()


def test_plugin_is_registered_once_under_its_entry_point_name(
    pytestconfig: pytest.Config,
) -> None:
    """The suite's own --doctest-modules import of isolate/testing.py is the same module."""
    manager = pytestconfig.pluginmanager
    assert manager.get_plugin("isolate.testing") is plugin
    assert [name for name, p in manager.list_name_plugin() if p is plugin] == ["isolate.testing"]
    assert sys.modules["isolate.testing"] is plugin


INNER_TEST = """
    import torch
    import pytest

    def test_snapshot_fixture(isolation_snapshot):
        model = torch.nn.BatchNorm1d(2)
        snap = isolation_snapshot(model)
        model(torch.randn(4, 2))
        with pytest.raises(AssertionError, match="running_mean"):
            snap.assert_unchanged()
"""


def test_plugin_loads_by_entry_point_in_a_fresh_session(pytester: pytest.Pytester) -> None:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        pytest.skip("entry-point plugins are disabled in this environment")
    pytester.makepyfile(test_inner=textwrap.dedent(INNER_TEST))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_plugin_loads_by_name_without_autoload(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_inner=textwrap.dedent(INNER_TEST))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "isolate.testing")
    result.assert_outcomes(passed=1)
    missing = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    missing.assert_outcomes(errors=1)  # no plugin, no fixture


def test_helpers_import_without_pytest() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["pytest"] = None  # any import of pytest now fails
        import torch, isolate
        assert "isolate.testing" not in sys.modules  # only an explicit import loads it
        import isolate.testing as t
        with t.assert_unchanged(torch.nn.Linear(2, 2)):
            pass
        print(hasattr(t, "isolation_snapshot"))
        """
    )
    out = launch([sys.executable, "-c", code], cwd=REPO)
    assert out.stdout.strip() == "False"


FAILING_TESTS = """
    import torch
    from torch import nn
    from isolate.testing import assert_gradient_invariance, assert_trains

    def test_leak():
        torch.manual_seed(0)
        encoder, head, probe = nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(3, 2)
        features = encoder(torch.randn(4, 3))
        main = head(features).mean()
        assert_gradient_invariance(main, main + probe(features).mean(), encoder)

    def test_cut():
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
        assert_trains(model, lambda: model[1](model[0](torch.randn(2, 3)).detach()).sum())
"""


def test_a_failing_assertion_is_reported_at_the_users_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=textwrap.dedent(FAILING_TESTS))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--tb=long")
    result.assert_outcomes(failed=2)
    report = result.stdout.str()
    assert "test_inner.py:10: GradientLeakError" in report
    assert "test_inner.py:14: CutOffError" in report
    # The helpers' own frames are hidden: the report ends where the user called them.
    assert plugin.__file__ not in report and "isolate" + os.sep + "testing.py" not in report
