"""Mapping over tensors nested in tuples, lists, dicts and dataclasses."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["is_container", "iter_tensors", "map_tensors"]


def is_container(obj: object) -> bool:
    """Whether ``obj`` is a structure :func:`map_tensors` looks into."""
    return isinstance(obj, (list, tuple, Mapping)) or (
        dataclasses.is_dataclass(obj) and not isinstance(obj, type)
    )


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in ``obj`` and return the same structure.

    Lists, tuples (named ones included), mappings and dataclass instances are rebuilt with
    their own type; anything else that is not a tensor is returned as it is.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [map_tensors(fn, item) for item in obj]
    if isinstance(obj, tuple):
        items = [map_tensors(fn, item) for item in obj]
        if hasattr(obj, "_fields"):  # namedtuple: positional constructor
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, Mapping):
        mapped = {key: map_tensors(fn, value) for key, value in obj.items()}
        try:
            return type(obj)(mapped)  # type: ignore[call-arg]
        except TypeError:  # a mapping type with an unusual constructor
            return mapped
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # copy.copy + object.__setattr__ also works for frozen dataclasses and init=False fields.
        new = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(new, field.name, map_tensors(fn, getattr(obj, field.name)))
        return new
    return obj


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor nested in ``obj``, depth first, in structure order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))
