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


def test_a_spec_shows_only_what_differs_from_the_defaults() -> None:
    assert repr(IsolationSpec()) == "IsolationSpec()"
    assert repr(IsolationSpec(freeze=["trunk"])) == "IsolationSpec(freeze=['trunk'])"
    spec = IsolationSpec(
        freeze=["trunk"],
        detach=["aux"],
        bn="train",
        thaw=[Thaw("trunk.3", epoch=1, lr=0.01), Thaw("trunk.2", epoch=2)],
        protect={"aux": ["trunk"]},
        frozen_in_optimizer="error",
        mode="train",
        contracts=[{"kind": "teacher", "select": "trunk"}],
    )
    assert repr(spec) == (
        "IsolationSpec(freeze=['trunk'], detach=['aux'], bn='train', thaw=[trunk.3 at epoch 1, "
        "lr=0.01; trunk.2 at epoch 2], protect={'aux': ['trunk']}, frozen_in_optimizer='error', "
        "mode='train', contracts=['teacher:trunk'])"
    )


def test_protect_is_kept_by_loss_name_and_a_loss_that_protects_nothing_is_refused() -> None:
    assert IsolationSpec(protect={"aux": "trunk"}).protect == {"aux": ("trunk",)}
    with pytest.raises(SpecError) as refused:
        IsolationSpec(protect={"aux": ["trunk"], "main": []})
    assert str(refused.value) == (
        "IsolationSpec: protect['main'] select nothing; name what to protect"
    )


def test_from_dict_refuses_what_is_no_mapping_or_holds_unknown_keys_in_its_name() -> None:
    with pytest.raises(SpecError) as refused:
        IsolationSpec.from_dict(["freeze"])  # type: ignore[arg-type]
    assert str(refused.value) == (
        "IsolationSpec.from_dict(): expected a mapping of spec keys, got <class 'list'>"
    )
    with pytest.raises(SpecError) as refused:
        IsolationSpec.from_dict({"detatch": ["aux"]})
    assert str(refused.value).startswith("IsolationSpec.from_dict() has unknown keys ['detatch']")


@pytest.mark.parametrize("prefix", ["", "net.", 3, None])
def test_a_prefix_that_is_no_module_name_is_refused(prefix: object) -> None:
    with pytest.raises(SpecError) as refused:
        IsolationSpec(freeze=["trunk"]).prefixed(prefix)  # type: ignore[arg-type]
    assert str(refused.value) == (
        f"IsolationSpec.prefixed(): prefix must be a module name, got {prefix!r}"
    )


def test_prefixed_puts_the_prefix_before_every_branch() -> None:
    spec = IsolationSpec(detach=["aux"], clone=["probe", "head.1"]).prefixed("net")
    assert (spec.detach, spec.clone) == (("net.aux",), ("net.probe", "net.head.1"))


@pytest.mark.parametrize(
    "before",
    [
        Thaw("a", monitor="val", mode="max"),  # the same metric, in another mode
        Thaw("a", monitor="loss", mode="min"),  # the same mode, on another metric
    ],
)
def test_carry_best_needs_a_thaw_before_it_on_the_same_metric_and_mode(before: Thaw) -> None:
    carried = Thaw("b", monitor="val", mode="min", carry_best=True)
    with pytest.raises(SpecError) as refused:
        IsolationSpec(freeze=["a", "b"], thaw=[before, carried])
    assert str(refused.value) == (
        "IsolationSpec: thaw[1] ('b') has carry_best=True, but no thaw before it monitors "
        "'val' in mode 'min', so there is no best to carry; drop carry_best"
    )
    IsolationSpec(freeze=["a", "b"], thaw=[Thaw("a", monitor="val", mode="min"), carried])


UNKNOWN_THAW_KEYS = (
    "thaw[1] has unknown keys ['epochs'] (did you mean 'epochs' -> 'epoch'?); "
    "the keys are ['after_previous', 'align', 'bn', 'carry_best', 'epoch', 'lr', 'min_delta', "
    "'mode', 'monitor', 'name', 'optimizer_idx', 'patience', 'select', 'step', "
    "'warmup_epochs', 'warmup_ratio', 'warmup_shape', 'warmup_steps']"
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"detach": "x", "clone": [3]}, "clone must be a list of non-empty strings (module names, "
         "parameter names or globs), got [3]"),
        ({"bn": "frozen"}, "bn must be 'eval' or 'train', got 'frozen'"),
        ({"mode": "held"}, "mode must be 'eval', 'train' or null, got 'held'"),
        ({"mode": "eval", "bn": "train"}, "mode='eval' holds every mode-dependent layer of the "
         "frozen part in eval mode, BatchNorm included, but bn='train' lets BatchNorm train; "
         "drop one"),
        ({"thaw": "trunk"}, "thaw must be a list of Thaw steps (or mappings), got str"),
        ({"thaw": Thaw("a", epoch=1)}, "thaw must be a list of Thaw steps (or mappings), got Thaw"),
        ({"thaw": {"select": "a"}}, "thaw must be a list of Thaw steps (or mappings), got dict"),
        ({"thaw": 5}, "thaw must be a list of Thaw steps (or mappings), got int"),
        ({"freeze": ["a", "b"], "thaw": [Thaw("a", epoch=1, name="y"), Thaw("b", epoch=2, name="x"),
          Thaw("a", epoch=3, name="y"), Thaw("b", epoch=4, name="x")]},
         "thaw steps share the names ['x', 'y']; give each a distinct name="),
        ({"freeze": ["a"], "thaw": [{"select": "a", "epoch": 1}, {"select": "a", "epochs": 1}]},
         UNKNOWN_THAW_KEYS),
        ({"detach": ["b", "a"], "clone": ["a", "b"]}, "['a', 'b'] are both in detach and clone; "
         "a branch either gets gradient back (clone) or not (detach): pick one"),
        ({"detach": ["b", "a", "b", "a"]}, "detach lists ['a', 'b'] twice; list each branch once"),
        ({"clone": ["c", "b", "c"]}, "clone lists ['c'] twice; list each branch once"),
        ({"frozen_in_optimizer": "keep"},
         "frozen_in_optimizer must be 'remove' or 'error', got 'keep'"),
    ],
)  # fmt: skip
def test_a_bad_spec_is_refused_word_for_word(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as refused:
        IsolationSpec(**kwargs)
    assert str(refused.value) == f"IsolationSpec: {message}"


def test_the_fields_are_kept_as_tuples_and_train_is_a_mode() -> None:
    spec = IsolationSpec(
        freeze="trunk", detach=["aux"], clone=("probe",), mode="train", bn="train", thaw=None
    )
    assert (spec.freeze, spec.detach, spec.clone, spec.thaw) == (
        ("trunk",),
        ("aux",),
        ("probe",),
        (),
    )
    assert (spec.mode, spec.policy) == ("train", "train")
    assert (
        IsolationSpec(mode="eval").policy == "eval" and IsolationSpec(bn="train").policy == "train"
    )
    steps = IsolationSpec(freeze=["a"], thaw=({"select": "a", "epoch": 1},)).thaw
    assert steps == (Thaw("a", epoch=1),)
