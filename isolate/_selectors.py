"""Turning selectors (modules, names, globs, predicates) into parameters and modules."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeAlias

import torch
from torch import nn

from isolate.errors import IsolationTypeError, SelectorError

__all__ = ["Selection", "Selector", "check_module", "describe", "select"]

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


def _match_one(
    model: nn.Module,
    selector: Selector,
    named: list[tuple[str, nn.Parameter]],
    caller: str,
) -> set[int]:
    """Ids of the parameters ``selector`` picks (``named`` lists every alias of every one)."""
    if isinstance(selector, nn.Parameter):
        ids = {id(p) for _, p in named if p is selector}
        if not ids:
            raise SelectorError(
                f"{caller}: the parameter of shape {tuple(selector.shape)} passed as a selector "
                f"is not a parameter of {describe(model)}"
            )
        return ids
    if isinstance(selector, nn.Module):
        if not any(m is selector for m in model.modules()):
            raise SelectorError(
                f"{caller}: the {type(selector).__name__} passed as a selector is not a "
                f"submodule of {describe(model)}; pass one of its own modules or a name"
            )
        return {id(p) for p in selector.parameters()}
    if isinstance(selector, str):
        if not selector:
            raise SelectorError(f"{caller}: empty selector ''; use a module name or a glob")
        if _GLOB_CHARS & set(selector):
            _check_glob(selector, caller)
            return {id(p) for name, p in named if fnmatch.fnmatchcase(name, selector)}
        exact = {id(p) for name, p in named if name == selector}
        if exact:
            return exact
        try:
            sub = model.get_submodule(selector)
        except AttributeError:
            return set()
        return {id(p) for p in sub.parameters()}
    if callable(selector):
        return {id(p) for name, p in named if selector(name, p)}
    raise IsolationTypeError(
        f"{caller}: a selector must be a module, a parameter, a name, a glob or a predicate "
        f"fn(name, parameter) -> bool; got {type(selector).__name__} {selector!r}"
    )


def _norm_selected(
    name: str,
    module: nn.modules.batchnorm._BatchNorm,
    selectors: Iterable[Selector],
    chosen: set[int],
    model: nn.Module,
) -> bool:
    own = [p for p in module.parameters(recurse=False)]
    if own and all(id(p) in chosen for p in own):
        return True
    # A BatchNorm without affine parameters is picked by whatever covers its place in the tree.
    for selector in selectors:
        if isinstance(selector, nn.Module) and any(m is module for m in selector.modules()):
            return True
        if isinstance(selector, str):
            if _GLOB_CHARS & set(selector):
                buffers = [f"{name}.{b}" if name else b for b, _ in module.named_buffers()]
                if any(fnmatch.fnmatchcase(b, selector) for b in buffers):
                    return True
            elif name == selector or name.startswith(selector + "."):
                return True
    return False


def select(model: nn.Module, selectors: tuple[Selector, ...], caller: str) -> Selection:
    """Resolve ``selectors`` against ``model``; raise before anything is changed.

    No selector means the whole model. A selector that picks nothing is an error that lists
    what the model holds.
    """
    named = list(model.named_parameters(remove_duplicate=False))
    chosen: set[int] = set()
    for selector in selectors:
        ids = _match_one(model, selector, named, caller)
        if not ids:
            shown = selector if isinstance(selector, str) else getattr(selector, "__name__", "")
            raise SelectorError(
                f"{caller}: {shown!r} matched no parameter of {describe(model)}"
                + (
                    "; a module name must name a submodule that has parameters"
                    if isinstance(selector, str)
                    else ""
                )
            )
        chosen |= ids
    if not selectors:
        chosen = {id(p) for _, p in named}
    selection = Selection()
    for name, p in model.named_parameters():
        if id(p) in chosen:
            selection.params[name] = p
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
            not selectors or _norm_selected(name, module, selectors, chosen, model)
        ):
            selection.norms[name] = module
    return selection


def is_float(p: torch.Tensor) -> bool:
    """Whether autograd can track ``p`` (only floating point and complex tensors)."""
    return p.is_floating_point() or p.is_complex()
