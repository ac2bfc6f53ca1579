"""How messages list names: the first few, then how many more; and the close ones."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["counted", "did_you_mean", "shown"]


def shown(names: Iterable[str], *, limit: int = 8) -> str:
    """``['a', 'b', ... and N more]``: the first ``limit`` names, quoted.

    >>> shown(["a", "b", "c"], limit=2)
    "['a', 'b', ... and 1 more]"
    """
    listed = list(names)
    head = ", ".join(repr(n) for n in listed[:limit])
    more = f", ... and {len(listed) - limit} more" if len(listed) > limit else ""
    return f"[{head}{more}]"


def counted(names: list[str], noun: str, *, limit: int = 5) -> str:
    """``parameters 'a', 'b' and N more`` (singular for one name), for running text.

    >>> counted(["w"], "parameter"), counted(["a", "b", "c"], "parameter", limit=2)
    ("parameter 'w'", "parameters 'a', 'b' and 1 more")
    """
    head = ", ".join(repr(n) for n in names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{noun}{'s' if len(names) > 1 else ''} {head}{more}"


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the (at most two) candidates close to ``word``, else ``""``.

    >>> did_you_mean("--by_epoch", ["--by-epoch", "--monitor"])
    "; did you mean '--by-epoch'?"
    >>> did_you_mean("zzz", ["schedule"])
    ''
    """
    close = difflib.get_close_matches(word, list(candidates), n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def formatted(value: float | None, spec: str) -> str:
    """``value`` in ``spec``, or ``-`` for a missing one (a table cell)."""
    return "-" if value is None else format(value, spec)
