"""How the experiments write numbers and records: one place for the report, the checks and
``run.json``.

>>> fmt(0.0), fmt(0.96875, ".3f"), fmt(None)
('0.0', '0.969', 'n/a')
>>> print(table(["run", "acc"], [["a|b", 0.5]]))
| run | acc |
| --- | --- |
| a\\|b | 0.5 |
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["fmt", "jsonable", "largest", "smallest", "table"]


def fmt(value: Any, spec: str = ".4f") -> str:
    """A number for a table: ``n/a`` for ``None``, an exact zero as ``0.0``, else ``spec``."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "0.0" if value == 0.0 else format(value, spec)
    return str(value)


def largest(values: Sequence[float | None], spec: str = ".3g") -> str:
    """The largest of ``values`` that is not ``None``, formatted; ``n/a`` if there is none."""
    numbers = [v for v in values if v is not None]
    return fmt(float(max(numbers)), spec) if numbers else "n/a"


def smallest(values: Sequence[float | None], spec: str = ".3g") -> str:
    """The smallest of ``values`` that is not ``None``, formatted; ``n/a`` if there is none."""
    numbers = [v for v in values if v is not None]
    return fmt(float(min(numbers)), spec) if numbers else "n/a"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; ``|`` and newlines inside cells are escaped."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types: tensors as lists, non-finite floats as strings,
    dataclasses as dicts, paths as strings, anything else as its ``repr``."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # a tensor, without importing torch
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return value.as_posix()
    if hasattr(value, "__dataclass_fields__"):
        return {f: jsonable(getattr(value, f)) for f in value.__dataclass_fields__}
    return repr(value)
