"""What a certificate claims about each key, from a spec, rows and ties, on key names and
metadata alone (no file is read)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from isolate.certificates.checkpoint import TensorMeta
from isolate.certificates.claims import Claim, closest, load_spec, spec_claims, with_rows, with_ties
from isolate.errors import CertificateError, SelectorError
from isolate.spec.data import SpecData

F32 = TensorMeta(torch.float32, (4, 2))


def test_the_closest_names_are_the_three_best_or_nothing() -> None:
    names = ["layer.weight1", "layer.weight2", "layer.weight3", "layer.weight4"]
    assert closest("layer.weight", names) == (
        "; closest: ['layer.weight4', 'layer.weight3', 'layer.weight2']"
    )
    assert closest("layer.weight", ["zz", "yy"]) == ""


def test_a_spec_that_freezes_nothing_declares_every_float_key_trainable() -> None:
    metas = {"a.weight": F32, "b.weight": F32}
    claims = spec_claims(SpecData.from_dict({}), metas, where="base.pt")
    assert {k: (c.kind, c.source) for k, c in claims.items()} == {
        "a.weight": ("trainable", "not frozen by the spec"),
        "b.weight": ("trainable", "not frozen by the spec"),
    }


def test_a_thaw_or_buffer_selector_that_selects_no_key_names_the_keys_it_was_matched_to() -> None:
    metas = {"trunk.weight": F32, "head.weight": F32}
    thaw = SpecData.from_dict({"freeze": ["trunk"], "thaw": [{"select": "trunc", "epoch": 1}]})
    with pytest.raises(
        SelectorError,
        match=r"^certify\(\): 'trunc' matched none of the keys of base\.pt; closest: \['trunk",
    ):
        spec_claims(thaw, metas, where="base.pt")
    spec = SpecData.from_dict({"freeze": ["trunk"]})
    with pytest.raises(
        SelectorError,
        match=r"^certify\(\): 'type:BatchNorm2d' selects by module class, which the keys of "
        r"base\.pt do not tell",
    ):
        spec_claims(spec, metas, buffers=["type:BatchNorm2d"], where="base.pt")


def test_no_buffer_globs_declare_no_buffer() -> None:
    # An empty list picks every name in select_names: every key would be a buffer, the head
    # "free" (never checked to move) and the certificate clean.
    metas = {"trunk.weight": F32, "trunk.running_mean": F32, "head.weight": F32}
    claims = spec_claims(SpecData.from_dict({"freeze": ["trunk"]}), metas, buffers=[], where="b")
    assert {k: (c.kind, c.source) for k, c in claims.items()} == {
        "trunk.weight": ("frozen", "frozen by the spec"),
        "trunk.running_mean": ("frozen", "frozen by the spec"),
        "head.weight": ("trainable", "not frozen by the spec"),
    }


@pytest.mark.parametrize("bn", ["eval", "train"])
def test_the_statistics_of_a_frozen_layer_are_held_or_free_as_the_spec_s_bn_says(bn: str) -> None:
    metas = {
        "norm.weight": TensorMeta(torch.float32, (4,)),
        "norm.running_mean": TensorMeta(torch.float32, (4,)),
        "norm.num_batches_tracked": TensorMeta(torch.int64, ()),
        "head.running_var": TensorMeta(torch.float32, (4,)),
        "head.weight": F32,
    }
    claims = spec_claims(SpecData.from_dict({"freeze": ["norm"], "bn": bn}), metas, where="b.pt")
    statistics = (
        ("held", f"buffer of the frozen part (spec bn={bn!r})")
        if bn == "eval"
        else ("free", "spec bn='train': statistics of frozen layers update")
    )
    assert {k: (c.kind, c.source) for k, c in claims.items()} == {
        "norm.weight": ("frozen", "frozen by the spec"),
        "norm.running_mean": statistics,
        "norm.num_batches_tracked": statistics,
        "head.running_var": ("free", "buffer outside the frozen part"),
        "head.weight": ("trainable", "not frozen by the spec"),
    }


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_the_statistics_of_a_frozen_layer_follow_the_spec_s_mode_over_its_bn(mode: str) -> None:
    metas = {
        "norm.weight": TensorMeta(torch.float32, (4,)),
        "norm.running_mean": TensorMeta(torch.float32, (4,)),
        "head.weight": F32,
    }
    spec = SpecData.from_dict({"freeze": ["norm"], "mode": mode})  # bn left at 'eval'
    claim = spec_claims(spec, metas, where="b.pt")["norm.running_mean"]
    assert (claim.kind, claim.source) == (
        ("held", "buffer of the frozen part (spec mode='eval')")
        if mode == "eval"
        else ("free", "spec mode='train': statistics of frozen layers update")
    )


def test_rows_are_sorted_once_each_and_refused_word_for_word_where_they_cannot_be_claimed() -> None:
    metas = {"w": TensorMeta(torch.float32, (4, 2)), "n": TensorMeta(torch.int64, (4,))}
    metas["s"] = TensorMeta(torch.float32, ())
    claims: dict[str, Claim] = {}
    with_rows(claims, {"w": [3, 1, 1]}, metas, where="b.pt")
    assert claims == {"w": Claim("rows", "trainable rows", rows=(1, 3))}
    refused = {
        "x": "rows= names 'x', not a key of b.pt",
        "ww": "rows= names 'ww', not a key of b.pt; closest: ['w']",
        "n": "rows= names 'n' of b.pt, a int64[4] tensor; per-row claims need a "
        "floating-point tensor with rows",
        "s": "rows= names 's' of b.pt, a float32[] tensor; per-row claims need a "
        "floating-point tensor with rows",
    }
    for key, message in refused.items():
        with pytest.raises(CertificateError) as error:
            with_rows({}, {key: [0]}, metas, where="b.pt")
        assert str(error.value) == f"certify(): {message}"
    for rows in ([], [4], [-1], list(range(10))):
        with pytest.raises(CertificateError) as error:
            with_rows({}, {"w": rows}, metas, where="b.pt")
        assert str(error.value) == (
            f"certify(): rows= for 'w' must list row indices in [0, 4); got {rows[:8]}"
        )
    with_rows(claims, {"w": [0, 3]}, metas, where="b.pt")  # both ends
    assert claims["w"].rows == (0, 3)


def test_ties_are_refused_word_for_word_unless_two_keys_of_one_dtype_and_shape() -> None:
    metas = {
        "a": TensorMeta(torch.float32, (4,)),
        "b": TensorMeta(torch.float32, (4,)),
        "c": TensorMeta(torch.float16, (4,)),
    }
    assert with_ties([["a", "b"], ("b", "a")], metas, where="b.pt") == [("a", "b"), ("b", "a")]
    refused = {
        "ab": "a tie is a list of at least two keys, got 'ab', e.g. ['embed.weight', "
        "'head.weight']",
        ("a", "a"): "a tie is a list of at least two keys, got ('a', 'a'), e.g. "
        "['embed.weight', 'head.weight']",
        ("a", "bb"): "tie ['a', 'bb'] names 'bb', not a key of b.pt; closest: ['b']",
        ("a", "zz"): "tie ['a', 'zz'] names 'zz', not a key of b.pt",
        ("a", "c"): "tie ['a', 'c'] joins tensors of different dtype or shape in b.pt: "
        "['float32[4]', 'float16[4]']; tied tensors are one tensor",
    }
    for tie, message in refused.items():
        with pytest.raises(CertificateError) as error:
            with_ties([["a", "b"], tie], metas, where="b.pt")
        assert str(error.value) == f"certify(): {message}"


def test_a_spec_is_read_from_itself_its_dict_or_a_json_or_yaml_file(tmp_path: Path) -> None:
    spec = SpecData.from_dict({"freeze": ["trunk"]})
    assert load_spec(spec) is spec
    assert load_spec({"freeze": ["trunk"]}).freeze == spec.freeze
    (tmp_path / "spec.json").write_text(json.dumps({"freeze": ["trunk"]}))
    (tmp_path / "spec.yaml").write_text("freeze: [trunk]\n")
    assert load_spec(tmp_path / "spec.json").freeze == spec.freeze
    assert load_spec(str(tmp_path / "spec.yaml")).freeze == spec.freeze
    with pytest.raises(CertificateError) as error:
        load_spec(tmp_path / "nope.json")
    assert (
        str(error.value) == f"certify(): spec file {str(tmp_path / 'nope.json')!r} does not exist"
    )
    with pytest.raises(CertificateError) as error:
        load_spec(3)
    assert str(error.value) == (
        "certify(): spec must be an IsolationSpec, its dict, or a JSON/YAML file of it; got int"
    )


def test_without_pyyaml_a_json_spec_is_read_and_a_yaml_one_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "spec.yml").write_text("freeze: [trunk]\n")
    (tmp_path / "spec.json").write_text(json.dumps({"freeze": ["trunk"]}))
    monkeypatch.setitem(sys.modules, "yaml", None)  # the import fails
    assert load_spec(tmp_path / "spec.json").freeze == ("trunk",)  # JSON needs no PyYAML
    (tmp_path / "SPEC.JSON").write_text(json.dumps({"freeze": ["head"]}))
    assert load_spec(tmp_path / "SPEC.JSON").freeze == ("head",)  # whatever the case
    with pytest.raises(CertificateError) as error:
        load_spec(tmp_path / "spec.yml")
    assert str(error.value) == (
        "certify(): reading the YAML spec spec.yml needs PyYAML (pip install pyyaml), or give "
        "the spec as JSON"
    )
