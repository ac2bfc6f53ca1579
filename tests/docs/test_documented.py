"""The API reference covers the package: every public module is on a page of docs/api/, every
public name has a docstring and an anchor in the built site, and every ``isolate.*`` name the
README, the docs, the examples or a message of the library mentions exists.

A new public module fails here until it is added to a page of docs/api/ (and that page to
``nav`` in mkdocs.yml)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import isolate
from tests._launch import REPO, child_env

DOCS = REPO / "docs"
NAME = re.compile(r"\bisolate(?:\.[A-Za-z_]\w*)+")


def public_modules() -> list[str]:
    """``isolate`` and every module below it with no ``_`` in its dotted path."""
    found = pkgutil.walk_packages(isolate.__path__, "isolate.")
    below = (m.name for m in found if not any(p.startswith("_") for p in m.name.split(".")))
    return ["isolate", *sorted(below)]


def rendered_modules() -> dict[str, str]:
    """Module -> the API page that renders it (its ``::: module`` line)."""
    pages: dict[str, str] = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for module in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M):
            assert module not in pages, f"{module} is rendered on two pages"
            pages[module] = page.name
    return pages


def resolve(dotted: str) -> tuple[ModuleType, Any]:
    """The deepest module of ``dotted`` and the object the rest names in it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        obj: Any = module
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return module, obj
    raise ImportError(dotted)


def test_every_public_module_is_on_an_api_page() -> None:
    rendered = rendered_modules()
    missing = [m for m in public_modules() if m not in rendered]
    assert not missing, f"add `::: <module>` for these to a page of docs/api/: {missing}"
    gone = [m for m in rendered if m not in public_modules()]
    assert not gone, f"docs/api/ renders modules that are not public (or gone): {gone}"


def test_every_api_page_and_docs_page_is_in_the_navigation() -> None:
    nav = (REPO / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    listed = set(re.findall(r":\s+([\w/.-]+\.md)\s*$", nav, flags=re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == listed, (sorted(pages - listed), sorted(listed - pages))


def test_every_public_name_has_a_docstring() -> None:
    griffe = pytest.importorskip("griffe")  # the docs extra, which dev installs
    package = griffe.load("isolate", search_paths=[str(REPO)], resolve_aliases=True)
    undocumented = []
    for module in public_modules():
        node = package if module == "isolate" else package[module.removeprefix("isolate.")]
        if not node.docstring:
            undocumented.append(module)
        names = getattr(importlib.import_module(module), "__all__", None)
        assert names is not None, f"{module} has no __all__: it is what the reference renders"
        for name in names:
            member = node[name]
            target = member.final_target if member.is_alias else member
            if not target.docstring or not target.docstring.value.strip():
                undocumented.append(f"{module}.{name}")
    assert not undocumented, f"public names without a docstring: {undocumented}"


def _mentions(text: str) -> set[str]:
    return {m.rstrip(".") for m in NAME.findall(text)}


def _message_mentions() -> set[str]:
    """``isolate.*`` names in the string literals of the library (messages and docstrings)."""
    names: set[str] = set()
    for path in (REPO / "isolate").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names |= _mentions(node.value)
    return names


def test_every_name_the_docs_examples_and_messages_mention_exists_and_is_documented() -> None:
    sources = [REPO / "README.md", *DOCS.rglob("*.md"), *(REPO / "examples").glob("*.py")]
    mentioned = set().union(*(_mentions(p.read_text()) for p in sources)) | _message_mentions()
    rendered = rendered_modules()
    broken, undocumented = [], []
    for dotted in sorted(mentioned):
        try:
            module, obj = resolve(dotted)
        except (ImportError, AttributeError):
            broken.append(dotted)
            continue
        if any(part.startswith("_") for part in dotted.split(".")):
            continue  # plumbing named for maintainers: it must exist, not be in the reference
        home = getattr(obj, "__module__", None) if not isinstance(obj, ModuleType) else None
        if module.__name__ not in rendered and home not in rendered:
            undocumented.append(dotted)
    assert not broken, f"mentioned, but no such name: {broken}"
    assert not undocumented, f"mentioned, but in no module of the API reference: {undocumented}"


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors_and_anchors_every_public_name(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=child_env({"NO_MKDOCS_2_WARNING": "1"}),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    html = "\n".join(p.read_text() for p in (site / "api").rglob("index.html"))
    anchors = set(re.findall(r'id="(isolate[\w.]*)"', html))
    missing = [
        f"{module}.{name}"
        for module in rendered_modules()
        for name in getattr(importlib.import_module(module), "__all__", [])
        if f"{module}.{name}" not in anchors
    ]
    assert not missing, f"public names with no anchor in the built site: {missing}"
    index = (site / "index.html").read_text()
    assert "IsolationSpec" in index and "pip install" in index  # the README's sections
