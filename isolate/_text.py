"""How messages list names: the first few, then how many more; and the close ones. Where a
warning points: at the user's line."""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
import warnings
from collections.abc import Iterable

import torch

from isolate.errors import IsolationWarning

__all__ = ["counted", "did_you_mean", "shown", "warn_user"]

# isolate's package, torch's (module calls, optimizer hooks, the compile guard of
# outside_compile) and contextlib (a context manager's exit): never the user's line.
_NOT_THE_USERS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.abspath(contextlib.__file__),
)


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


def warn_user(message: str) -> None:
    """Warn with an :class:`~isolate.IsolationWarning` pointing at the user's call: the first
    frame outside isolate, torch and contextlib, however deep inside them it is raised."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _NOT_THE_USERS
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, IsolationWarning, stacklevel=level)
