"""Names in messages: at most eight shown by default, the rest counted."""

from __future__ import annotations

from isolate._text import shown


def test_shown_names_eight_then_counts_the_rest() -> None:
    names = [f"p{i}" for i in range(10)]
    eight = "'p0', 'p1', 'p2', 'p3', 'p4', 'p5', 'p6', 'p7'"
    assert shown(names) == f"[{eight}, ... and 2 more]"
    assert shown(names[:8]) == f"[{eight}]"
    assert shown(names, limit=2) == "['p0', 'p1', ... and 8 more]"
