"""Finding and mapping the tensors nested in a structure: the one place that decides which
containers ``isolate`` can see into, and refuses the ones it cannot.

Handled: tensors; tuples, lists and dicts; named tuples; other mappings and list/tuple
subclasses that rebuild from their items; dataclass instances; ``types.SimpleNamespace``;
and every type registered as a pytree node with ``torch.utils._pytree.register_pytree_node``
(``OrderedDict``, ``defaultdict``, ``deque``, ``torch.return_types``, and the user's own).
An object of any other type that holds tensors (in its ``__dict__``, its slots, or anything
those hold) is refused with an :class:`~isolate.errors.IsolationTypeError`: its tensors would
otherwise go through untouched, and a ``Detached`` branch would silently send gradient
upstream through them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import io
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from isolate.errors import IsolationTypeError

__all__ = ["check_structure", "is_container", "iter_tensors", "map_tensors"]

# Types that never hold tensors: returned as they are, without a look inside.
_LEAVES: frozenset[type] = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        range,
        slice,
        type(Ellipsis),
        torch.Size,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    enum.Enum,
)
# How many objects the look into an unknown object may visit before it gives up and refuses.
_SCAN_BUDGET = 10_000

_FIX = (
    "register a flatten/unflatten rule with torch.utils._pytree.register_pytree_node("
    "{name}, flatten_fn, unflatten_fn) so that its tensors can be reached (a rule whose "
    "flatten_fn returns no children passes it through on purpose), or pass the tensors in a "
    "tuple, list, dict or dataclass"
)


def is_container(obj: object) -> bool:
    """Whether ``obj`` is a structure :func:`map_tensors` looks into."""
    return (
        isinstance(obj, (list, tuple, Mapping, types.SimpleNamespace))
        or type(obj) in pytree.SUPPORTED_NODES
        or (dataclasses.is_dataclass(obj) and not isinstance(obj, type))
    )


def check_structure(obj: object, caller: str) -> None:
    """Refuse a top-level ``obj`` that is neither a tensor nor a structure of tensors.

    Raises:
        IsolationTypeError: ``obj`` is a plain value (``"x"``, ``3``, ``None``), or an object
            that holds tensors where :func:`map_tensors` cannot reach them.
    """
    if isinstance(obj, torch.Tensor) or is_container(obj):
        return
    _refuse_if_holding(obj, caller)
    raise IsolationTypeError(
        f"{caller}: expected a tensor or a tuple/list/dict/dataclass of tensors (or a "
        f"registered pytree node), got {type(obj).__name__}; pass the tensor itself"
    )


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any, caller: str = "isolate") -> Any:
    """Apply ``fn`` to every tensor in ``obj`` and return the same structure.

    Each container is rebuilt with its own type; values that cannot hold tensors are returned
    as they are.

    Args:
        fn: applied to each tensor.
        obj: a tensor, or any structure the module docstring lists as handled.
        caller: how error messages name the caller.

    Raises:
        IsolationTypeError: ``obj`` contains an object that holds tensors where this function
            cannot reach them (an unregistered class, a set, an iterator).

    >>> map_tensors(lambda t: t * 2, {"a": (torch.ones(1), "tag")})
    {'a': (tensor([2.]), 'tag')}
    """
    # Fast path first: the wrappers call this on every forward, almost always with a tuple
    # of tensors and an empty dict.
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    cls = type(obj)
    if cls is tuple:
        return tuple([map_tensors(fn, item, caller) for item in obj])
    if cls is dict:
        return {key: map_tensors(fn, value, caller) for key, value in obj.items()}
    if cls is list:
        return [map_tensors(fn, item, caller) for item in obj]
    if cls in _LEAVES:
        return obj
    return _map_other(fn, obj, cls, caller)


def _map_other(fn: Callable[[torch.Tensor], Any], obj: Any, cls: type, caller: str) -> Any:
    node = pytree.SUPPORTED_NODES.get(cls)
    if node is not None:  # registered by torch or by the user: their rule decides
        children, context = node.flatten_fn(obj)
        return node.unflatten_fn([map_tensors(fn, c, caller) for c in children], context)
    if isinstance(obj, tuple) and pytree.is_namedtuple_class(cls):
        return cls(*[map_tensors(fn, item, caller) for item in obj])
    if cls is types.SimpleNamespace:
        return types.SimpleNamespace(
            **{key: map_tensors(fn, value, caller) for key, value in vars(obj).items()}
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]
        _refuse_extra_attributes(obj, names, caller)
        # copy.copy + object.__setattr__ also works for frozen dataclasses and init=False.
        new = copy.copy(obj)
        for name in names:
            object.__setattr__(new, name, map_tensors(fn, getattr(obj, name), caller))
        return new
    if isinstance(obj, (list, tuple, Mapping)):
        if isinstance(obj, Mapping):
            items: Any = {key: map_tensors(fn, value, caller) for key, value in obj.items()}
        else:
            items = [map_tensors(fn, item, caller) for item in obj]
        try:
            new = cls(items)
        except Exception as error:
            raise IsolationTypeError(
                f"{caller}: cannot rebuild {_name(cls)} from its mapped items "
                f"({type(error).__name__}: {error}); {_FIX.format(name=cls.__name__)}"
            ) from error
        _refuse_kept_originals(obj, new, caller)
        return new
    _refuse_if_holding(obj, caller)
    return obj


def iter_tensors(obj: Any, caller: str = "isolate") -> Iterator[torch.Tensor]:
    """Yield every tensor nested in ``obj``, depth first, in structure order.

    Raises:
        IsolationTypeError: as :func:`map_tensors`, for an object whose tensors it cannot
            reach.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    cls = type(obj)
    if cls is tuple or cls is list:
        for item in obj:
            yield from iter_tensors(item, caller)
    elif cls is dict:
        for value in obj.values():
            yield from iter_tensors(value, caller)
    elif cls not in _LEAVES:
        node = pytree.SUPPORTED_NODES.get(cls)
        if node is not None:
            for child in node.flatten_fn(obj)[0]:
                yield from iter_tensors(child, caller)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                yield from iter_tensors(item, caller)
        elif isinstance(obj, Mapping):
            for value in obj.values():
                yield from iter_tensors(value, caller)
        elif cls is types.SimpleNamespace:
            for value in vars(obj).values():
                yield from iter_tensors(value, caller)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            names = [f.name for f in dataclasses.fields(obj)]
            _refuse_extra_attributes(obj, names, caller)
            for name in names:
                yield from iter_tensors(getattr(obj, name), caller)
        else:
            _refuse_if_holding(obj, caller)


# ------------------------------------------------------------------------------------------
# Refusals: the slow path, taken only for objects of a type none of the rules above handle.


def _name(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _attributes(obj: object) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of an object's instance attributes: its ``__dict__`` and slots."""
    try:
        state = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        state = None
    if isinstance(state, dict):
        yield from state.items()
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            try:
                yield slot, object.__getattribute__(obj, slot)
            except AttributeError:  # an unset slot
                continue


def _tensors_held(obj: object) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """The tensors reachable from ``obj`` through containers and attributes, with the path
    to each; and whether the look gave up before seeing everything."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [("", obj)]
    budget = _SCAN_BUDGET
    while stack:
        path, item = stack.pop()
        if id(item) in seen or type(item) in _LEAVES or isinstance(item, _OPAQUE):
            continue
        seen.add(id(item))
        budget -= 1
        if budget < 0:
            return found, True
        if isinstance(item, torch.Tensor):
            found.append((path or "itself", item))
            continue
        children: list[tuple[str, object]] = []
        if isinstance(item, Mapping):
            # A mapping that cannot be iterated is looked at like any other object.
            with contextlib.suppress(Exception):
                children += [(f"{path}[{key!r}]", value) for key, value in item.items()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            children += [(f"{path}[{i}]", value) for i, value in enumerate(item)]
        children += [(f"{path}.{name}", value) for name, value in _attributes(item)]
        stack.extend(reversed(children))
    return found, False


def _refuse_if_holding(obj: object, caller: str) -> None:
    cls = type(obj)
    if isinstance(obj, Iterator) and not isinstance(obj, (torch.Tensor, io.IOBase)):
        raise IsolationTypeError(
            f"{caller}: got an iterator ({_name(cls)}); its tensors cannot be reached without "
            f"consuming it, so they cannot be detached or checked; pass a list or tuple"
        )
    found, gave_up = _tensors_held(obj)
    if not found and not gave_up:
        return
    if isinstance(obj, (set, frozenset)):
        fix = "pass a list or tuple instead (a set has no order to rebuild it in)"
    else:
        fix = _FIX.format(name=cls.__name__)
    if found:
        paths = ", ".join(path for path, _ in found[:3]) + (", ..." if len(found) > 3 else "")
        got = f"a {_name(cls)} holding {len(found)} tensor(s) at {paths}"
    else:
        got = f"a {_name(cls)} too large to look through ({_SCAN_BUDGET} objects)"
    raise IsolationTypeError(
        f"{caller}: cannot see into {_name(cls)}: expected tensors in a tuple, list, dict, "
        f"dataclass or registered pytree node, got {got}; those tensors would pass through "
        f"untouched (through Detached, gradient would leak upstream). Fix: {fix}"
    )


def _refuse_extra_attributes(obj: object, fields: list[str], caller: str) -> None:
    """A dataclass that keeps tensors outside its fields (set in ``__post_init__``, say)."""
    known = set(fields)
    extra = [(name, value) for name, value in _attributes(obj) if name not in known]
    if not extra:
        return
    held = [name for name, value in extra if _tensors_held(value)[0]]
    if held:
        cls = type(obj)
        raise IsolationTypeError(
            f"{caller}: the dataclass {_name(cls)} holds tensors in attributes that are not "
            f"fields ({held}), which are not reached; make them fields, or "
            f"{_FIX.format(name=cls.__name__)}"
        )


def _refuse_kept_originals(old: object, new: object, caller: str) -> None:
    """A rebuilt mapping or sequence subclass must not still hold the original tensors (in
    attributes its constructor copied over). Only subclasses get here: map_tensors maps a
    plain tuple, list or dict itself."""
    if not _attributes_hold_tensors(old):
        return
    originals = {id(t) for _, t in _tensors_held(old)[0]}
    kept = [path for path, t in _tensors_held(new)[0] if id(t) in originals]
    if kept:
        cls = type(old)
        raise IsolationTypeError(
            f"{caller}: {_name(cls)} rebuilt from its items still holds the original tensors "
            f"at {kept[:3]}, which are not reached; {_FIX.format(name=cls.__name__)}"
        )


def _attributes_hold_tensors(obj: object) -> bool:
    return any(_tensors_held(value)[0] for _, value in _attributes(obj))
