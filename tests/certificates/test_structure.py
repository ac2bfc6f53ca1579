"""Verdicts across keys, on fingerprints alone: keys renamed (by equal values first, then by
the closest name of one dtype and shape), missing or unexpected with their closest names, and
the source of each tie."""

from __future__ import annotations

from pathlib import Path

import torch

from isolate.certificates import certify
from isolate.certificates.certificate import Verdict
from isolate.certificates.checkpoint import TensorMeta
from isolate.certificates.structure import key_verdicts, tie_verdicts
from tests.certificates._data import pair

META = TensorMeta(torch.float32, (4,))


def _present(
    missing: list[str], unexpected: list[str], prints: dict[str, int], metas: dict | None = None
) -> dict[str, tuple[str, str]]:
    """key -> (finding, detail) of ``key_verdicts``; every key is float32[4] unless ``metas``."""
    every = {k: META for k in [*missing, *unexpected]} | (metas or {})
    verdicts = key_verdicts(missing, unexpected, prints, prints, (every, every))
    assert all(v.claim == "present" and v.ok is False for v in verdicts)
    return {v.key: (v.finding, v.detail) for v in verdicts}


def test_a_key_renamed_with_its_values_is_found_however_different_its_new_name() -> None:
    found = _present(["trunk.0.bias"], ["zz"], {"trunk.0.bias": 1, "zz": 1})
    assert found == {"trunk.0.bias": ("renamed to 'zz'", "bitwise the same values")}


def test_a_key_renamed_with_new_values_needs_a_close_name() -> None:
    far = _present(["trunk.0.bias"], ["zz"], {"trunk.0.bias": 1, "zz": 2})
    assert far == {
        "trunk.0.bias": ("missing from the tuned checkpoint", ""),
        "zz": ("not in the base checkpoint", ""),
    }


def test_after_a_rename_by_values_the_later_keys_are_still_matched_by_name() -> None:
    # "a.bias" is found by its values in the first round; "b.weight", after it, by its name
    prints = {"a.bias": 1, "x.bias": 1, "b.weight": 2, "b.weight2": 3}
    found = _present(["a.bias", "b.weight"], ["x.bias", "b.weight2"], prints)
    assert found == {
        "a.bias": ("renamed to 'x.bias'", "bitwise the same values"),
        "b.weight": ("renamed to 'b.weight2'?", "same dtype and shape; values differ"),
    }


def test_one_new_key_is_the_rename_of_one_missing_key_only() -> None:
    # two base keys with equal values (copies), one of them renamed: the other is missing
    prints = {"a.weight": 1, "b.weight": 1, "c.weight": 1}
    found = _present(["a.weight", "b.weight"], ["c.weight"], prints)
    assert found == {
        "a.weight": ("renamed to 'c.weight'", "bitwise the same values"),
        "b.weight": ("missing from the tuned checkpoint", "closest unexpected keys: ['c.weight']"),
    }
    # and by name: a.weight takes a.weight2, b.weight is left without it
    prints = {"a.weight": 1, "b.weight": 2, "a.weight2": 3}
    found = _present(["a.weight", "b.weight"], ["a.weight2"], prints)
    assert found["b.weight"][0] == "missing from the tuned checkpoint"


def test_keys_in_one_file_only_name_up_to_three_closest_keys_of_the_other() -> None:
    missing = ["layer.weight"]
    unexpected = ["layer.weight1", "layer.weight2", "layer.weight3", "layer.weight4"]
    other = {k: TensorMeta(torch.float16, (4,)) for k in unexpected}  # no rename: another dtype
    prints = {k: i for i, k in enumerate([*missing, *unexpected])}
    found = _present(missing, unexpected, prints, other)
    assert found["layer.weight"] == (
        "missing from the tuned checkpoint",
        "closest unexpected keys: ['layer.weight4', 'layer.weight3', 'layer.weight2']",
    )
    assert found["layer.weight4"] == (
        "not in the base checkpoint",
        "closest missing keys: ['layer.weight']",
    )
    missing, unexpected = unexpected, missing  # the other way round
    prints = {k: i for i, k in enumerate([*missing, *unexpected])}
    found = _present(missing, unexpected, prints, {k: other[k] for k in missing})
    assert found["layer.weight"] == (
        "not in the base checkpoint",
        "closest missing keys: ['layer.weight4', 'layer.weight3', 'layer.weight2']",
    )
    assert found["layer.weight1"] == (
        "missing from the tuned checkpoint",
        "closest unexpected keys: ['layer.weight']",
    )


def test_a_detected_tie_is_sourced_to_the_base_and_a_declared_one_to_the_declaration(
    tmp_path: Path,
) -> None:
    base = {"embed.weight": torch.arange(6.0), "out.weight": torch.arange(6.0)}
    files = pair(tmp_path, "safetensors", base, base)
    detected = certify(*files, rows={"embed.weight": [0]})
    tie = detected.verdict("embed.weight = out.weight")
    assert (tie.ok, tie.finding, tie.source) == (True, "still tied", "equal in the base")
    declared = certify(*files, ties=[["embed.weight", "out.weight"]])
    tie = declared.verdict("embed.weight = out.weight")
    assert (tie.ok, tie.finding, tie.source) == (True, "still tied", "declared")


def test_each_tie_group_gets_its_verdict_after_one_with_a_member_missing_or_still_tied() -> None:
    groups = [("a", "b"), ("c", "d"), ("e", "f")]
    base = {"a": 1, "b": 1, "c": 2, "d": 2, "e": 3, "f": 4}
    tuned = {"a": 1, "c": 5, "d": 5, "e": 3, "f": 4}  # b is gone; c and d moved together
    verdicts = tie_verdicts(groups, [("c", "d")], base, tuned, None)  # type: ignore[arg-type]
    assert verdicts == [
        Verdict(
            "a = b",
            "tied",
            None,
            "fewer than two members in the tuned file",
            "",
            "equal in the base",
        ),
        Verdict("c = d", "tied", True, "still tied", "", "declared"),
        Verdict("e = f", "tied", False, "not tied in the base", "", "equal in the base"),
    ]
