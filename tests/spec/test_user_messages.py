"""What a user sees: a warning points at the user's own line, and a number that YAML read as
a string is refused with the spelling that YAML reads as a number."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import yaml
from torch import nn

from isolate.errors import IsolationWarning, SpecError
from isolate.spec import IsolationSpec, Thaw


def test_the_attach_warning_points_at_the_users_line() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    handle = IsolationSpec(freeze=["0"]).apply(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # frozen parameters included
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            handle.attach(optimizer)
    finally:
        handle.restore()
    (warning,) = [w for w in caught if issubclass(w.category, IsolationWarning)]
    assert "took 2 frozen parameters out" in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, line)


@pytest.mark.parametrize(
    ("field", "text", "fix"),
    [
        ("lr", "1e-3", "1.0e-3"),
        ("lr", "5E-4", "5.0e-4"),
        ("min_delta", "1e-2", "1.0e-2"),
    ],
)
def test_a_yaml_string_number_gets_the_spelling_yaml_reads(field: str, text: str, fix: str) -> None:
    head = "select: a\nmonitor: val_loss\n"
    data = yaml.safe_load(f"{head}{field}: {text}\n")
    assert data[field] == text  # YAML 1.1 (PyYAML) reads it as a string
    with pytest.raises(
        SpecError, match=rf"got '{text}' \(YAML reads {text} as a string: write {fix}\)$"
    ):
        Thaw.from_dict(data)
    fixed = yaml.safe_load(f"{head}{field}: {fix}\n")
    assert isinstance(fixed[field], float)
    Thaw.from_dict(fixed)  # the spelling given is accepted


def test_a_string_that_is_no_number_gets_no_hint() -> None:
    with pytest.raises(SpecError) as error:
        Thaw.from_dict({"select": "a", "epoch": 1, "lr": "fast"})
    assert "YAML" not in str(error.value)
