"""Where ``warn_user`` points a warning: the first frame outside isolate, torch and
contextlib. (Deselected under mutmut, whose trampolines add a frame of their own.)"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

import pytest
import torch

import isolate
from isolate._text import warn_user
from isolate.errors import IsolationWarning


def _relay_from(path: str) -> Callable[[str], None]:
    """A function whose frame sits in ``path``, as a call inside that package would."""
    namespace: dict[str, Any] = {"warn_user": warn_user}
    exec(compile("def relay(message):\n    warn_user(message)\n", path, "exec"), namespace)
    return cast(Callable[[str], None], namespace["relay"])


@pytest.mark.parametrize("package", [isolate, torch, contextlib])
def test_a_warning_points_at_the_first_line_outside_isolate_torch_and_contextlib(
    package: ModuleType,
) -> None:
    where = os.path.join(os.path.dirname(os.path.abspath(str(package.__file__))), "_relay.py")
    if package is contextlib:
        where = os.path.abspath(str(contextlib.__file__))
    relay = _relay_from(where)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_user("said here")
        relay("said through a relay")
    assert [(type(w.message), str(w.message)) for w in caught] == [
        (IsolationWarning, "said here"),
        (IsolationWarning, "said through a relay"),
    ]
    assert [w.filename for w in caught] == [__file__, __file__]


def test_a_relay_outside_the_three_packages_is_the_users_line() -> None:
    relay = _relay_from(os.path.join(os.path.dirname(__file__), "_users_relay.py"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relay("said by the user's helper")
    assert [w.filename for w in caught] == [
        os.path.join(os.path.dirname(__file__), "_users_relay.py")
    ]
