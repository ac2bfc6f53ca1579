"""What an audit protects: modules, parameters, named pairs or selectors, resolved to named
tensors (every name of a tied parameter)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeGuard

import torch
from torch import nn

from isolate._selectors import Selector, check_module, describe, select
from isolate.errors import IsolationTypeError, SelectorError

__all__ = ["Protected", "resolve_named"]

_Item = (
    nn.Module | torch.Tensor | str | tuple[str, torch.Tensor] | Callable[[str, nn.Parameter], bool]
)
Protected = _Item | Mapping[str, torch.Tensor] | Iterable[_Item]
"""Which parameters to check.

* a module (all its parameters), or several modules;
* a mapping of names to parameters, or ``(name, parameter)`` pairs such as
  ``model.encoder.named_parameters()``;
* parameters, or an iterable of them such as ``model.encoder.parameters()``;
* with ``model=``: selector strings and predicates ``fn(name, parameter) -> bool``, in the
  grammar of :data:`Selector` (names, globs, ``type:``, ``!`` exclusions), resolved together
  as in :func:`isolate.freeze`.

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


def _module_named(
    item: nn.Module,
    model: nn.Module | None,
    names_of: Mapping[int, list[str]],
    prefix: str,
    caller: str,
) -> Iterator[tuple[str, torch.Tensor, str | None]]:
    """The parameters of the module ``item`` as (name, tensor, owner): named as in ``model``
    (every alias) when given, else by ``prefix`` and their name in ``item``."""
    if model is None:
        for name, p in item.named_parameters(remove_duplicate=False):
            yield prefix + name, p, _owner(item, prefix + name, prefix)
        return
    if not any(m is item for m in model.modules()):
        raise SelectorError(
            f"{caller}: the {type(item).__name__} passed is not a submodule of "
            f"{describe(model)}; pass one of its own modules, or leave out model="
        )
    for p in item.parameters():  # a submodule's parameters are the model's: every alias
        for full in names_of[id(p)]:
            yield full, p, _owner(model, full)


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
    selectors: list[Selector] = []

    def add(name: str, tensor: torch.Tensor, owner: str | None) -> None:
        out.setdefault(name, _Named(name, tensor, owner))

    for index, item in enumerate(items):
        if isinstance(item, nn.Module):
            prefix = f"[{index}]." if several_modules else ""
            for name, tensor, owner in _module_named(item, model, names_of, prefix, caller):
                add(name, tensor, owner)
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
            selectors.append(item)  # resolved together: an exclusion applies to the others
        else:
            raise IsolationTypeError(
                f"{caller}: item {index} is a {type(item).__name__}; expected a module, a "
                f"parameter, a (name, parameter) pair, or a selector string with model="
            )
    if selectors and model is not None:
        for p in select(model, tuple(selectors), caller).params.values():
            for full in names_of[id(p)]:
                add(full, p, _owner(model, full))
    if not out:
        raise SelectorError(
            f"{caller}: {type(target).__name__} names no parameter to check, so the check "
            f"would pass whatever the loss does; pass modules that hold parameters, and "
            f"lists rather than generators (a generator is empty the second time)"
        )
    return list(out.values())
