"""Certifying a model merged from a LoRA adapter: the merge within the dtype's rounding,
modules_to_save, an adapter that never trained, trainable token rows, and the config alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from isolate.certificates import certify
from isolate.certificates.merge import MergeCheck, check_merge
from isolate.certificates.peft import LoraConfig
from isolate.errors import CertificateError
from tests.certificates._data import (
    ALPHA,
    TARGET,
    R,
    lora_adapter,
    lora_base,
    merged,
    write_lora,
)


def _certify(paths: dict[str, Path], **kwargs: object) -> object:
    return certify(
        paths["base"],
        paths["tuned"],
        adapter_config=paths["config"],
        adapter=paths["adapter"],
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_correct_bf16_merge_is_certified(tmp_path: Path) -> None:
    adapter = lora_adapter()
    cert = _certify(write_lora(tmp_path, merged(lora_base(), adapter), adapter))
    assert cert.clean, str(cert)  # type: ignore[attr-defined]
    verdict = cert.verdict(f"{TARGET}.weight")  # type: ignore[attr-defined]
    assert (verdict.claim, verdict.finding) == ("merged", "merged")
    assert verdict.source == f"LoRA merge, scale {ALPHA:g}/{R}"
    assert cert.verdict("model.layers.0.k_proj.weight").finding == "bitwise unchanged"  # type: ignore[attr-defined]
    assert cert.adapter is not None and cert.adapter.format == "safetensors"  # type: ignore[attr-defined]


def test_a_merge_with_the_wrong_scale_is_caught_and_the_scale_it_used_is_named(
    tmp_path: Path,
) -> None:
    adapter = lora_adapter()
    cert = _certify(write_lora(tmp_path, merged(lora_base(), adapter, scale=1.0), adapter))
    [fail] = cert.failures  # type: ignore[attr-defined]
    assert (fail.key, fail.finding) == (f"{TARGET}.weight", "merge off")
    assert f"not base + {ALPHA / R:g} x B@A" in fail.detail
    fitted = float(fail.detail.rpartition("fits base + ")[2].split(" ")[0])
    assert fitted == pytest.approx(1.0, abs=0.02)


def test_a_base_changed_outside_the_targets_is_caught(tmp_path: Path) -> None:
    adapter = lora_adapter()
    tuned = merged(lora_base(), adapter)
    tuned["model.layers.0.k_proj.weight"][5] += 1
    cert = _certify(write_lora(tmp_path, tuned, adapter))
    [fail] = cert.failures  # type: ignore[attr-defined]
    assert (fail.key, fail.claim) == ("model.layers.0.k_proj.weight", "frozen")
    assert "rows [5]" in fail.detail


def test_modules_to_save_must_be_the_adapters_copy(tmp_path: Path) -> None:
    adapter = lora_adapter(head=True)
    good = _certify(
        write_lora(tmp_path, merged(lora_base(), adapter), adapter, modules_to_save=["lm_head"])
    )
    assert good.clean, str(good)  # type: ignore[attr-defined]
    assert good.verdict("lm_head.weight").claim == "saved"  # type: ignore[attr-defined]
    dropped = merged(lora_base(), adapter)
    dropped["lm_head.weight"] = lora_base()["lm_head.weight"]  # the trained copy thrown away
    bad = _certify(write_lora(tmp_path, dropped, adapter, modules_to_save=["lm_head"]))
    [fail] = bad.failures  # type: ignore[attr-defined]
    assert (fail.key, fail.finding) == ("lm_head.weight", "not the adapter's copy")
    assert "the trained copy was dropped at merge" in fail.detail


def test_an_adapter_that_never_trained_is_named(tmp_path: Path) -> None:
    adapter = lora_adapter()
    adapter[f"base_model.model.{TARGET}.lora_B.weight"].zero_()
    cert = _certify(write_lora(tmp_path, merged(lora_base(), adapter), adapter))
    [fail] = cert.failures  # type: ignore[attr-defined]
    assert (fail.key, fail.finding) == (f"{TARGET}.weight", "adapter never trained")
    b_key = f"base_model.model.{TARGET}.lora_B.weight"
    assert fail.detail == f"{b_key} is all zeros (LoRA starts B at 0)"


def test_trainable_token_rows_and_the_config_alone(tmp_path: Path) -> None:
    adapter = lora_adapter()
    tuned = merged(lora_base(), adapter)
    tuned["model.embed_tokens.weight"][[1, 4]] += 1
    paths = write_lora(tmp_path, tuned, adapter, trainable_token_indices=[1, 4])
    assert _certify(paths).clean  # type: ignore[attr-defined]
    # without the adapter's weights: the targets need only have moved
    alone = certify(paths["base"], paths["tuned"], adapter_config=paths["config"])
    assert alone.clean, str(alone)
    assert alone.verdict(f"{TARGET}.weight").claim == "trainable"
    assert alone.verdict("model.embed_tokens.weight").claim == "rows"
    untouched = dict(lora_base())
    save_file(untouched, str(paths["tuned"]))
    failed = certify(paths["base"], paths["tuned"], adapter_config=paths["config"])
    assert {(v.key, v.finding) for v in failed.failures} == {
        (f"{TARGET}.weight", "did not move"),
        ("model.embed_tokens.weight", "rows broken"),
    }


@pytest.mark.parametrize("layout", ["fan_in_fan_out", "embedding", "rslora"])
def test_merge_layouts(layout: str) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, 8, generator=g, dtype=torch.float64).float()
    if layout == "embedding":  # A: (r, num_embeddings), B: (dim, r); delta = (B @ A).T
        a, b = torch.randn(R, 12, generator=g), torch.randn(8, R, generator=g)
    else:  # fan_in_fan_out: W is (in, out); delta = (B @ A).T
        a, b = torch.randn(R, 12, generator=g), torch.randn(8, R, generator=g)
    transposed = layout != "rslora"
    if layout == "rslora":
        a, b = torch.randn(R, 8, generator=g), torch.randn(12, R, generator=g)
    scale = ALPHA / R**0.5 if layout == "rslora" else ALPHA / R
    delta = (b @ a).T if transposed else b @ a
    good = check_merge(w, w + scale * delta, a, b, scale=scale, transposed=transposed, ulps=2)
    assert good.ok and good.fitted_scale == pytest.approx(scale)
    off = check_merge(w, w + delta, a, b, scale=scale, transposed=transposed, ulps=2)
    assert not off.ok and off.fitted_scale == pytest.approx(1.0)


def test_a_merged_value_where_base_and_delta_are_zero_must_be_zero() -> None:
    zero, a, b = torch.zeros(3, 2), torch.zeros(R, 2), torch.zeros(3, R)
    merged = zero.clone()
    merged[1, 0] = 1e-30  # far below float32's eps, but not the exact 0
    off = check_merge(zero, merged, a, b, scale=1.0, transposed=False, ulps=2)
    assert not off.ok and off.bad_rows == [1] and off.bad_count == 1
    exact = check_merge(zero, zero.clone(), a, b, scale=1.0, transposed=False, ulps=2)
    assert exact.ok and exact.worst == 0.0


def test_an_empty_weight_is_merged_with_no_error() -> None:
    empty, a, b = torch.zeros(3, 0), torch.zeros(R, 0), torch.zeros(3, R)
    check = check_merge(empty, empty.clone(), a, b, scale=1.0, transposed=False, ulps=2)
    assert check == MergeCheck(True, 3, [], 0, None, 0.0)


def test_rslora_and_alpha_pattern_set_the_scale(tmp_path: Path) -> None:
    adapter = lora_adapter()
    scale = 3.0 / R**0.5
    paths = write_lora(
        tmp_path,
        merged(lora_base(), adapter, scale=scale),
        adapter,
        use_rslora=True,
        alpha_pattern={"q_proj": 3.0},
    )
    cert = _certify(paths)
    assert cert.clean, str(cert)  # type: ignore[attr-defined]
    assert cert.verdict(f"{TARGET}.weight").source == f"LoRA merge, scale 3/sqrt({R})"  # type: ignore[attr-defined]


def test_an_adapter_that_does_not_fit_its_base_is_refused(tmp_path: Path) -> None:
    adapter = lora_adapter()
    paths = write_lora(tmp_path, merged(lora_base(), adapter), adapter)
    wrong = dict(adapter)
    wrong[f"base_model.model.{TARGET}.lora_B.weight"] = torch.zeros(15, R).bfloat16()
    save_file(wrong, str(paths["adapter"]))
    with pytest.raises(
        CertificateError, match=r"do not fit the base weight 'model\.layers\.0\.q_proj\.weight'"
    ):
        _certify(paths)
    paths["config"].write_text(
        json.dumps({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["v_proj"]})
    )
    with pytest.raises(CertificateError, match=r"target_modules \['v_proj'\] names no module"):
        certify(paths["base"], paths["tuned"], adapter_config=paths["config"])


def test_modules_to_save_naming_no_module_is_refused_with_a_close_match(tmp_path: Path) -> None:
    adapter = lora_adapter(head=True)
    paths = write_lora(tmp_path, merged(lora_base(), adapter), adapter, modules_to_save=["lm_haed"])
    with pytest.raises(CertificateError, match=r"names 'lm_haed', not a module of .*lm_head"):
        _certify(paths)


def test_target_modules_are_kept_as_a_tuple() -> None:
    config = LoraConfig.load({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    assert config.target_modules == ("q_proj", "v_proj")
    assert (
        LoraConfig.load({"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}).target_modules
        == "all-linear"
    )
