"""Thaw as data, field by field: the bounds of every number, the exact wording of every
refusal, what ``when``, ``due`` and ``extras`` say, and when two steps are the same step."""

from __future__ import annotations

import math
from typing import Any

import pytest

from isolate import Thaw
from isolate.errors import SpecError


def refusal(**keys: Any) -> str:
    with pytest.raises(SpecError) as error:
        Thaw("trunk", **keys)
    return str(error.value)


def test_the_defaults_are_the_documented_ones() -> None:
    thaw = Thaw("trunk", epoch=1)
    assert (thaw.bn, thaw.warmup_shape, thaw.align, thaw.patience, thaw.min_delta) == (
        "train",
        "linear",
        False,
        3,
        0.0,
    )
    assert (thaw.mode, thaw.carry_best, thaw.after_previous, thaw.lr, thaw.optimizer_idx) == (
        "min",
        False,
        0,
        None,
        None,
    )
    assert (thaw.warmup_ratio, thaw.warmup_steps, thaw.warmup_epochs, thaw.monitor) == (
        None,
        None,
        None,
        None,
    )
    assert thaw.extras() == {}


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"epoch": 1, "warmup_steps": 2},
            "warmup_steps / warmup_epochs need warmup_ratio= (the fraction of the lr to start "
            "from, e.g. 0.1)",
        ),
        (
            {"epoch": 1, "warmup_epochs": 2},
            "warmup_steps / warmup_epochs need warmup_ratio= (the fraction of the lr to start "
            "from, e.g. 0.1)",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0, "warmup_steps": 2},
            "warmup_ratio must be a number in (0, 1], got 0",
        ),
        (
            {"epoch": 1, "warmup_ratio": -0.5, "warmup_steps": 2},
            "warmup_ratio must be a number in (0, 1], got -0.5",
        ),
        (
            {"epoch": 1, "warmup_ratio": 1.01, "warmup_steps": 2},
            "warmup_ratio must be a number in (0, 1], got 1.01",
        ),
        (
            {"epoch": 1, "warmup_ratio": True, "warmup_steps": 2},
            "warmup_ratio must be a number in (0, 1], got True",
        ),
        (
            {"epoch": 1, "warmup_ratio": math.nan, "warmup_steps": 2},
            "warmup_ratio must be a number in (0, 1], got nan",
        ),
        (
            {"epoch": 1, "warmup_ratio": "1e-1", "warmup_steps": 2},
            "warmup_ratio must be a number in (0, 1], got '1e-1' (YAML reads 1e-1 as a string: "
            "write 1.0e-1)",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0.5},
            "warmup_ratio=0.5 needs exactly one of warmup_steps= or warmup_epochs= (the ramp's "
            "length), got neither",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0.5, "warmup_steps": 2, "warmup_epochs": 3},
            "warmup_ratio=0.5 needs exactly one of warmup_steps= or warmup_epochs= (the ramp's "
            "length), got both",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0.5, "warmup_steps": 0},
            "warmup_steps must be an integer >= 1, got 0",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0.5, "warmup_steps": 2.0},
            "warmup_steps must be an integer >= 1, got 2.0",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0.5, "warmup_epochs": 0},
            "warmup_epochs must be an integer >= 1, got 0",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0.5, "warmup_epochs": True},
            "warmup_epochs must be an integer >= 1, got True",
        ),
        (
            {"epoch": 1, "warmup_ratio": 0.5, "warmup_steps": 2, "warmup_shape": "step"},
            "warmup_shape must be 'linear', 'cosine' or 'exponential', got 'step' (a callable "
            "cannot come from a config; compose the shape in a LambdaLR of the optimizer "
            "instead)",
        ),
        ({"epoch": 1, "align": 1}, "align must be true or false, got 1"),
        (
            {"epoch": 1, "align": True, "lr": 0.25},
            "align=True follows the lr of the group the parameters came from, so lr=0.25 would "
            "be overridden; drop lr (start lower with warmup_ratio)",
        ),
    ],
)
def test_a_bad_ramp_is_refused_with_what_to_write(keys: dict[str, Any], message: str) -> None:
    assert refusal(**keys) == f"Thaw('trunk'): {message}"


@pytest.mark.parametrize(
    "keys",
    [
        {"warmup_ratio": 1, "warmup_steps": 1},
        {"warmup_ratio": 1e-9, "warmup_epochs": 1},
        {"warmup_ratio": 0.5, "warmup_steps": 3, "warmup_shape": "cosine"},
        {"warmup_ratio": 0.5, "warmup_epochs": 2, "warmup_shape": "exponential"},
        {"warmup_ratio": 0.5, "warmup_steps": 3, "align": True},
        {"align": False, "lr": 0.25},
    ],
)
def test_a_ramp_at_its_bounds_is_taken_as_given(keys: dict[str, Any]) -> None:
    thaw = Thaw("trunk", epoch=1, **keys)
    assert {k: getattr(thaw, k) for k in keys} == keys


@pytest.mark.parametrize("lengths", [{"warmup_steps": 0}, {"warmup_epochs": 0}])
def test_two_ramp_lengths_are_named_both_even_when_one_is_zero(lengths: dict[str, int]) -> None:
    both = {"warmup_steps": 4, "warmup_epochs": 2, **lengths}
    assert refusal(epoch=1, warmup_ratio=0.5, **both) == (
        "Thaw('trunk'): warmup_ratio=0.5 needs exactly one of warmup_steps= or warmup_epochs= "
        "(the ramp's length), got both"
    )


@pytest.mark.parametrize(
    ("lr", "shown"),
    [
        (0, "0"),
        (-1e-3, "-0.001"),
        (math.inf, "inf"),
        (math.nan, "nan"),
        (True, "True"),
        ("3e-4", "'3e-4' (YAML reads 3e-4 as a string: write 3.0e-4)"),
    ],
)
def test_an_lr_that_is_not_a_finite_positive_number_is_refused(lr: Any, shown: str) -> None:
    assert refusal(epoch=1, lr=lr) == (
        "Thaw('trunk'): lr must be a finite number > 0 or None (the settings of the group the "
        f"parameters came from), got {shown}"
    )


def test_the_smallest_positive_lr_and_none_are_taken() -> None:
    assert Thaw("trunk", epoch=1, lr=5e-324).lr == 5e-324
    assert Thaw("trunk", epoch=1, lr=None).lr is None


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"monitor": ""}, "monitor must be a metric name, got ''"),
        ({"monitor": 3}, "monitor must be a metric name, got 3"),
        ({"monitor": "val", "patience": 0}, "patience must be an integer >= 1, got 0"),
        ({"monitor": "val", "patience": 2.0}, "patience must be an integer >= 1, got 2.0"),
        ({"monitor": "val", "patience": True}, "patience must be an integer >= 1, got True"),
        ({"monitor": "val", "min_delta": -0.1}, "min_delta must be a number >= 0, got -0.1"),
        ({"monitor": "val", "min_delta": math.inf}, "min_delta must be a number >= 0, got inf"),
        (
            {"monitor": "val", "min_delta": "1e-2"},
            "min_delta must be a number >= 0, got '1e-2' (YAML reads 1e-2 as a string: write "
            "1.0e-2)",
        ),
        ({"monitor": "val", "mode": "up"}, "mode must be 'min' or 'max', got 'up'"),
        ({"monitor": "val", "carry_best": 1}, "carry_best must be true or false, got 1"),
        (
            {"epoch": 1, "after_previous": -1},
            "after_previous must be an integer >= 0 (epochs), got -1",
        ),
        (
            {"epoch": 1, "after_previous": 1.0},
            "after_previous must be an integer >= 0 (epochs), got 1.0",
        ),
        ({"epoch": 1, "patience": 5}, "['patience'] apply to monitor=, which is not set"),
        ({"epoch": 1, "min_delta": 0.5}, "['min_delta'] apply to monitor=, which is not set"),
        ({"epoch": 1, "mode": "max"}, "['mode'] apply to monitor=, which is not set"),
        ({"epoch": 1, "carry_best": True}, "['carry_best'] apply to monitor=, which is not set"),
        (
            {"epoch": 1, "patience": 1, "carry_best": True},
            "['patience', 'carry_best'] apply to monitor=, which is not set",
        ),
    ],
)
def test_a_bad_monitor_field_is_refused_by_name(keys: dict[str, Any], message: str) -> None:
    assert refusal(**keys) == f"Thaw('trunk'): {message}"


def test_monitor_fields_at_their_bounds_are_taken_as_given() -> None:
    keys = {"patience": 1, "min_delta": 0, "mode": "max", "carry_best": True}
    thaw = Thaw("trunk", monitor="val_acc", **keys)
    assert {k: getattr(thaw, k) for k in keys} == keys
    assert Thaw("trunk", epoch=1, after_previous=0).after_previous == 0
    assert Thaw("trunk", epoch=1, after_previous=2).after_previous == 2  # no monitor needed


@pytest.mark.parametrize(
    ("select", "keys", "message"),
    [
        ([], {"epoch": 1}, "Thaw([]): select is empty; name the parameters to thaw"),
        (
            "",
            {"epoch": 1},
            "Thaw(''): select must be a list of non-empty strings (module names, parameter "
            "names or globs), got ''",
        ),
        (
            ["a", 3],
            {"epoch": 1},
            "Thaw(['a', 3]): select must be a list of non-empty strings (module names, "
            "parameter names or globs), got ['a', 3]",
        ),
        (
            "a",
            {"epoch": 1, "step": 2},
            "Thaw('a'): give exactly one of epoch= or step= (or monitor=, with either as the "
            "latest), got both",
        ),
        (
            "a",
            {"epoch": 1, "step": 2, "monitor": "val"},
            "Thaw('a'): give exactly one of epoch= or step= (or monitor=, with either as the "
            "latest), got both",
        ),
        (
            ["a"],
            {},
            "Thaw(['a']): give exactly one of epoch= or step= (or monitor=, with either as the "
            "latest), got neither",
        ),
        ("a", {"epoch": -1}, "Thaw('a'): epoch must be an integer >= 0, got -1"),
        ("a", {"epoch": 1.0}, "Thaw('a'): epoch must be an integer >= 0, got 1.0"),
        ("a", {"step": -1}, "Thaw('a'): step must be an integer >= 0, got -1"),
        ("a", {"step": True}, "Thaw('a'): step must be an integer >= 0, got True"),
        (
            "a",
            {"epoch": 1, "optimizer_idx": -1},
            "Thaw('a'): optimizer_idx must be an integer >= 0, got -1",
        ),
        (
            "a",
            {"epoch": 1, "optimizer_idx": 1.0},
            "Thaw('a'): optimizer_idx must be an integer >= 0, got 1.0",
        ),
        (
            "a",
            {"epoch": 1, "bn": "frozen"},
            "Thaw('a'): bn must be 'train' or 'eval', got 'frozen'",
        ),
        ("a", {"epoch": 1, "name": ""}, "Thaw('a'): name must be a non-empty string, got ''"),
        ("a", {"epoch": 1, "name": 3}, "Thaw('a'): name must be a non-empty string, got 3"),
    ],
)
def test_a_bad_step_field_is_refused_naming_the_step(
    select: Any, keys: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError) as error:
        Thaw(select, **keys)
    assert str(error.value) == message


def test_step_fields_at_their_bounds_are_taken_as_given() -> None:
    assert (Thaw("a", epoch=0).epoch, Thaw("a", step=0).step) == (0, 0)
    assert Thaw("a", epoch=1, optimizer_idx=0).optimizer_idx == 0
    assert Thaw("a", epoch=1, bn="eval").bn == "eval"
    assert Thaw("a", monitor="val").when == "val plateau"
    assert Thaw(["a", "b.c"], step=3).name == "a+b.c"
    assert Thaw(["a", "b.c"], step=3, name="head").name == "head"
    assert Thaw("a", step=3).selectors == ("a",)
    assert Thaw(["a", "!a.0"], step=3).selectors == ("a", "!a.0")


def test_when_names_the_trigger_and_the_latest_time() -> None:
    assert Thaw("a", epoch=0).when == "epoch 0"
    assert Thaw("a", step=100).when == "step 100"
    assert Thaw("a", step=0, monitor="val_loss").when == "val_loss plateau (at the latest step 0)"
    assert Thaw("a", epoch=5, monitor="acc").when == "acc plateau (at the latest epoch 5)"


def test_a_step_is_due_from_its_epoch_or_its_step_on() -> None:
    by_epoch, by_step = Thaw("a", epoch=2), Thaw("a", step=10)
    assert [by_epoch.due(epoch=e, step=100) for e in (1, 2, 3)] == [False, True, True]
    assert [by_step.due(epoch=100, step=s) for s in (9, 10, 11)] == [False, True, True]
    assert Thaw("a", epoch=0).due(epoch=0, step=0)
    assert Thaw("a", step=0).due(epoch=0, step=0)
    watching = Thaw("a", monitor="val")
    assert not watching.due(epoch=1000, step=10**6)  # only the metric thaws it
    assert Thaw("a", monitor="val", epoch=3).due(epoch=3, step=0)


def test_extras_are_the_ramp_align_and_monitor_fields_set_away_from_their_defaults() -> None:
    ramp = {"warmup_ratio": 0.5, "warmup_steps": 4, "warmup_shape": "cosine", "align": True}
    monitor = {"monitor": "val", "patience": 2, "min_delta": 0.1, "mode": "max"}
    more = {"carry_best": True, "after_previous": 1}
    thaw = Thaw("a", epoch=1, optimizer_idx=0, bn="eval", name="n", **ramp, **monitor, **more)
    assert thaw.extras() == {**ramp, **monitor, **more}
    assert Thaw("a", step=1, lr=0.1, warmup_ratio=0.5, warmup_epochs=2).extras() == {
        "warmup_ratio": 0.5,
        "warmup_epochs": 2,
    }


def test_a_lone_string_and_its_one_element_list_are_the_same_step() -> None:
    one, listed = Thaw("trunk", epoch=1, lr=0.1), Thaw(["trunk"], epoch=1, lr=0.1)
    assert one == listed and hash(one) == hash(listed) and len({one, listed}) == 1
    # The hash reads the fields too: the steps of a schedule do not all share one bucket.
    assert hash(one) != hash(Thaw("head", epoch=1, lr=0.1))
    assert one != Thaw("trunk", epoch=1, lr=0.2)
    assert one != Thaw("trunk", epoch=2, lr=0.1)
    assert one != Thaw(["trunk", "head"], epoch=1, lr=0.1)
    assert one != Thaw("trunk", epoch=1, lr=0.1, name="other")
    assert one.__eq__("trunk") is NotImplemented
    assert one != "trunk"


def test_a_step_from_a_mapping_names_what_is_wrong() -> None:
    thaw = Thaw("a", epoch=1)
    assert Thaw.from_dict(thaw) is thaw  # type: ignore[arg-type]
    assert Thaw.from_dict({"select": ["a"], "step": 2, "lr": 0.5}) == Thaw("a", step=2, lr=0.5)
    with pytest.raises(SpecError) as error:
        Thaw.from_dict(["a"], where="thaw[3]")  # type: ignore[arg-type]
    assert str(error.value) == "thaw[3] must be a Thaw or a mapping with its keys, got list"
    with pytest.raises(SpecError) as error:
        Thaw.from_dict({"epoch": 1}, where="thaw[0]")
    assert str(error.value) == "thaw[0] has no 'select'; name what to thaw"
    with pytest.raises(SpecError) as error:
        Thaw.from_dict({"select": "a", "epoch": 1, "_": 0})
    keys = sorted(Thaw.__dataclass_fields__.keys() - {"_"})
    assert str(error.value) == f"thaw has unknown keys ['_']; the keys are {keys}"
    with pytest.raises(SpecError, match=r"^thaw\[2\] has unknown keys \['epochs'\] \(did you"):
        Thaw.from_dict({"select": "a", "epochs": 1}, where="thaw[2]")
