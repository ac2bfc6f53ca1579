"""Thaw as data: every bad field of a step is refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from isolate import Thaw
from isolate.errors import SpecError


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"epoch": 1, "warmup_ratio": 0.1},
            r"needs exactly one of warmup_steps= or warmup_epochs=",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0, "warmup_steps": 2},
            r"warmup_ratio must be a number in \(0, 1\]",
        ),
        ({"epoch": 1, "warmup_steps": 2}, r"need warmup_ratio="),
        (
            {"epoch": 1, "warmup_ratio": 0.5},
            r"needs exactly one of warmup_steps= or warmup_epochs= \(the ramp's length\), "
            r"got neither$",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0.5, "warmup_steps": 2, "warmup_epochs": 1},
            r"\(the ramp's length\), got both$",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0.5, "warmup_steps": 2, "warmup_shape": "step"},
            r"warmup_shape must be",
        ),
        ({"epoch": 1, "align": True, "lr": 0.1}, r"align=True follows the lr of the group"),
        ({"monitor": "val", "patience": 0}, r"patience must be an integer >= 1"),
        ({"epoch": 1, "patience": 5}, r"\['patience'\] apply to monitor="),
        (
            {"epoch": 1, "min_delta": 0.1, "mode": "max", "carry_best": True},
            r"\['min_delta', 'mode', 'carry_best'\] apply to monitor=, which is not set$",
        ),
        ({"monitor": "val", "mode": "up"}, r"mode must be 'min' or 'max'"),
        ({}, r"give exactly one of epoch= or step= \(or monitor="),
    ],
)
def test_bad_thaw_fields_are_refused_by_name(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        Thaw.from_dict({"select": "0", **keys})


def test_a_bad_warmup_is_refused_naming_the_thaw() -> None:
    with pytest.raises(SpecError, match=r"^Thaw\('trunk'\): warmup_steps / warmup_epochs need "):
        Thaw("trunk", epoch=1, warmup_steps=2)


def test_a_warmup_ratio_of_one_is_allowed_and_above_one_is_not() -> None:
    thaw = Thaw("trunk", epoch=1, warmup_ratio=1.0, warmup_steps=2)
    assert thaw.warmup_ratio == 1.0
    with pytest.raises(SpecError, match=r"warmup_ratio must be a number in \(0, 1\], got 1\.5"):
        Thaw("trunk", epoch=1, warmup_ratio=1.5, warmup_steps=2)
