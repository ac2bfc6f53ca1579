"""Validation shared by the spec's data classes: numbers, selector lists, keys, plain data."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence

from isolate.errors import SpecError

__all__ = [
    "check_plain",
    "is_int",
    "number",
    "string_list",
    "under",
    "unknown_keys",
    "yaml_number_hint",
]


def number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def yaml_number_hint(value: object) -> str:
    """The fix for a number YAML read as a string: PyYAML (YAML 1.1) reads ``1e-3`` as the
    string ``'1e-3'``, and only ``1.0e-3`` as a float.

    >>> yaml_number_hint("1e-3")
    ' (YAML reads 1e-3 as a string: write 1.0e-3)'
    >>> yaml_number_hint(0.1), yaml_number_hint("fast")
    ('', '')
    """
    if not isinstance(value, str):
        return ""
    try:
        parsed = float(value)
    except ValueError:
        return ""
    mantissa, e, exponent = value.strip().lower().partition("e")
    fixed = f"{mantissa}.0e{exponent}" if e and "." not in mantissa else repr(parsed)
    return f" (YAML reads {value} as a string: write {fixed})"


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def string_list(value: object, what: str, caller: str = "IsolationSpec") -> tuple[str, ...]:
    """A selector argument as a tuple; a lone string is one selector, not its characters."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else _bad_strings(value, what, caller)
    if isinstance(value, Sequence) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    return _bad_strings(value, what, caller)


def _bad_strings(value: object, what: str, caller: str) -> tuple[str, ...]:
    raise SpecError(
        f"{caller}: {what} must be a list of non-empty strings (module names, parameter "
        f"names or globs), got {value!r}"
    )


def unknown_keys(keys: Sequence[str], known: Sequence[str], where: str) -> None:
    unknown = [k for k in keys if k not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        if close:
            hints.append(f"{key!r} -> {close[0]!r}")
    guess = f" (did you mean {', '.join(hints)}?)" if hints else ""
    raise SpecError(f"{where} has unknown keys {unknown}{guess}; the keys are {sorted(known)}")


_PLAIN = (str, int, float, bool, type(None))


def check_plain(value: object, where: str) -> None:
    """Refuse anything but the types YAML and JSON produce."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise SpecError(f"{where}: keys must be strings, got {k!r}")
            check_plain(v, f"{where}.{k}")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    raise SpecError(
        f"{where}: from_dict() takes plain data (str, int, float, bool, None, lists and "
        f"dicts), got {type(value).__name__}; build IsolationSpec(...) directly for objects"
    )


def under(prefix: str, selectors: Sequence[str]) -> list[str]:
    """``selectors`` for the model that holds theirs under ``prefix``."""

    def one(selector: str) -> str:
        if selector.startswith("!"):
            return "!" + one(selector[1:])
        if selector.startswith("type:"):
            return f"{prefix}/{selector}"
        return f"{prefix}.{selector}"

    out = [one(s) for s in selectors]
    if out and all(s.startswith("!") for s in out):
        out.insert(0, prefix)  # exclusions alone mean the whole (inner) model
    return out
