"""The flag flip under freeze / unfreeze, its compile guard and the handles' numbering."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from isolate._flags import HandleSequence, check_params, outside_compile
from tests._launch import child_env


def test_only_parameters_and_tensors_of_torchs_own_types_are_plain() -> None:
    class Sub(nn.Parameter):
        pass

    model = nn.Linear(1, 1)
    both = {"w": nn.Parameter(torch.ones(1)), "t": torch.ones(1, requires_grad=True)}
    values, plain = check_params(model, "freeze()", both, False)  # type: ignore[arg-type]
    assert values == list(both.values()) and plain is True
    _, plain = check_params(model, "freeze()", {"w": Sub(torch.ones(1))}, False)
    assert plain is False


def test_handles_are_numbered_in_order_and_a_loaded_number_moves_the_count_past_it() -> None:
    seq = HandleSequence()
    assert [seq.take(), seq.take()] == [0, 1]
    seq.past(5)
    assert seq.take() == 6
    seq.past(3)  # an older number leaves the count alone
    assert seq.take() == 7


def _double(x: int) -> int:
    return 2 * x


def test_outside_compile_keeps_the_function_and_loads_no_compiler_until_called() -> None:
    guarded = outside_compile(_double)
    assert guarded is not _double and guarded.__wrapped__ is _double  # type: ignore[attr-defined]
    assert guarded(21) == 42
    # Decorating (as every flag flip of isolate is, at import) must not import the compiler.
    probe = (
        "import sys, isolate\n"
        "from isolate._flags import outside_compile\n"
        "guarded = outside_compile(lambda x: -x)\n"
        "print('torch._dynamo' in sys.modules, guarded(-3), 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=child_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "3", "True"]
