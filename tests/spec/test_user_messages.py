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


def test_a_quoted_number_gets_the_number_to_write() -> None:
    data = yaml.safe_load('select: a\nepoch: 1\nlr: "0.001"\n')
    with pytest.raises(
        SpecError, match=r"got '0\.001' \(YAML reads 0\.001 as a string: write 0\.001\)$"
    ):
        Thaw.from_dict(data)


def test_a_string_that_is_no_number_gets_no_hint() -> None:
    with pytest.raises(SpecError) as error:
        Thaw.from_dict({"select": "a", "epoch": 1, "lr": "fast"})
    assert "YAML" not in str(error.value)


def test_the_tally_adds_up_what_each_verify_checked() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    spec = IsolationSpec(freeze=["0"], thaw=[Thaw("0", step=2, lr=0.01)])
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    handle = spec.apply(model, optimizer)
    try:
        for step in range(3):
            handle.step(epoch=0, step=step)
            loss = model(torch.randn(4, 2)).sum()
            handle.verify(total=loss)
        with torch.no_grad():
            model[1].weight.add_(1.0)  # trainable: no drift check watches it
        handle.verify(checks=("drift",))
    finally:
        handle.restore()
    tally = handle.tally
    assert tally.runs == 4
    assert tally.times == {"params": 3, "reach": 3, "drift": 4, "flags": 3, "optimizers": 3}
    assert tally.last["params"].params == 2  # the frozen layer's weight and bias
    assert tally.last["reach"].reach == 4  # after the thaw: all four parameters trainable
    assert tally.last["flags"].flags == 0
    text = str(tally)
    assert text.startswith("verify ran 4 times; every check passed:\n")
    assert "  reach (3x): the loss backpropagated reached each of 4 trainable parameters" in text
    assert "  params (3x): 2 parameters of the spec were still the objects the model holds" in text
    assert "losses" not in text and "ranks" not in text  # nothing to look at: not counted
