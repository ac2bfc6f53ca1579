"""The size of isolate's rooms, counted with ``ast``: no module over 500 lines, no class over
300 lines of code, no function over 60 lines of code.

A line of code is a line that holds code: blank lines, comment-only lines and docstrings do not
count (a docstring is prose and its ``>>>`` example a doctest; the module limit, on the other
hand, counts every line, so long prose still shows). Nested functions count in their parent as
well. Run as a script (``python -m tests.test_sizes [ROOT ...]``) to list every offender.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections.abc import Iterator

from tests._launch import REPO

MODULE_LINES = 500
CLASS_CODE_LINES = 300
FUNCTION_CODE_LINES = 60


def code_lines(text: str) -> set[int]:
    """The numbers of the lines of ``text`` that hold code (not blank, not only a comment, not
    part of a docstring)."""
    tree = ast.parse(text)
    prose: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                prose.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    code: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in skip or token.type == tokenize.ENDMARKER:
            continue
        code.update(range(token.start[0], token.end[0] + 1))
    return code - prose


def oversized(where: str, text: str) -> Iterator[str]:
    """One line per room of the module ``text`` (found at ``where``) over its limit:
    ``where:line kind name: N lines of code``."""
    total = len(text.splitlines())
    if total > MODULE_LINES:
        yield f"{where}: module: {total} lines (limit {MODULE_LINES})"
    code = code_lines(text)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            kind, limit = "class", CLASS_CODE_LINES
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, limit = "function", FUNCTION_CODE_LINES
        else:
            continue
        span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        count = len(code.intersection(span))
        if count > limit:
            name = f"{kind} {node.name}"
            yield f"{where}:{node.lineno}: {name}: {count} lines of code (limit {limit})"


def report(*roots: str) -> list[str]:
    paths = sorted(p for root in roots for p in (REPO / root).rglob("*.py"))
    return [line for p in paths for line in oversized(str(p.relative_to(REPO)), p.read_text())]


def test_counting_skips_prose_and_blank_lines() -> None:
    text = 'def f():\n    """Doc.\n\n    More."""\n    # why\n\n    x = (1,\n         2)\n'
    text += "    return x\n"
    assert code_lines(text) == {1, 7, 8, 9}


def test_each_kind_of_oversized_room_is_reported() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_CODE_LINES - 1))
    assert list(oversized("m.py", f"def long():\n{body}")) == []
    long = f"def long():\n    y = 0\n{body}"
    assert list(oversized("m.py", long)) == [
        f"m.py:1: function long: {FUNCTION_CODE_LINES + 1} lines of code (limit 60)"
    ]
    methods = "".join(f"    def f{i}(self):\n        return {i}\n" for i in range(150))
    assert list(oversized("m.py", f"class Big:\n{methods}")) == [
        f"m.py:1: class Big: {1 + 2 * 150} lines of code (limit 300)"
    ]
    assert list(oversized("m.py", '"""x"""\n' + "\n" * MODULE_LINES)) == [
        f"m.py: module: {MODULE_LINES + 1} lines (limit 500)"
    ]


def test_no_room_of_isolate_is_oversized() -> None:
    assert report("isolate") == []


if __name__ == "__main__":
    print("\n".join(report(*(sys.argv[1:] or ["isolate"]))) or "none")
