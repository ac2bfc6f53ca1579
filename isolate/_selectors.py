"""Turning selectors (modules, names, globs, predicates) into parameters and modules."""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import torch
from torch import nn

from isolate._holding import reads_training
from isolate._walker import Tree
from isolate.errors import IsolationTypeError, SelectorError

__all__ = [
    "Selection",
    "Selector",
    "check_module",
    "describe",
    "is_float",
    "select",
    "select_names",
]

Selector: TypeAlias = str | nn.Module | nn.Parameter | Callable[[str, nn.Parameter], bool]
"""What picks parameters out of a model.

* a module object that is part of the model: all its parameters;
* a dotted module name (``"trunk"``, ``"trunk.0"``) or an exact parameter name;
* a glob over parameter names (``"trunk.*"``, ``"*.bias"``);
* ``"type:<Class>"``: every parameter of every module whose class, or one of its base
  classes, is named ``<Class>`` (a glob over class names, several joined by ``|``:
  ``"type:BatchNorm2d|LayerNorm"``, ``"type:*Norm*"``, ``"type:_BatchNorm"``);
  ``"<module>/type:<Class>"`` looks only under module ``<module>`` (``"backbone/type:*Norm*"``);
* ``"!<selector>"``: an exclusion: what the string selector after ``!`` picks is taken out of
  what the other selectors pick (``["backbone", "!type:_BatchNorm"]``: the backbone but its
  BatchNorm layers). Exclusions alone start from the whole model (``["!head"]``);
* a parameter object of the model;
* a predicate ``fn(name, parameter) -> bool``.

Every selector must pick something, and an exclusion must take something out of what the
others pick: a typo is an error, not a silently different selection.
"""

_GLOB_CHARS = frozenset("*?[")
_TYPE = "type:"
_NOT = "!"
_SELECTOR_KINDS = (
    "a selector must be a module, a parameter, a name, a glob or a predicate "
    "fn(name, parameter) -> bool"
)


@dataclass
class Selection:
    """Parameters and BatchNorm modules picked out of a model, in model order, without repeats;
    with ``select(..., modes=True)`` also every module whose forward reads ``.training``, and
    with ``select(..., holders=True)`` every module that holds buffers."""

    params: dict[str, nn.Parameter] = field(default_factory=dict)
    norms: dict[str, nn.modules.batchnorm._BatchNorm] = field(default_factory=dict)
    modes: dict[str, nn.Module] = field(default_factory=dict)
    holders: dict[str, nn.Module] = field(default_factory=dict)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


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
    """Refuse a ``[`` that no ``]`` closes, or a ``]`` outside a class: brackets read as
    fnmatch reads them (a class runs from ``[``, then an optional ``!`` and a first ``]``
    that both belong to it, to the next ``]``), so ``[[]`` and ``[]]`` are literal brackets."""
    i = 0
    while i < len(pattern):
        if pattern[i] == "]":
            break
        if pattern[i] == "[":
            start = i + 1 + pattern.startswith("!", i + 1)
            i = pattern.find("]", start + pattern.startswith("]", start))
            if i < 0:
                break
        i += 1
    else:
        return
    raise SelectorError(
        f"{caller}: malformed glob {pattern!r}: unbalanced '[' / ']'; escape a literal '[' "
        f"as '[[]' and a literal ']' as '[]]', or remove it"
    )


def _glob_match(patterns: list[str]) -> Callable[[str], object]:
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


def _is_type(selector: object) -> bool:
    return isinstance(selector, str) and (selector.startswith(_TYPE) or "/" + _TYPE in selector)


def _is_glob(selector: object) -> bool:
    if not isinstance(selector, str) or _is_type(selector):
        return False
    return bool(_GLOB_CHARS & set(selector))


def _type_modules(
    model: nn.Module, selector: str, tree: Tree, caller: str
) -> list[tuple[str, nn.Module]]:
    """The modules a ``"[<module>/]type:<Class>"`` selector names (the scope included)."""
    scope, _, pattern = selector.rpartition(_TYPE)
    scope = scope.removesuffix("/")
    names = [p for p in pattern.split("|") if p]
    if not names or any(not re.fullmatch(r"[\w*?\[\]]+", p) for p in names):
        raise SelectorError(
            f"{caller}: {selector!r}: a type selector is 'type:<Class>' (a class name or a glob "
            f"over class names, several joined by '|'), e.g. 'type:BatchNorm2d|LayerNorm'"
        )
    match = _glob_match(names)
    if scope:
        try:
            model.get_submodule(scope)
        except AttributeError:
            raise SelectorError(
                f"{caller}: {selector!r}: {scope!r} is not a submodule of {describe(model)}; "
                f"give '<module>/type:<Class>' with a dotted module name"
            ) from None
    inside = scope + "."
    found = [
        (name, m)
        for name, m in tree.modules
        if (not scope or name == scope or name.startswith(inside))
        and any(match(c.__name__) for c in type(m).__mro__)
    ]
    if not found:
        present = sorted({type(m).__name__ for name, m in tree.modules})
        where = f"under {scope!r} of" if scope else "of"
        raise SelectorError(
            f"{caller}: {selector!r} matched no module {where} {type(model).__name__}; its "
            f"module types are {present} (a name matches the class or any base class)"
        )
    return found


def _match_one(
    model: nn.Module, selector: Selector, tree: Tree, module_ids: set[int], caller: str
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
        return {id(p) for p in Tree.of(selector).params}
    if isinstance(selector, str):
        if not selector:
            raise SelectorError(f"{caller}: empty selector ''; use a module name or a glob")
        if _is_type(selector):
            return {
                id(p)
                for _, m in _type_modules(model, selector, tree, caller)
                for p in Tree.of(m).params
            }
        inside = selector + "."  # a name; globs are matched in select(), all in one pass
        return {i for name, i in pairs if name == selector or name.startswith(inside)}
    if isinstance(selector, type):
        # A class is callable, but calling it with (name, parameter) builds an instance.
        hint = (
            f". To select every {selector.__name__} module, write 'type:{selector.__name__}'"
            if issubclass(selector, nn.Module)
            else ""
        )
        raise IsolationTypeError(
            f"{caller}: {_SELECTOR_KINDS}; got the class {selector.__name__} itself{hint}"
        )
    if callable(selector):
        return {id(p) for name, p in zip(tree.names, tree.params, strict=True) if selector(name, p)}
    raise IsolationTypeError(
        f"{caller}: {_SELECTOR_KINDS}; got {type(selector).__name__} {selector!r}"
    )


def _norms_covered(
    model: nn.Module,
    tree: Tree,
    selectors: tuple[Selector, ...],
    chosen: set[int],
    caller: str,
    candidate: Callable[[nn.Module], bool] = _is_norm,
) -> dict[str, nn.Module]:
    """The ``candidate`` layers (BatchNorm by default) a selection covers: all their
    parameters are selected, or (for layers without parameters: a BatchNorm without affine, a
    dropout) a module, name, type or glob selector covers their place."""
    under: set[int] = set()
    for selector in selectors:
        if isinstance(selector, nn.Module):
            under |= {id(m) for _, m in Tree.of(selector).modules}
        elif _is_type(selector):
            for _, m in _type_modules(model, str(selector), tree, caller):
                under |= {id(sub) for _, sub in Tree.of(m).modules}
    names = [s for s in selectors if isinstance(s, str) and not _is_type(s) and not _is_glob(s)]
    globs = [s for s in selectors if _is_glob(s)]
    glob = _glob_match([str(g) for g in globs]) if globs else None
    # A shared module goes by its first name, as its parameters do, but is covered by a
    # selector that reaches it under any of its names.
    first: dict[int, tuple[str, nn.Module]] = {}
    covered: set[int] = set()
    for name, module in tree.modules:
        if not candidate(module):
            continue
        first.setdefault(id(module), (name, module))
        if id(module) in covered:
            continue
        own = [p for p in module._parameters.values() if p is not None]
        base = name + "." if name else ""
        places = [base + b for b in module._buffers] or ([] if own else [name])
        if (
            not selectors
            or (own and all(id(p) in chosen for p in own))
            or id(module) in under
            or any(name == s or name.startswith(s + ".") for s in names)
            or (glob is not None and any(glob(place) for place in places))
        ):
            covered.add(id(module))
    return {name: module for i, (name, module) in first.items() if i in covered}


def _covered(
    model: nn.Module,
    tree: Tree,
    picking: tuple[Selector, ...],
    excluded: list[str],
    chosen: set[int],
    removed: set[int],
    caller: str,
    candidate: Callable[[nn.Module], bool],
) -> dict[str, nn.Module]:
    """The ``candidate`` layers the selection covers, net of what its exclusions cover."""
    found = _norms_covered(model, tree, picking, chosen, caller, candidate)
    if not excluded:
        return found
    out = _norms_covered(model, tree, tuple(excluded), removed, caller, candidate)
    return {
        n: m
        for n, m in found.items()
        if n not in out and not any(id(p) in removed for p in m.parameters(recurse=False))
    }


def _picked(model: nn.Module, selectors: tuple[Selector, ...], tree: Tree, caller: str) -> set[int]:
    """Ids of what the (positive) ``selectors`` pick together; each must pick something."""
    module_ids = {id(m) for _, m in tree.modules}
    globs = [str(s) for s in selectors if _is_glob(s)]
    chosen: set[int] = set()
    for selector in selectors:
        if _is_glob(selector):
            # Only whether it matches at all, which usually stops at the first name; what
            # the globs pick is gathered below in one pass for all of them.
            _check_glob(str(selector), caller)
            match = _glob_match([str(selector)])
            ids = {1} if any(match(name) for name in tree.names) else set()
        else:
            ids = _match_one(model, selector, tree, module_ids, caller)
        if not ids:
            shown = (
                selector
                if isinstance(selector, str)
                else getattr(selector, "__name__", type(selector).__name__)
            )
            hint = (
                "; a module name must name a submodule that has parameters"
                if isinstance(selector, str)
                else ""
            )
            raise SelectorError(
                f"{caller}: {shown!r} matched no parameter of {describe(model)}{hint}"
            )
        if not _is_glob(selector):
            chosen |= ids
    if globs:
        match = _glob_match(globs)
        chosen |= {i for name, i in zip(tree.names, tree.ids, strict=True) if match(name)}
    return chosen


def _split(selectors: tuple[Selector, ...], caller: str) -> tuple[tuple[Selector, ...], list[str]]:
    """The selectors that pick, and the bodies of the exclusions (``"!..."``)."""
    excluded = [s[1:] for s in selectors if isinstance(s, str) and s.startswith(_NOT)]
    for body in excluded:
        if not body or body.startswith(_NOT):
            raise SelectorError(
                f"{caller}: {_NOT + body!r} is not an exclusion; write '!' once, followed by "
                f"a module name, a glob or a type selector ('!head', '!type:BatchNorm2d')"
            )
    picking = tuple(s for s in selectors if not (isinstance(s, str) and s.startswith(_NOT)))
    return picking, excluded


def select(
    model: nn.Module,
    selectors: tuple[Selector, ...],
    caller: str,
    *,
    modes: bool = False,
    holders: bool = False,
) -> Selection:
    """Resolve ``selectors`` against ``model``; raise before anything is changed.

    With ``modes=True`` the selection also lists, in ``modes``, every module it covers whose
    behaviour depends on its mode (:func:`isolate._holding.reads_training`): what
    ``freeze(..., mode="eval")`` holds. With ``holders=True`` it lists, in ``holders``,
    every module it covers that holds buffers of its own, by the rule that covers a
    BatchNorm: all its own parameters are selected, or (a module without parameters, such
    as a constant table) a module, name, type or glob selector covers its place.

    No selector means the whole model, and so do exclusions alone. A selector that picks
    nothing, or an exclusion that takes nothing out, is an error that lists what the model
    holds.

    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    >>> list(select(net, ("!type:_BatchNorm",), "doc").params)
    ['0.weight', '0.bias', '2.weight', '2.bias']
    >>> list(select(net, ("type:BatchNorm*", "2.bias"), "doc").params)
    ['1.weight', '1.bias', '2.bias']
    >>> select(net, ("0", "!2"), "doc")
    Traceback (most recent call last):
    ...
    isolate.errors.SelectorError: doc: the exclusion '!2' takes nothing out of ['0'] ...
    """
    tree = Tree.of(model)
    picking, excluded = _split(selectors, caller)
    chosen = _picked(model, picking, tree, caller) if picking else set(tree.ids)
    removed: set[int] = set()
    of = [s if isinstance(s, str) else type(s).__name__ for s in picking]
    for body in excluded:
        ids = _picked(model, (body,), tree, caller)
        if not ids & chosen:  # never with exclusions alone: they start from everything
            raise SelectorError(
                f"{caller}: the exclusion {_NOT + body!r} takes nothing out of "
                f"{of} (it picks only parameters that are not selected); "
                f"remove it, or fix the name"
            )
        removed |= ids
    chosen -= removed
    if not tree.ids:
        raise SelectorError(
            f"{caller}: {describe(model)} has no parameters, so there is nothing to select; "
            f"pass the module that holds them"
        )
    if not chosen:
        raise SelectorError(
            f"{caller}: the exclusions {[_NOT + b for b in excluded]} take out everything "
            f"{of or 'the whole model'} selects; "
            f"nothing is left"
        )
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
    selection.params = {name: p for name, p, i in rows if i in chosen}
    args = (model, tree, picking, excluded, chosen, removed, caller)
    selection.norms.update(_covered(*args, _is_norm))  # type: ignore[arg-type]
    if modes:
        selection.modes = _covered(*args, reads_training)
    if holders:
        selection.holders = _covered(*args, _holds_buffers)
    return selection


def _holds_buffers(module: nn.Module) -> bool:
    return any(b is not None for b in module._buffers.values())


def is_float(p: torch.Tensor) -> bool:
    """Whether autograd can track ``p`` (only floating point and complex tensors)."""
    return p.is_floating_point() or p.is_complex()


def select_names(
    names: Sequence[str],
    selectors: Sequence[str],
    caller: str,
    *,
    where: str = "the names",
    each_must_match: bool = True,
) -> list[str]:
    """The names ``selectors`` pick out of ``names`` by name alone, with no model: the string
    grammar of :data:`Selector` (exact names, dotted prefixes, globs where ``*`` crosses dots,
    ``!`` exclusions) over a list such as a checkpoint's keys.

    No selector picks no name (where :func:`select` takes the whole model): an empty list
    of buffers, of keys to ignore or to freeze declares none. A ``type:`` selector needs the
    modules' classes, which names do not tell, and is refused.
    With ``each_must_match`` a selector that picks nothing, or an exclusion that takes
    nothing out, is an error naming the closest names; without it, it picks nothing.

    >>> keys = ["trunk.0.weight", "trunk.1.running_mean", "head.weight", "head.bias"]
    >>> select_names(keys, ["trunk", "*.bias"], "doc")
    ['trunk.0.weight', 'trunk.1.running_mean', 'head.bias']
    >>> select_names(keys, ["!head"], "doc")
    ['trunk.0.weight', 'trunk.1.running_mean']
    >>> select_names(keys, ["trunc"], "doc", where="the keys of base.pt")
    Traceback (most recent call last):
    ...
    isolate.errors.SelectorError: doc: 'trunc' matched none of the keys of base.pt; closest: ...
    """
    if not selectors:
        return []
    for selector in selectors:
        if not isinstance(selector, str) or not selector:
            raise SelectorError(
                f"{caller}: selectors of names must be non-empty strings, got {selector!r}"
            )
    split, excluded = _split(tuple(selectors), caller)
    picking = [str(s) for s in split]
    for selector in (*picking, *excluded):
        if _is_type(selector):
            raise SelectorError(
                f"{caller}: {selector!r} selects by module class, which {where} do not tell "
                f"(there is no model); select by name or glob instead ('trunk', '*.norm.*')"
            )
        if _is_glob(selector):
            _check_glob(selector, caller)

    def pick(selector: str) -> set[str]:
        if _is_glob(selector):
            match = _glob_match([selector])
            found = {n for n in names if match(n)}
        else:
            inside = selector + "."
            found = {n for n in names if n == selector or n.startswith(inside)}
        if not found and each_must_match:
            close = difflib.get_close_matches(selector, _prefixes(names), n=3, cutoff=0.5)
            hint = f"closest: {close}" if close else f"they start {sorted(names)[:5]}"
            raise SelectorError(f"{caller}: {selector!r} matched none of {where}; {hint}")
        return found

    chosen = set().union(*map(pick, picking)) if picking else set(names)
    removed: set[str] = set()
    for body in excluded:  # each checked against the picked names, in any order, as in select
        out = pick(body)
        # Never with exclusions alone: they start from every name, and pick refuses nothing.
        if each_must_match and not out & chosen:
            raise SelectorError(
                f"{caller}: the exclusion {_NOT + body!r} takes nothing out of "
                f"{picking} in {where}; remove it, or fix the name"
            )
        removed |= out
    return [n for n in names if n in chosen - removed]


def _prefixes(names: Sequence[str]) -> list[str]:
    """Every name and every dotted prefix of one: the candidates for a misspelt selector."""
    out: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        out.update((".".join(parts[:i]), None) for i in range(1, len(parts) + 1))
    return list(out)
