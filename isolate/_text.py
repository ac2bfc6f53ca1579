"""How messages list names: the first few, then how many more."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["shown"]


def shown(names: Iterable[str], *, limit: int = 8) -> str:
    """``['a', 'b', ... and N more]``: the first ``limit`` names, quoted.

    >>> shown(["a", "b", "c"], limit=2)
    "['a', 'b', ... and 1 more]"
    """
    listed = list(names)
    head = ", ".join(repr(n) for n in listed[:limit])
    more = f", ... and {len(listed) - limit} more" if len(listed) > limit else ""
    return f"[{head}{more}]"
