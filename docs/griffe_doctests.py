"""A griffe extension for the documentation site: docstrings as Markdown.

The docstrings are Google style with reST touches that the terminal and ``help()`` read
well: ``>>>`` examples outside an ``Examples:`` section, ``:class:`~x.Y``` roles and
double-backtick literals. Markdown would read an example's output ``[1, 2]`` as a link and
show the roles as they are, so each docstring is rewritten before it is parsed: ``>>>``
blocks become ``pycon`` code blocks, roles become code, ``literal`` stays code.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_LITERAL = re.compile(r"(?<!`)``(?!`)")  # a reST literal, not a code fence
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    shown = target.split(" <")[0]
    if tilde:
        shown = shown.rsplit(".", 1)[-1]
    return f"`{shown}`"


def markdown(text: str) -> str:
    """``text`` with its doctest blocks fenced and its reST roles as code."""
    out: list[str] = []
    block: list[str] = []
    indent = ""
    for line in [*text.splitlines(), ""]:
        stripped = line.lstrip()
        if block:
            if stripped and line.startswith(indent) and not stripped.startswith(":"):
                block.append(line[len(indent) :])
                continue
            out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
            block = []
        if stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            block = [stripped]
            continue
        out.append(line)
    text = "\n".join(out[:-1])
    text = _ROLE.sub(_role, text)
    return _LITERAL.sub("`", text)


class DoctestsAsCode(Extension):
    """Rewrite every docstring with :func:`markdown` before griffe parses it."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
