"""``certify()`` itself: which claims it makes from its arguments, how it opens each file, and
what it records of them in the certificate."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
import xxhash

from isolate.certificates import certify
from isolate.errors import CertificateError, CheckpointReadError, SelectorError
from tests.certificates._data import (
    SPEC,
    base_state,
    lora_adapter,
    lora_base,
    lora_config,
    merged,
    pair,
    trained,
    write_lora,
)


def test_rows_alone_claim_their_rows_and_leave_every_other_key_free(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["trunk.0.weight"][2] += 1
    cert = certify(*pair(tmp_path, "torch", tuned), rows={"trunk.0.weight": [2]})
    assert cert.clean, str(cert)
    assert cert.verdict("trunk.0.weight").claim == "rows"
    head = cert.verdict("head.weight")
    assert (head.claim, head.ok, head.finding, head.source) == ("free", None, "moved", "no claim")
    with pytest.raises(CertificateError) as error:
        certify(*pair(tmp_path, "torch", tuned), rows={"trunk.1.num_batches_tracked": [0]})
    assert str(error.value) == (
        "certify(): rows= names 'trunk.1.num_batches_tracked' of base.pt, a int64[] tensor; "
        "per-row claims need a floating-point tensor with rows"
    )


def test_buffer_globs_reach_the_claims_of_a_spec_and_of_an_adapter(tmp_path: Path) -> None:
    cert = certify(*pair(tmp_path, "torch", trained(base_state())), spec=SPEC, buffers=["*.bias"])
    assert cert.verdict("head.bias").source == "buffer outside the frozen part"
    assert cert.verdict("trunk.1.running_mean").source == "frozen by the spec"
    adapter = lora_adapter()
    paths = write_lora(tmp_path, merged(lora_base(), adapter), adapter)
    lora = certify(
        paths["base"],
        paths["tuned"],
        adapter_config=paths["config"],
        adapter=paths["adapter"],
        buffers=["lm_head.*"],
    )
    assert lora.verdict("lm_head.weight").claim == "held"
    assert lora.verdict("model.layers.0.k_proj.weight").claim == "frozen"


def test_an_adapter_config_is_refused_in_the_base_files_name(tmp_path: Path) -> None:
    adapter = lora_adapter()
    paths = write_lora(tmp_path, merged(lora_base(), adapter), adapter, modules_to_save=["lm_haed"])
    with pytest.raises(CertificateError) as error:
        certify(paths["base"], paths["tuned"], adapter_config=paths["config"])
    assert str(error.value) == (
        "certify(): modules_to_save names 'lm_haed', not a module of base.safetensors; "
        "closest: ['lm_head.weight']"
    )


def test_an_ignore_selector_is_matched_against_the_keys_of_both_files(tmp_path: Path) -> None:
    tuned = {**trained(base_state()), "extra.weight": torch.ones(2)}
    files = pair(tmp_path, "torch", tuned)
    cert = certify(*files, spec=SPEC, ignore=["extra"])  # a key of the tuned file only
    assert cert.clean and all(v.key != "extra.weight" for v in cert.verdicts)
    with pytest.raises(SelectorError) as error:
        certify(*files, spec=SPEC, ignore=["hed"])
    assert str(error.value) == (
        "certify(): 'hed' matched none of the keys of base.pt and tuned.pt; closest: "
        "['head', 'head.bias', 'embed']"
    )


def test_an_ignore_that_would_leave_a_claim_unchecked_is_refused(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["embed.weight"][1] += 1  # rows 0 of the claim below did not move, and out.weight is
    files = pair(tmp_path, "torch", tuned)  # no longer embed.weight: both claims would fail
    for kwargs, message in (
        (
            {"spec": SPEC, "ignore": ["*"]},
            "ignore=['*'] leaves out all the keys of base.pt and tuned.pt, so the certificate "
            "would pass whatever the files hold; leave out fewer keys",
        ),
        (
            {"rows": {"embed.weight": [0]}, "ignore": ["embed"]},
            "rows= names 'embed.weight', which ignore= leaves out, so that claim would never "
            "be checked; drop it from rows= or from ignore=",
        ),
        (
            {"ties": [["embed.weight", "out.weight"]], "ignore": ["out"]},
            "ties= names 'out.weight', which ignore= leaves out, so that claim would never "
            "be checked; drop it from ties= or from ignore=",
        ),
    ):
        with pytest.raises(CertificateError) as error:
            certify(*files, **kwargs)  # type: ignore[arg-type]
        assert str(error.value) == "certify(): " + message


@pytest.mark.parametrize("ulps", [-1.0, math.inf, math.nan, "2"], ids=repr)
def test_a_merge_tolerance_that_is_not_a_finite_count_of_ulps_is_refused(
    tmp_path: Path, ulps: object
) -> None:
    adapter = lora_adapter()
    paths = write_lora(tmp_path, merged(lora_base(), adapter, scale=1.0), adapter)  # merge off
    files = (paths["base"], paths["tuned"])
    kwargs = {"adapter_config": paths["config"], "adapter": paths["adapter"]}
    assert certify(*files, **kwargs).verdict("model.layers.0.q_proj.weight").ok is False
    with pytest.raises(CertificateError) as error:
        certify(*files, **kwargs, ulps=ulps)  # type: ignore[arg-type]
    assert str(error.value) == (
        f"certify(): ulps must be a finite number >= 0 (the merge tolerance in units of the "
        f"dtype's rounding), got {ulps!r}"
    )


def test_key_picks_the_group_of_base_and_tuned_and_an_adapter_is_read_at_its_top_level(
    tmp_path: Path,
) -> None:
    for name, state in (("base.pt", base_state()), ("tuned.pt", trained(base_state()))):
        torch.save({"state_dict": {"x": torch.zeros(1)}, "ema": state}, tmp_path / name)
    cert = certify(tmp_path / "base.pt", tmp_path / "tuned.pt", spec=SPEC, key="ema")
    assert cert.clean and cert.base.group == cert.tuned.group == "ema"
    adapter = lora_adapter()
    paths = write_lora(tmp_path, merged(lora_base(), adapter), adapter)
    torch.save({"state_dict": adapter}, tmp_path / "adapter.pt")
    with pytest.raises(CheckpointReadError) as error:
        certify(
            paths["base"],
            paths["tuned"],
            adapter_config=paths["config"],
            adapter=tmp_path / "adapter.pt",
        )
    assert str(error.value).startswith(
        "adapter.pt: holds no tensors at its top level, which key=None reads; "
    )


@pytest.mark.parametrize("kind", ["xxh3", "sha256", "none"])
def test_each_file_is_recorded_with_its_path_group_skipped_entries_and_own_hash(
    tmp_path: Path, kind: str
) -> None:
    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    cert = certify(base, tuned, spec=SPEC, file_hash=kind)  # type: ignore[arg-type]
    assert (cert.base.path, cert.base.format, cert.base.group) == (str(base), "dcp", "model")
    assert cert.base.skipped == cert.tuned.skipped == ("step",)
    assert cert.tuned.path == str(tuned)
    adapter = lora_adapter()
    paths = write_lora(tmp_path, merged(lora_base(), adapter), adapter)
    lora = certify(
        paths["base"],
        paths["tuned"],
        adapter_config=paths["config"],
        adapter=paths["adapter"],
        file_hash=kind,  # type: ignore[arg-type]
    )
    data = paths["adapter"].read_bytes()
    hashes = {
        "xxh3": {paths["adapter"].name: f"xxh3_128:{xxhash.xxh3_128(data).hexdigest()}"},
        "sha256": {paths["adapter"].name: f"sha256:{hashlib.sha256(data).hexdigest()}"},
        "none": {},
    }[kind]
    assert lora.adapter is not None
    assert (lora.adapter.path, lora.adapter.hashes) == (str(paths["adapter"]), hashes)


def test_a_tie_is_refused_in_the_base_files_name(tmp_path: Path) -> None:
    files = pair(tmp_path, "torch", trained(base_state()))
    with pytest.raises(CertificateError) as error:
        certify(*files, ties=[["embed.weight", "out.weigth"]])
    assert str(error.value) == (
        "certify(): tie ['embed.weight', 'out.weigth'] names 'out.weigth', not a key of "
        "base.pt; closest: ['out.weight', 'trunk.1.weight', 'trunk.0.weight']"
    )


def test_the_certificate_records_every_argument_that_made_its_claims(tmp_path: Path) -> None:
    adapter = lora_adapter()
    tuned = merged(lora_base(), adapter)
    tuned["model.embed_tokens.weight"][[3, 1]] += 1
    paths = write_lora(tmp_path, tuned, adapter)
    cert = certify(
        paths["base"],
        paths["tuned"],
        adapter_config=paths["config"],
        adapter=paths["adapter"],
        rows={"model.embed_tokens.weight": (3, 1)},
        ties=[("model.layers.0.k_proj.weight", "model.layers.0.q_proj.weight")],
        detect_ties=False,
        buffers=("*.running_mean",),
        ignore=("lm_head",),
        key=None,
        ulps=4.0,
    )
    assert cert.claims == {
        "spec": None,
        "adapter_config": lora_config(),
        "rows": {"model.embed_tokens.weight": [3, 1]},
        "ties": [["model.layers.0.k_proj.weight", "model.layers.0.q_proj.weight"]],
        "detect_ties": False,
        "buffers": ["*.running_mean"],
        "ignore": ["lm_head"],
        "key": None,
        "prefix": None,
    }
    assert cert.tolerances["merge_ulps"] == 4.0
    files = pair(tmp_path, "torch", trained(base_state()))
    spec = certify(*files, spec=SPEC, prefix="", key="auto")
    assert (spec.claims["spec"]["freeze"], spec.claims["spec"]["bn"]) == (["trunk"], "eval")
    assert {**spec.claims, "spec": None} == {
        "spec": None,
        "adapter_config": None,
        "rows": {},
        "ties": [],
        "detect_ties": True,
        "buffers": ["*.running_mean", "*.running_var", "*.num_batches_tracked"],
        "ignore": [],
        "key": "auto",
        "prefix": "",
    }
    assert spec.adapter is None and spec.notes == ()


def test_what_is_missing_or_at_odds_is_refused_word_for_word(tmp_path: Path) -> None:
    files = pair(tmp_path, "torch", trained(base_state()))
    for kwargs, message in (
        (
            {},
            "nothing to certify: give spec=, adapter_config=, rows= or ties= (a certificate "
            "without claims would pass whatever the files hold)",
        ),
        (
            {"rows": {}, "ties": []},
            "nothing to certify: give spec=, adapter_config=, rows= or ties= (a certificate "
            "without claims would pass whatever the files hold)",
        ),
        (
            {"spec": SPEC, "adapter": files[0]},
            "adapter= needs adapter_config= (its r, lora_alpha and target_modules give the "
            "merge's scale)",
        ),
        (
            {"spec": SPEC, "adapter_config": {"r": 2, "lora_alpha": 4}},
            "give spec= or adapter_config=, not both: a spec describes a training run, an "
            "adapter config a merge",
        ),
    ):
        with pytest.raises(CertificateError) as error:
            certify(*files, **kwargs)  # type: ignore[arg-type]
        assert str(error.value) == "certify(): " + message
    # ties alone are a claim
    tied = certify(*files, ties=[["embed.weight", "out.weight"]])
    assert tied.clean and tied.verdict("embed.weight = out.weight").claim == "tied"
