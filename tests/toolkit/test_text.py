"""Names in messages: at most eight shown by default, the rest counted; the close ones
offered."""

from __future__ import annotations

import pytest

from isolate._text import counted, did_you_mean, formatted, shown, warn_user
from isolate.errors import IsolationWarning


def test_shown_names_eight_then_counts_the_rest() -> None:
    names = [f"p{i}" for i in range(10)]
    eight = "'p0', 'p1', 'p2', 'p3', 'p4', 'p5', 'p6', 'p7'"
    assert shown(names) == f"[{eight}, ... and 2 more]"
    assert shown(names[:8]) == f"[{eight}]"
    assert shown(names, limit=2) == "['p0', 'p1', ... and 8 more]"


def test_counted_is_singular_for_one_name_and_counts_past_the_limit() -> None:
    assert counted(["w"], "parameter") == "parameter 'w'"
    assert counted(["a", "b"], "parameter") == "parameters 'a', 'b'"
    names = [f"p{i}" for i in range(7)]
    assert counted(names, "layer") == "layers 'p0', 'p1', 'p2', 'p3', 'p4' and 2 more"
    assert counted(names[:5], "layer") == "layers 'p0', 'p1', 'p2', 'p3', 'p4'"
    assert counted(names, "layer", limit=1) == "layers 'p0' and 6 more"


def test_did_you_mean_offers_the_two_closest_or_nothing() -> None:
    assert did_you_mean("--by_epoch", ["--by-epoch", "--monitor"]) == "; did you mean '--by-epoch'?"
    assert did_you_mean("trunk", ("trunks", "trunk0", "trunk12", "head")) == (
        "; did you mean 'trunks' or 'trunk0'?"
    )
    assert did_you_mean("zzz", ["schedule"]) == ""
    assert did_you_mean("trunk", iter(["trunc"])) == "; did you mean 'trunc'?"  # any iterable


def test_formatted_writes_a_dash_for_a_missing_value() -> None:
    assert formatted(None, ".3e") == "-"
    assert formatted(0.5, "+.3f") == "+0.500"
    assert formatted(1234.5, ".3e") == "1.234e+03"


def test_warn_user_warns_the_message_as_an_isolation_warning() -> None:
    with pytest.warns(IsolationWarning) as caught:
        warn_user("frozen parameters out of the optimizer")
    assert [str(w.message) for w in caught] == ["frozen parameters out of the optimizer"]
    assert [w.category for w in caught] == [IsolationWarning]
