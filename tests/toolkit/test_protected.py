"""What the audits take as the parameters to protect: a value that names no parameters is
refused with its type and the forms that are accepted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isolate.errors import IsolationTypeError
from isolate.gradients import gradient_invariance


def test_a_value_that_names_no_parameters_is_refused_with_its_type() -> None:
    net = nn.Linear(2, 1)
    loss = net(torch.ones(1, 2)).sum()
    with pytest.raises(IsolationTypeError) as raised:
        gradient_invariance(loss, loss, 3.5)  # type: ignore[arg-type]
    assert str(raised.value) == (
        "gradient_invariance(): cannot tell which parameters float means; pass a module, "
        "parameters, (name, parameter) pairs, or selector strings with model="
    )
