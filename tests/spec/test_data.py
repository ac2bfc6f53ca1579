"""IsolationSpec as data: built from plain dicts and back, every bad field refused when the
spec is built, naming the field and the fix."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from isolate import IsolationSpec, Thaw
from isolate.errors import (
    SpecError,
)
from tests.spec._models import SPEC

pytestmark = pytest.mark.filterwarnings("ignore::isolate.IsolationWarning")


def test_from_dict_round_trips_and_names_typos() -> None:
    data = SPEC.to_dict()
    assert IsolationSpec.from_dict(data).to_dict() == data
    assert data["thaw"][0]["select"] == ["trunk.3"]
    with pytest.raises(
        SpecError, match=r"unknown keys \['detatch'\] \(did you mean 'detatch' -> 'detach'\?\)"
    ):
        IsolationSpec.from_dict({"detatch": ["aux"]})
    with pytest.raises(
        SpecError, match=r"from_dict\(\)\.freeze\[0\]: from_dict\(\) takes plain data .* got Linear"
    ):
        IsolationSpec.from_dict({"freeze": [nn.Linear(1, 1)]})
    with pytest.raises(SpecError, match=r"thaw\[0\] has unknown keys \['epochs'\]"):
        IsolationSpec.from_dict({"freeze": ["a"], "thaw": [{"select": "a", "epochs": 1}]})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"freeze": [""]}, r"^IsolationSpec: freeze must be a list of non-empty strings"),
        ({"bn": "frozen"}, r"^IsolationSpec: bn must be 'eval' or 'train', got 'frozen'"),
        ({"detach": ["a"], "clone": ["a"]}, r"\['a'\] are both in detach and clone"),
        ({"detach": ["a", "a"]}, r"detach lists \['a'\] twice"),
        ({"thaw": "trunk"}, r"thaw must be a list of Thaw steps"),
        ({"protect": ["aux"]}, r"protect must map loss names to selectors, got list"),
        (
            {"protect": {"aux": [3]}},
            r"^IsolationSpec: protect\['aux'\] must be a list of non-empty strings",
        ),
        ({"frozen_in_optimizer": "keep"}, r"frozen_in_optimizer must be 'remove' or 'error'"),
    ],
)
def test_bad_specs_are_refused_when_built(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        IsolationSpec(**kwargs)


def test_prefixed_exclusions_alone_start_from_the_prefix() -> None:
    spec = IsolationSpec(freeze=["!head"], thaw=[Thaw(["!trunk.0"], epoch=1)]).prefixed("net")
    assert spec.freeze == ("net", "!net.head")
    assert list(spec.thaw[0].select) == ["net", "!net.trunk.0"]
