"""The layering of isolate, read from the source with ``ast``: every import counts, at module
level, inside functions and under ``TYPE_CHECKING``.

* (a) no import cycles among the modules of isolate/;
* (b) the toolkit (isolate/*.py but ``cli``, ``__init__`` and ``__main__``) imports neither the
  spec package, nor the ways in and out (``isolate.interop``, ``isolate.certificates``), nor an
  integration;
* (c) the spec package imports neither the ways in and out nor an integration;
* (d) no module of isolate/, experiments/ or examples/ imports a private name (a leading
  underscore, dunders aside) from another module; inside isolate/ a private *module*
  (``isolate._sharding``) may be imported, from experiments/ and examples/ not;
* (e) ``import isolate`` loads no framework, no extra and no integration;
* (f) an integration imports only the public API and the handle's (see :func:`public_api`).

An integration is any package below isolate/ that is not a layer (see ``LAYERS``):
``isolate.lightning`` today, and the ones to come. Edges of the import graph:
``import isolate.x.y`` and ``from isolate.x import y`` (``y`` a submodule) go to
``isolate.x.y``; ``from isolate.x import name`` goes to ``isolate.x`` (a package: its
``__init__``).

Each rule is also broken on purpose (the tests at the end): a line added to a copy of one
module's source must be reported, so that no check passes vacuously.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._launch import REPO, launch

# The subpackages of isolate that are layers, by layer; any other subpackage is an integration.
LAYERS = {"spec": "spec", "interop": "in-and-out", "certificates": "in-and-out"}
Sources = Mapping[str, tuple[Path, str]]  # dotted module name -> (its file, its text)


@dataclass(frozen=True)
class Import:
    """One imported name: ``module`` is what the statement names, ``name`` what it takes from
    it (``None`` for ``import module``)."""

    source: str  # the importing module, dotted
    path: Path
    line: int
    module: str
    name: str | None

    def where(self) -> str:
        taken = f"from {self.module} import {self.name}" if self.name else f"import {self.module}"
        return f"{self.path.relative_to(REPO)}:{self.line}: {taken}"


def dotted(path: Path) -> str:
    """``isolate/spec/plan.py`` -> ``isolate.spec.plan``; ``isolate/spec/__init__.py`` ->
    ``isolate.spec``."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read(*roots: str) -> dict[str, tuple[Path, str]]:
    paths = sorted(p for root in roots for p in (REPO / root).rglob("*.py"))
    return {dotted(p): (p, p.read_text()) for p in paths}


ISOLATE = read("isolate")
OUTSIDE = read("experiments", "examples")


def imports(module: str, path: Path, text: str) -> Iterator[Import]:
    """Every import in ``text``, wherever it stands: module level, in a function, under
    ``TYPE_CHECKING`` (``ast.walk`` visits them all). Relative imports are resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, path, node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                yield Import(module, path, node.lineno, base, alias.name)


def all_imports(sources: Sources) -> Iterator[Import]:
    for module, (path, text) in sources.items():
        yield from imports(module, path, text)


def target(imp: Import, modules: Sources) -> str | None:
    """The module of isolate an import loads by name, if any (see the module docstring)."""
    if imp.name is not None and f"{imp.module}.{imp.name}" in modules:
        return f"{imp.module}.{imp.name}"  # from isolate.x import submodule
    return imp.module if imp.module in modules else None


def graph(sources: Sources) -> dict[str, dict[str, list[Import]]]:
    edges: dict[str, dict[str, list[Import]]] = {m: {} for m in sources}
    for imp in all_imports(sources):
        to = target(imp, sources)
        if to is not None and to != imp.source:
            edges[imp.source].setdefault(to, []).append(imp)
    return edges


def components(edges: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        work = [(root, iter(sorted(edges[root])))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def layer(module: str) -> str:
    """``toolkit``, ``spec``, ``in-and-out`` (interop, certificates), ``integration``, or
    ``entry`` for the package's ``__init__``, ``__main__`` and ``cli``, which stand above the
    layers."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in {"__main__", "cli"}:
        return "entry"
    if not (REPO / "isolate" / parts[1] / "__init__.py").is_file():
        return "toolkit"
    return LAYERS.get(parts[1], "integration")


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# --------------------------------------------------------------------------------------------
# The reports: one line per violation, naming the file, the line and the import


def cycle_report(sources: Sources) -> list[str]:
    """One shortest cycle per strongly connected component, each step with the import that
    makes it."""
    edges = graph(sources)
    found = []
    for component in components(edges):
        members = set(component)
        start = component[0]
        back: dict[str, str] = {}
        queue = [start]
        while queue and start not in back:
            node = queue.pop(0)
            for nxt in sorted(edges[node]):
                if nxt in members and nxt not in back:
                    back[nxt] = node
                    queue.append(nxt)
        steps, node = [], start
        while True:
            prev = back[node]
            steps.insert(0, f"    {prev} -> {node}: {edges[prev][node][0].where()}")
            node = prev
            if node == start:
                break
        found.append(f"{len(component)} modules: {' <-> '.join(component)}\n" + "\n".join(steps))
    return found


def layer_report(sources: Sources, layers: set[str], forbidden: set[str]) -> list[str]:
    return [
        f"{layer(imp.source)} imports {layer(to)}: {imp.where()}"
        for source, out in graph(sources).items()
        if layer(source) in layers
        for to, found in out.items()
        if layer(to) in forbidden
        for imp in found
    ]


FIRST_PARTY = {"isolate", "experiments", "examples"}


def private_report(inside: Sources, outside: Sources) -> list[str]:
    """Private names of this repository's modules taken by another module, by ``from m import
    _name`` or by reading ``m._name`` off an imported module; from experiments/ and examples/
    also any private module of isolate. (Other packages' private names, such as torch's
    ``_BatchNorm``, are theirs to keep stable, not a layering question.)"""
    modules = {**inside, **outside}
    found = []
    for sources, within in ((inside, True), (outside, False)):
        for imp in all_imports(sources):
            names = imp.module.split(".")
            if names[0] not in FIRST_PARTY:
                continue
            taken = [*names, imp.name] if imp.name else names
            if not within and taken[0] == "isolate" and any(private(n) for n in taken):
                found.append(f"a private module or name of isolate: {imp.where()}")
                continue
            if imp.name is None or not private(imp.name) or imp.module == imp.source:
                continue
            if within and f"{imp.module}.{imp.name}" in inside:
                continue  # a private module of isolate, imported from inside the package
            found.append(f"a private name of another module: {imp.where()}")
        for path, text in sources.values():
            for where in _read_off(path, text, modules):
                found.append(f"a private name of another module: {where}")
    return found


def _read_off(path: Path, text: str, modules: Sources) -> Iterator[str]:
    """``m._name`` where ``m`` is bound to a module of this repository by an import."""
    tree = ast.parse(text, str(path))
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and private(node.attr)):
            continue
        chain: list[str] = []
        value: ast.expr = node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            owner = ".".join([bound[value.id], *chain])
            if owner in modules and owner != dotted(path) and owner.split(".")[0] in FIRST_PARTY:
                yield f"{path.relative_to(REPO)}:{node.lineno}: {owner}.{node.attr}"


# What ``import isolate`` must not load: the frameworks and the extras' packages (plot,
# certify; isolate.testing and isolate.figures are imported explicitly), and every integration.
NOT_ON_IMPORT = {"lightning", "lightning_fabric", "pytorch_lightning", "torchvision"}
NOT_ON_IMPORT |= {"matplotlib", "pytest", "safetensors", "isolate.figures", "isolate.testing"}
NOT_ON_IMPORT |= {"transformers", "peft", "torch._dynamo"}


def import_report(loaded: set[str], sources: Sources) -> list[str]:
    """What of ``NOT_ON_IMPORT`` and the integrations is in ``loaded`` (a package once, not
    each of its modules)."""
    integrations = {m for m in sources if layer(m) == "integration"}
    found = {m for m in loaded if m in integrations or m in NOT_ON_IMPORT}
    found |= {m.split(".")[0] for m in loaded if m.split(".")[0] in NOT_ON_IMPORT}
    return sorted(found)


def all_of(module: str, sources: Sources) -> set[str]:
    """A module's ``__all__``, read from its source."""
    path, text = sources[module]
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path}: no __all__")


def public_api(sources: Sources) -> dict[str, set[str] | None]:
    """What an integration may import, by module (``None``: any public name of it):

    * ``isolate``: the names of ``isolate.__all__``; ``isolate.spec``: ``isolate.spec.__all__``;
    * the public names of the modules an integration adapts: the handle
      (``isolate.spec.handle``), how it is applied (``isolate.spec.isolation``), its loop
      (``isolate.spec.cadence``) and its saved state (``isolate.spec.state``);
    * the public names of every public module of the toolkit (``isolate.errors`` among them)
      and of the ways in and out (interop, certificates).

    Not: the other modules of the spec package (its internals: plan, checks, state, ranks,
    ...), any private module (``isolate._sharding``, ``isolate.spec._fields``), any private
    name, and the entry points (``isolate.cli``).
    """
    allowed: dict[str, set[str] | None] = {
        "isolate": all_of("isolate", sources),
        "isolate.spec": all_of("isolate.spec", sources),
        "isolate.spec.handle": None,
        "isolate.spec.isolation": None,
        "isolate.spec.cadence": None,
        "isolate.spec.state": None,
    }
    for module in sources:
        if layer(module) in {"toolkit", "in-and-out"} and not any(
            private(p) for p in module.split(".")
        ):
            allowed[module] = None
    return allowed


def integration_report(sources: Sources) -> list[str]:
    allowed = public_api(sources)
    found = []
    for imp in all_imports(sources):
        if layer(imp.source) != "integration" or imp.module.split(".")[0] != "isolate":
            continue
        own = ".".join(imp.source.split(".")[:2])
        if imp.module == own or imp.module.startswith(own + "."):
            continue
        module, name = imp.module, imp.name
        if name is not None and f"{module}.{name}" in sources:
            module, name = f"{module}.{name}", None  # a submodule
        if module not in allowed:
            found.append(f"{module} is not public API: {imp.where()}")
        elif name is not None:
            names = allowed[module]
            if private(name) or (names is not None and name not in names):
                found.append(f"{module}.{name} is not public API: {imp.where()}")
    return found


# --------------------------------------------------------------------------------------------
# The rules, on the sources as they are


def test_no_import_cycles_in_isolate() -> None:
    found = cycle_report(ISOLATE)
    assert found == [], "import cycles:\n" + "\n".join(found)


def test_the_toolkit_imports_neither_the_spec_nor_the_ways_in_and_out_nor_an_integration() -> None:
    assert {layer(m) for m in ISOLATE} == {"entry", "toolkit", "spec", "in-and-out", "integration"}
    found = layer_report(ISOLATE, {"toolkit"}, {"spec", "in-and-out", "integration"})
    assert found == [], "\n".join(found)


def test_the_spec_imports_neither_the_ways_in_and_out_nor_an_integration() -> None:
    found = layer_report(ISOLATE, {"spec"}, {"in-and-out", "integration"})
    assert found == [], "\n".join(found)


def test_no_private_name_crosses_a_module() -> None:
    found = private_report(ISOLATE, OUTSIDE)
    assert found == [], "\n".join(found)


def test_import_isolate_loads_no_framework_and_no_integration() -> None:
    code = "import sys, json, isolate; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(launch([sys.executable, "-c", code], cwd=REPO).stdout))
    assert "isolate" in loaded and "torch" in loaded  # the child did import it
    assert import_report(loaded, ISOLATE) == []


def test_integrations_import_only_the_public_api_and_the_handle() -> None:
    found = integration_report(ISOLATE)
    assert found == [], "\n".join(found)


# --------------------------------------------------------------------------------------------
# Each rule broken on purpose: the line added to a copy of one module is what gets reported


def _with(module: str, line: str, sources: Sources = ISOLATE) -> dict[str, tuple[Path, str]]:
    path, text = sources[module]
    return {**sources, module: (path, text + "\n" + line + "\n")}


def _added(module: str, line: str, sources: Sources = ISOLATE) -> str:
    """``file:line:`` of the last line of ``line`` once ``_with`` has appended it to ``module``
    (each snippet below ends with its violation)."""
    path, text = sources[module]
    return f"{path.relative_to(REPO)}:{len(text.splitlines()) + 1 + len(line.splitlines())}:"


def test_components_are_the_cycles_of_a_graph() -> None:
    edges = {
        "a": {"b": 0},
        "b": {"c": 0},
        "c": {"a": 0, "d": 0},  # a -> b -> c -> a, and a tail to d
        "d": {"e": 0},
        "e": {"d": 0},  # d <-> e, reached from the first cycle
        "f": {"a": 0, "f": 0},  # into a cycle, and a self-edge: no cycle of modules
    }
    assert components(edges) == [["d", "e"], ["a", "b", "c"]]
    assert components({"a": {"b": 0}, "b": {}}) == []


@pytest.mark.parametrize(
    "line",
    [
        "import isolate.freezing",
        "def f():\n    from isolate import freezing",
        "if TYPE_CHECKING:\n    from isolate.freezing import freeze",
    ],
    ids=["module-level", "in-a-function", "type-checking"],
)
def test_a_cycle_is_found_whatever_kind_of_import_closes_it(line: str) -> None:
    assert "isolate.errors" in graph(ISOLATE)["isolate.freezing"]  # freezing -> errors
    found = cycle_report(_with("isolate.errors", line))
    assert len(found) == 1, found
    members = found[0].splitlines()[0].split(": ", 1)[1].split(" <-> ")
    assert {"isolate.errors", "isolate.freezing"} <= set(members)
    assert _added("isolate.errors", line) in found[0]  # the step that closes the cycle


@pytest.mark.parametrize(
    ("module", "line", "rule"),
    [
        ("isolate.freezing", "from isolate.spec import IsolationSpec", "toolkit imports spec"),
        ("isolate._tree", "def f():\n    import isolate.spec.plan", "toolkit imports spec"),
        ("isolate.drift", "from isolate.interop import migrate", "toolkit imports in-and-out"),
        (
            "isolate.cutoff",
            "if TYPE_CHECKING:\n    from isolate.lightning import IsolationCallback",
            "toolkit imports integration",
        ),
        ("isolate.spec.plan", "import isolate.interop.leave", "spec imports in-and-out"),
        (
            "isolate.spec.data",
            "from isolate.certificates import certify",
            "spec imports in-and-out",
        ),
        (
            "isolate.spec.handle",
            "from isolate.lightning import callback",
            "spec imports integration",
        ),
    ],
    ids=lambda case: case.splitlines()[-1].strip() if "\n" in case else case,
)
def test_a_step_up_a_layer_is_found(module: str, line: str, rule: str) -> None:
    sources = _with(module, line)
    found = layer_report(sources, {"toolkit"}, {"spec", "in-and-out", "integration"})
    found += layer_report(sources, {"spec"}, {"in-and-out", "integration"})
    added = [f for f in found if _added(module, line) in f]
    assert len(added) == 1 and added[0].startswith(rule), found


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("isolate.drift", "from isolate.fingerprints import _fingerprint"),
        ("isolate.spec.checks", "def f():\n    from isolate.freezing import _active"),
        ("experiments.bench", "from isolate import _sharding"),
        ("experiments.suite", "import isolate._autograd"),
        ("examples.toy", "from isolate.spec._fields import string_list"),
        ("experiments.cli", "from experiments.suite import _split"),
        ("isolate.spec.checks", "from isolate import fingerprints\nfingerprints._fingerprint(x)"),
        ("experiments.report", "import isolate.freezing\nisolate.freezing._active.clear()"),
    ],
    ids=lambda case: case.splitlines()[-1].strip() if "\n" in case else case,
)
def test_a_private_name_or_module_crossing_is_found(module: str, line: str) -> None:
    inside, outside = (
        (_with(module, line), OUTSIDE)
        if module in ISOLATE
        else (ISOLATE, _with(module, line, OUTSIDE))
    )
    found = private_report(inside, outside)
    where = _added(module, line, ISOLATE if module in ISOLATE else OUTSIDE)
    assert len([f for f in found if where in f]) == 1, found
    # Inside isolate a private module may be imported, but none of its private names.
    assert private_report(_with("isolate.drift", "from isolate import _sharding"), {}) == (
        private_report(ISOLATE, {})
    )


def test_a_framework_or_an_integration_loaded_by_import_isolate_is_found() -> None:
    loaded = {"isolate", "torch", "pytorch_lightning.core", "matplotlib", "isolate.lightning"}
    assert import_report(loaded, ISOLATE) == [
        "isolate.lightning",
        "matplotlib",
        "pytorch_lightning",
    ]


@pytest.mark.parametrize(
    ("line", "allowed"),
    [
        ("from isolate import IsolationSpec, snapshot", True),  # in isolate.__all__
        ("from isolate import fingerprint", False),  # not in isolate.__all__
        ("from isolate import fingerprints", True),  # a public module of the toolkit
        ("from isolate.drift import Snapshot", True),
        ("from isolate.errors import SpecError", True),
        ("from isolate.spec import Thaw", True),  # in isolate.spec.__all__
        ("from isolate.spec.handle import IsolationHandle", True),  # the handle's
        ("from isolate.interop.leave import plain_checkpoint", True),
        ("from isolate.spec.plan import resolve", False),  # the spec's internals
        ("import isolate.spec.plan", False),
        ("from isolate.spec import plan", False),
        ("from isolate._autograd import walk", False),  # plumbing
        ("from isolate import _sharding", False),
        ("from isolate.freezing import _active", False),  # a private name
        ("from isolate.cli import main", False),  # an entry point
    ],
    ids=lambda case: case if isinstance(case, str) else None,
)
def test_an_integration_reaching_past_the_public_api_is_found(line: str, allowed: bool) -> None:
    module = "isolate.lightning.metrics"
    found = integration_report(_with(module, line))
    added = [f for f in found if _added(module, line) in f]
    assert len(added) == (0 if allowed else len(line.split(","))), found
