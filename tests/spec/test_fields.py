"""The validation every spec data class shares: what counts as a number or an integer, how a
selector list is read, and the wording of each refusal."""

from __future__ import annotations

import math
from typing import Any

import pytest

from isolate.errors import SpecError
from isolate.spec._fields import (
    check_plain,
    is_int,
    number,
    string_list,
    under,
    unknown_keys,
    yaml_number_hint,
)


def test_a_number_is_a_finite_int_or_float_and_never_a_bool() -> None:
    assert [number(v) for v in (0, 3, -2.5, 1e300)] == [True] * 4
    assert [number(v) for v in (True, False, math.inf, -math.inf, math.nan, "1", None)] == [
        False
    ] * 7
    assert [is_int(v) for v in (0, -4, 7)] == [True] * 3
    assert [is_int(v) for v in (True, False, 1.0, "1", None)] == [False] * 5


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("1e-3", " (YAML reads 1e-3 as a string: write 1.0e-3)"),
        ("5E-4", " (YAML reads 5E-4 as a string: write 5.0e-4)"),
        ("2e5", " (YAML reads 2e5 as a string: write 2.0e5)"),
        (" 1e-3 ", " (YAML reads  1e-3  as a string: write 1.0e-3)"),
        ("1.5e-3", " (YAML reads 1.5e-3 as a string: write 0.0015)"),
        ("0.25", " (YAML reads 0.25 as a string: write 0.25)"),
        ("inf", " (YAML reads inf as a string: write inf)"),
        ("fast", ""),
        ("", ""),
        (0.001, ""),
        (None, ""),
    ],
)
def test_a_number_yaml_read_as_a_string_gets_the_spelling_to_write(value: Any, hint: str) -> None:
    assert yaml_number_hint(value) == hint


def test_a_selector_list_is_read_as_a_tuple_and_a_lone_string_as_one_selector() -> None:
    assert string_list(None, "freeze") == ()
    assert string_list([], "freeze") == ()
    assert string_list("trunk", "freeze") == ("trunk",)
    assert string_list(["a", "b.c"], "freeze") == ("a", "b.c")
    assert string_list(("a",), "freeze") == ("a",)


@pytest.mark.parametrize("value", ["", [""], ["a", ""], ["a", 3], 3, {"a"}, b"ab", [None]])
def test_anything_but_non_empty_strings_is_refused_naming_the_caller_and_field(value: Any) -> None:
    with pytest.raises(SpecError) as error:
        string_list(value, "detach", "Thaw('x')")
    assert str(error.value) == (
        "Thaw('x'): detach must be a list of non-empty strings (module names, parameter names "
        f"or globs), got {value!r}"
    )
    with pytest.raises(SpecError, match=r"^IsolationSpec: freeze must be a list"):
        string_list(value, "freeze")


def test_unknown_keys_are_named_with_the_closest_known_key_and_every_key() -> None:
    unknown_keys(["freeze", "detach"], ["freeze", "detach", "clone"], "spec")  # all known
    with pytest.raises(SpecError) as error:
        unknown_keys(["detatch", "freeze", "fraeze", "zzz"], ["freeze", "detach"], "spec")
    assert str(error.value) == (
        "spec has unknown keys ['detatch', 'fraeze', 'zzz'] (did you mean 'detatch' -> "
        "'detach', 'fraeze' -> 'freeze'?); the keys are ['detach', 'freeze']"
    )
    with pytest.raises(SpecError) as error:
        unknown_keys(["zzz"], ["freeze"], "thaw[1]")
    assert str(error.value) == "thaw[1] has unknown keys ['zzz']; the keys are ['freeze']"


def test_an_unknown_key_that_is_no_string_is_named_too() -> None:
    with pytest.raises(SpecError) as error:
        unknown_keys([1, "freeze"], ["freeze", "1x"], "spec")  # type: ignore[list-item]
    assert str(error.value) == (
        "spec has unknown keys [1] (did you mean 1 -> '1x'?); the keys are ['1x', 'freeze']"
    )


def test_plain_data_is_taken_at_any_depth() -> None:
    for value in ("a", 1, 1.5, True, None, [], {}, {"a": [1, {"b": (None, "c")}]}, ("x",)):
        check_plain(value, "spec")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1: "a"}, "spec: keys must be strings, got 1"),
        ({"a": {"b": {2: 0}}}, "spec.a.b: keys must be strings, got 2"),
        ([1, [2, object()]], "spec[1][1]: from_dict() takes plain data"),
        ({"a": [0, {"b": {1, 2}}]}, "spec.a[1].b: from_dict() takes plain data"),
        ((0, b"x"), "spec[1]: from_dict() takes plain data"),
    ],
)
def test_anything_but_plain_data_is_refused_where_it_is(value: Any, message: str) -> None:
    with pytest.raises(SpecError) as error:
        check_plain(value, "spec")
    assert str(error.value).startswith(message)


def test_an_object_is_refused_with_its_type_and_the_way_to_pass_it() -> None:
    with pytest.raises(SpecError) as error:
        check_plain({"freeze": [0.5, bytearray()]}, "from_dict()")
    assert str(error.value) == (
        "from_dict().freeze[1]: from_dict() takes plain data (str, int, float, bool, None, "
        "lists and dicts), got bytearray; build IsolationSpec(...) directly for objects"
    )


@pytest.mark.parametrize(
    ("selectors", "prefixed"),
    [
        ([], []),
        (["trunk", "head.0"], ["net.trunk", "net.head.0"]),
        (["type:Linear"], ["net/type:Linear"]),
        (["!head"], ["net", "!net.head"]),
        (["!head", "!type:BatchNorm2d"], ["net", "!net.head", "!net/type:BatchNorm2d"]),
        (["trunk", "!trunk.0"], ["net.trunk", "!net.trunk.0"]),
        (["!!x"], ["net", "!!net.x"]),
    ],
)
def test_selectors_under_a_prefix_name_the_same_parameters_of_the_outer_model(
    selectors: list[str], prefixed: list[str]
) -> None:
    assert under("net", selectors) == prefixed
