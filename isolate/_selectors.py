"""Turning selectors (modules, names, globs, predicates) into parameters and modules."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias, TypeGuard

import torch
from torch import nn

from isolate.errors import IsolationTypeError, SelectorError

__all__ = [
    "Protected",
    "Selection",
    "Selector",
    "check_module",
    "describe",
    "resolve_named",
    "select",
]

Selector: TypeAlias = str | nn.Module | nn.Parameter | Callable[[str, nn.Parameter], bool]
"""What picks parameters out of a model.

* a module object that is part of the model: all its parameters;
* a dotted module name (``"trunk"``, ``"trunk.0"``) or an exact parameter name;
* a glob over parameter names (``"trunk.*"``, ``"*.bias"``);
* a parameter object of the model;
* a predicate ``fn(name, parameter) -> bool``.
"""

_GLOB_CHARS = frozenset("*?[")


@dataclass
class Selection:
    """Parameters and BatchNorm modules picked out of a model, in model order, without repeats."""

    params: dict[str, nn.Parameter] = field(default_factory=dict)
    norms: dict[str, nn.modules.batchnorm._BatchNorm] = field(default_factory=dict)


def check_module(obj: object, caller: str, what: str = "model") -> nn.Module:
    """Return ``obj`` if it is a module, else raise a typed error naming ``caller``."""
    if not isinstance(obj, nn.Module):
        raise IsolationTypeError(
            f"{caller}: {what} must be a torch.nn.Module, got {type(obj).__name__}; "
            f"pass the module itself (e.g. model.backbone), not its output or its parameters"
        )
    return obj


def describe(model: nn.Module) -> str:
    """A short description of what a model holds, for error messages."""
    children = [name for name, _ in model.named_children()]
    return f"{type(model).__name__}; its children are {children}"


def _check_glob(pattern: str, caller: str) -> None:
    depth = 0
    for char in pattern:
        if char == "[":
            depth += 1
        elif char == "]" and depth:
            depth -= 1
    if depth or pattern.count("]") > pattern.count("["):
        raise SelectorError(
            f"{caller}: malformed glob {pattern!r}: unbalanced '[' / ']'; "
            f"escape a literal bracket as '[[]' or remove it"
        )


@dataclass
class _Tree:
    """One walk over a model: every parameter under every name it has, and every module."""

    names: list[str]
    params: list[nn.Parameter]
    modules: list[tuple[str, nn.Module]]
    ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ids = list(map(id, self.params))

    @classmethod
    def of(cls, model: nn.Module) -> _Tree:
        # A direct walk over ``_parameters`` / ``_modules``, in the order of
        # ``named_parameters()``: several times faster, since the generator machinery of
        # ``named_parameters()`` dominates on large models.
        names: list[str] = []
        params: list[nn.Parameter] = []
        modules: list[tuple[str, nn.Module]] = []
        stack: list[tuple[str, nn.Module]] = [("", model)]
        while stack:
            prefix, module = stack.pop()
            modules.append((prefix, module))
            base = prefix + "." if prefix else ""
            for name, p in module._parameters.items():
                if p is not None:
                    names.append(base + name)
                    params.append(p)
            children = module._modules
            if children:
                stack.extend(
                    (base + name, child)
                    for name, child in reversed(children.items())
                    if child is not None
                )
        return cls(names, params, modules)


def _glob_match(patterns: list[str]) -> Callable[[str], object]:
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


def _match_one(
    model: nn.Module, selector: Selector, tree: _Tree, module_ids: set[int], caller: str
) -> set[int]:
    """Ids of the parameters a non-glob ``selector`` picks (every alias of every parameter)."""
    pairs = zip(tree.names, tree.ids, strict=True)
    if isinstance(selector, nn.Parameter):
        ids = {id(p) for p in tree.params if p is selector}
        if not ids:
            raise SelectorError(
                f"{caller}: the parameter of shape {tuple(selector.shape)} passed as a selector "
                f"is not a parameter of {describe(model)}"
            )
        return ids
    if isinstance(selector, nn.Module):
        if id(selector) not in module_ids:
            raise SelectorError(
                f"{caller}: the {type(selector).__name__} passed as a selector is not a "
                f"submodule of {describe(model)}; pass one of its own modules or a name"
            )
        return {id(p) for p in _Tree.of(selector).params}
    if isinstance(selector, str):
        if not selector:
            raise SelectorError(f"{caller}: empty selector ''; use a module name or a glob")
        inside = selector + "."  # a name; globs are matched in select(), all in one pass
        return {i for name, i in pairs if name == selector or name.startswith(inside)}
    if callable(selector):
        return {id(p) for name, p in zip(tree.names, tree.params, strict=True) if selector(name, p)}
    raise IsolationTypeError(
        f"{caller}: a selector must be a module, a parameter, a name, a glob or a predicate "
        f"fn(name, parameter) -> bool; got {type(selector).__name__} {selector!r}"
    )


def _norms_covered(
    tree: _Tree, selectors: tuple[Selector, ...], chosen: set[int]
) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers a selection covers: all their parameters are selected, or (for
    layers without affine parameters) a module, name or glob selector covers their place."""
    under: set[int] = set()
    for selector in selectors:
        if isinstance(selector, nn.Module):
            under |= {id(m) for _, m in _Tree.of(selector).modules}
    names = [s for s in selectors if isinstance(s, str) and not _GLOB_CHARS & set(s)]
    globs = [s for s in selectors if isinstance(s, str) and _GLOB_CHARS & set(s)]
    glob = _glob_match(globs) if globs else None
    norms: dict[str, nn.modules.batchnorm._BatchNorm] = {}
    seen: set[int] = set()
    for name, module in tree.modules:
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or id(module) in seen:
            continue
        seen.add(id(module))
        own = [p for p in module._parameters.values() if p is not None]
        base = name + "." if name else ""
        if (
            not selectors
            or (own and all(id(p) in chosen for p in own))
            or id(module) in under
            or any(name == s or name.startswith(s + ".") for s in names)
            or (glob is not None and any(glob(base + b) for b in module._buffers))
        ):
            norms[name] = module
    return norms


def select(model: nn.Module, selectors: tuple[Selector, ...], caller: str) -> Selection:
    """Resolve ``selectors`` against ``model``; raise before anything is changed.

    No selector means the whole model. A selector that picks nothing is an error that lists
    what the model holds.
    """
    tree = _Tree.of(model)
    module_ids = {id(m) for _, m in tree.modules}
    globs = [s for s in selectors if isinstance(s, str) and _GLOB_CHARS & set(s)]
    chosen: set[int] = set()
    for selector in selectors:
        if isinstance(selector, str) and selector in globs:
            # Only whether it matches at all, which usually stops at the first name; what
            # the globs pick is gathered below in one pass for all of them.
            _check_glob(selector, caller)
            match = _glob_match([selector])
            ids = {1} if any(match(name) for name in tree.names) else set()
        else:
            ids = _match_one(model, selector, tree, module_ids, caller)
        if not ids:
            shown = selector if isinstance(selector, str) else getattr(selector, "__name__", "")
            hint = (
                "; a module name must name a submodule that has parameters"
                if isinstance(selector, str)
                else ""
            )
            raise SelectorError(
                f"{caller}: {shown!r} matched no parameter of {describe(model)}{hint}"
            )
        if not (isinstance(selector, str) and selector in globs):
            chosen |= ids
    if globs:
        match = _glob_match(globs)
        chosen |= {i for name, i in zip(tree.names, tree.ids, strict=True) if match(name)}
    selection = Selection()
    rows: Iterable[tuple[str, nn.Parameter, int]] = zip(
        tree.names, tree.params, tree.ids, strict=True
    )
    if len(set(tree.ids)) < len(tree.ids):
        # A shared parameter goes by the first name it has, as in named_parameters().
        first: dict[int, str] = {}
        for name, i in zip(tree.names, tree.ids, strict=True):
            first.setdefault(i, name)
        rows = [(n, p, i) for n, p, i in rows if first[i] == n]
    if selectors:
        selection.params = {name: p for name, p, i in rows if i in chosen}
    else:
        selection.params = {name: p for name, p, _ in rows}
    selection.norms.update(_norms_covered(tree, selectors, chosen))
    return selection


def is_float(p: torch.Tensor) -> bool:
    """Whether autograd can track ``p`` (only floating point and complex tensors)."""
    return p.is_floating_point() or p.is_complex()


_Item = (
    nn.Module | torch.Tensor | str | tuple[str, torch.Tensor] | Callable[[str, nn.Parameter], bool]
)
Protected = _Item | Mapping[str, torch.Tensor] | Iterable[_Item]
"""Which parameters to check.

* a module (all its parameters), or several modules;
* a mapping of names to parameters, or ``(name, parameter)`` pairs such as
  ``model.encoder.named_parameters()``;
* parameters, or an iterable of them such as ``model.encoder.parameters()``;
* with ``model=``: module names, globs over parameter names (``"encoder.*"``) and predicates
  ``fn(name, parameter) -> bool``, as in :func:`isolate.freeze`.

With ``model=`` every parameter is named by its qualified name in ``model`` (all names of a
tied parameter); without it, by its name in the module or pair that holds it.
"""


@dataclass(frozen=True)
class _Named:
    name: str
    tensor: torch.Tensor
    owner: str | None  # "'encoder.0' (Linear)" when it can be told


def _owner(root: nn.Module | None, name: str, prefix: str = "") -> str | None:
    if root is None:
        return None
    module_name = name.removeprefix(prefix).rpartition(".")[0]
    try:
        module = root.get_submodule(module_name)
    except AttributeError:
        return None
    shown = (prefix + module_name).rstrip(".") or "<root>"
    return f"{shown!r} ({type(module).__name__})"


def _split_items(target: object, caller: str) -> list[object]:
    if isinstance(target, (nn.Module, torch.Tensor, str)) or callable(target):
        return [target]
    if isinstance(target, Mapping):
        return list(target.items())
    if _is_pair(target):
        return [target]
    if isinstance(target, Iterable):
        return list(target)
    raise IsolationTypeError(
        f"{caller}: cannot tell which parameters {type(target).__name__} means; pass a "
        f"module, parameters, (name, parameter) pairs, or selector strings with model="
    )


def _is_pair(obj: object) -> TypeGuard[tuple[str, torch.Tensor]]:
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and isinstance(obj[0], str)
        and isinstance(obj[1], torch.Tensor)
    )


def resolve_named(target: object, model: nn.Module | None, caller: str) -> list[_Named]:
    """Turn a :data:`Protected` value into named tensors, every alias listed, no repeats."""
    if model is not None:
        check_module(model, caller)
    items = _split_items(target, caller)
    names_of: dict[int, list[str]] = {}
    if model is not None:
        for name, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
    several_modules = sum(isinstance(item, nn.Module) for item in items) > 1
    out: dict[str, _Named] = {}

    def add(name: str, tensor: torch.Tensor, owner: str | None) -> None:
        out.setdefault(name, _Named(name, tensor, owner))

    for index, item in enumerate(items):
        if isinstance(item, nn.Module):
            if model is not None:
                prefixes = [n for n, m in model.named_modules(remove_duplicate=False) if m is item]
                if not prefixes:
                    raise SelectorError(
                        f"{caller}: the {type(item).__name__} passed is not a submodule of "
                        f"{describe(model)}; pass one of its own modules, or leave out model="
                    )
                prefix = prefixes[0] + "." if prefixes[0] else ""
                for name, p in item.named_parameters(remove_duplicate=False):
                    for full in names_of.get(id(p), [prefix + name]):
                        add(full, p, _owner(model, full))
            else:
                prefix = f"[{index}]." if several_modules else ""
                for name, p in item.named_parameters(remove_duplicate=False):
                    add(prefix + name, p, _owner(item, prefix + name, prefix))
        elif isinstance(item, torch.Tensor):
            known = names_of.get(id(item))
            if known:
                for full in known:
                    add(full, item, _owner(model, full))
            else:
                add(f"<tensor #{index}, shape {tuple(item.shape)}>", item, None)
        elif _is_pair(item):
            name, tensor = item
            known = names_of.get(id(tensor), [])
            add(name, tensor, _owner(model, name) if name in known else None)
        elif isinstance(item, str) or callable(item):
            if model is None:
                raise IsolationTypeError(
                    f"{caller}: the selector {item!r} needs the model to resolve against; "
                    f"pass model=, or pass the module or parameters themselves"
                )
            selection = select(model, (item,), caller)
            for p in selection.params.values():
                for full in names_of[id(p)]:
                    add(full, p, _owner(model, full))
        else:
            raise IsolationTypeError(
                f"{caller}: item {index} is a {type(item).__name__}; expected a module, a "
                f"parameter, a (name, parameter) pair, or a selector string with model="
            )
    if not out:
        raise SelectorError(
            f"{caller}: {type(target).__name__} names no parameter to check, so the check "
            f"would pass whatever the loss does; pass modules that hold parameters, and "
            f"lists rather than generators (a generator is empty the second time)"
        )
    return list(out.values())
