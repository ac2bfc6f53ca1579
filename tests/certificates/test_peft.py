"""Certifying a model merged from a LoRA adapter: the merge within the dtype's rounding,
modules_to_save, an adapter that never trained, trainable token rows, and the config alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from isolate.certificates import certify
from isolate.certificates.checkpoint import TensorMeta
from isolate.certificates.claims import Claim, LoraDelta
from isolate.certificates.merge import MergeCheck, check_merge
from isolate.certificates.peft import LoraConfig, adapter_claims
from isolate.errors import CertificateError, SelectorError
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


def test_a_modules_to_save_copy_that_does_not_fit_its_base_is_refused(tmp_path: Path) -> None:
    adapter = lora_adapter(head=True)
    paths = write_lora(tmp_path, merged(lora_base(), adapter), adapter, modules_to_save=["lm_head"])
    adapter["base_model.model.lm_head.weight"] = torch.zeros(12, 4, dtype=torch.bfloat16)
    save_file(adapter, str(paths["adapter"]))  # the copy of a head of another base
    with pytest.raises(CertificateError) as error:
        _certify(paths)
    assert str(error.value) == (
        "certify(): adapter key 'base_model.model.lm_head.weight' bfloat16[12, 4] does not fit "
        "the base weight 'lm_head.weight' bfloat16[12, 8] it is saved for (modules_to_save); "
        "is this the adapter of this base?"
    )


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


# Claims read from the config (and the adapter's keys) alone, with no file of weights.

BF16 = torch.bfloat16


def _meta(*shape: int, dtype: torch.dtype = BF16) -> TensorMeta:
    return TensorMeta(dtype, tuple(shape))


class _Adapter:
    """The part of a Checkpoint that ``adapter_claims`` reads: its path and its metas."""

    def __init__(self, metas: dict[str, TensorMeta]) -> None:
        self.path = Path("adapter_model.safetensors")
        self.metas = metas


def _config(**fields: object) -> LoraConfig:
    return LoraConfig.load({"r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj"], **fields})


def _refused(call: Callable[[], object], error_type: type[Exception] = CertificateError) -> str:
    with pytest.raises(error_type) as error:
        call()
    return str(error.value)


def test_a_lora_config_is_read_from_its_file_its_folder_its_dict_or_itself(
    tmp_path: Path,
) -> None:
    data = {
        "peft_type": "lora",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": ["lm_head"],
        "use_rslora": 1,
        "fan_in_fan_out": 1,
        "alpha_pattern": {"v_proj": 4},
        "trainable_token_indices": [1, 2],
        "bias": "lora_only",
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps(data))
    full = LoraConfig(
        r=8,
        lora_alpha=16.0,
        target_modules=("q_proj", "v_proj"),
        modules_to_save=("lm_head",),
        use_rslora=True,
        fan_in_fan_out=True,
        alpha_pattern={"v_proj": 4},
        trainable_token_indices=[1, 2],
        bias="lora_only",
        raw=data,
    )
    for source in (tmp_path, tmp_path / "adapter_config.json", str(tmp_path), data):
        config = LoraConfig.load(source)
        assert config == full
        assert type(config.lora_alpha) is float and type(config.use_rslora) is bool
        assert type(config.fan_in_fan_out) is bool
    assert LoraConfig.load(full) is full
    bare = {"r": 2, "lora_alpha": 4, "modules_to_save": None, "alpha_pattern": None}
    assert LoraConfig.load(bare) == LoraConfig(r=2, lora_alpha=4.0, raw=bare)
    assert LoraConfig.load({"r": 2, "lora_alpha": 4.5}).lora_alpha == 4.5


def test_a_lora_config_that_cannot_be_read_or_is_no_lora_is_refused_word_for_word(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "nowhere.json"
    assert _refused(lambda: LoraConfig.load(missing)) == (
        "certify(): cannot read the adapter config nowhere.json: [Errno 2] No such file or "
        f"directory: '{missing}'"
    )
    broken = tmp_path / "adapter_config.json"
    broken.write_text("{r: 4")
    assert _refused(lambda: LoraConfig.load(tmp_path)) == (
        "certify(): cannot read the adapter config adapter_config.json: Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1)"
    )
    assert _refused(lambda: LoraConfig.load(3)) == (
        "certify(): adapter_config must be a path or a dict, got int"
    )
    assert _refused(lambda: LoraConfig.load({"r": 4, "lora_alpha": 8, "use_dora": True})) == (
        "certify(): adapter_config is DoRA; certify checks LoRA merges only"
    )
    assert _refused(lambda: LoraConfig.load({"peft_type": "ia3", "r": 4})) == (
        "certify(): adapter_config is IA3; certify checks LoRA merges only"
    )
    for r, alpha in ((0, 8), (4, None), (4.0, 8), (4, "8")):
        assert _refused(
            lambda r=r, alpha=alpha: LoraConfig.load({"r": r, "lora_alpha": alpha})
        ) == (
            f"certify(): adapter_config needs r > 0 and lora_alpha, got r={r!r}, "
            f"lora_alpha={alpha!r}"
        )
    assert LoraConfig.load({"r": 1, "lora_alpha": 1}).r == 1


def test_alpha_pattern_sets_the_alpha_of_the_modules_whose_name_ends_with_it() -> None:
    config = _config(alpha_pattern={"q_proj": 3, r"layers\.1\.v_proj": 5})
    assert config.alpha("model.layers.0.q_proj") == 3.0
    assert type(config.alpha("model.layers.0.q_proj")) is float
    assert config.alpha("q_proj") == 3.0
    assert config.alpha("model.layers.1.v_proj") == 5.0
    assert config.alpha("model.layers.0.v_proj") == ALPHA
    assert config.alpha("model.layers.0.xq_proj") == ALPHA  # not at a dot
    assert config.alpha("model.layers.0.q_proj.inner") == ALPHA  # not at the end
    assert config.scale("model.layers.0.q_proj", 4) == 3.0 / 4
    assert _config(use_rslora=True).scale("model.layers.0.q_proj", 4) == ALPHA / 2


def test_target_modules_name_modules_by_a_whole_regex_or_by_the_end_of_their_name() -> None:
    names = _config(target_modules=["q_proj", "layers.1.v_proj"])
    assert names.targets("model.layers.0.q_proj") and names.targets("q_proj")
    assert names.targets("model.layers.1.v_proj")
    assert not names.targets("model.layers.0.v_proj")
    assert not names.targets("model.layers.0.xq_proj")
    regex = _config(target_modules=r".*\.(q|v)_proj")
    assert regex.targets("model.layers.0.q_proj") and regex.targets("model.layers.3.v_proj")
    assert not regex.targets("model.layers.0.q_proj.inner")  # the whole name
    assert not regex.targets("q_proj")
    assert not _config(target_modules=None).targets("q_proj")


BASE = {
    "model.embed_tokens.weight": _meta(12, 8),
    "model.layers.0.q_proj.weight": _meta(16, 8),
    "model.layers.0.q_proj.bias": _meta(16),
    "model.layers.0.k_proj.weight": _meta(16, 8),
    "model.norm.running_mean": _meta(8, dtype=torch.float32),
    "model.norm.num_batches_tracked": _meta(dtype=torch.int64),
    "model.positions": _meta(4, dtype=torch.int64),
    "lm_head.weight": _meta(12, 8),
    "lm_head.bias": _meta(12),
}


def test_the_config_alone_claims_its_targets_moved_and_every_other_float_key_frozen() -> None:
    config = _config(
        modules_to_save=["lm_head"],
        bias="all",
        trainable_token_indices={"embed_tokens": [4, 1, 4]},
    )
    claims = adapter_claims(config, BASE, None, where="base.safetensors")
    moved = "LoRA target, merged (adapter weights not given)"
    saved = "modules_to_save (adapter weights not given)"
    bias = "adapter config bias='all'"
    assert claims == {
        "model.embed_tokens.weight": Claim("rows", "trainable rows", rows=(1, 4)),
        "model.layers.0.q_proj.weight": Claim("trainable", moved),
        "model.layers.0.q_proj.bias": Claim("free", bias),
        "model.layers.0.k_proj.weight": Claim("frozen", "not in the adapter"),
        "model.norm.running_mean": Claim("held", "not in the adapter"),
        "model.norm.num_batches_tracked": Claim("held", "not in the adapter"),
        "model.positions": Claim("held", "not in the adapter"),
        "lm_head.weight": Claim("trainable", saved),
        "lm_head.bias": Claim("free", bias),
    }
    # trainable_token_indices as a list names embed_tokens; bias "none" frees no bias
    plain = adapter_claims(
        _config(trainable_token_indices=[2]), BASE, None, where="base.safetensors"
    )
    assert plain["model.embed_tokens.weight"] == Claim("rows", "trainable rows", rows=(2,))
    assert plain["lm_head.bias"] == Claim("frozen", "not in the adapter")
    # a saved module's statistics (buffers) stay held, and the modules saved after it are
    # still claimed; only the buffers= globs declare buffers
    held = adapter_claims(
        _config(modules_to_save=["norm", "lm_head"]), BASE, None, where="base.safetensors"
    )
    assert held["model.norm.running_mean"] == Claim("held", "not in the adapter")
    assert held["lm_head.weight"] == Claim("trainable", saved)
    glob = adapter_claims(
        _config(modules_to_save=["lm_head"]),
        BASE,
        None,
        buffers=["lm_head.bias"],
        where="base.safetensors",
    )
    assert glob["lm_head.bias"] == Claim("held", "not in the adapter")
    assert glob["model.norm.running_mean"] == Claim("frozen", "not in the adapter")
    # bias="all" on a model with no bias frees nothing, and refuses nothing
    no_bias = {k: m for k, m in BASE.items() if not k.endswith(".bias")}
    claims = adapter_claims(_config(bias="all"), no_bias, None, where="base.safetensors")
    assert {c.kind for c in claims.values()} == {"trainable", "frozen", "held"}


def test_no_buffer_globs_declare_no_buffer() -> None:
    claims = adapter_claims(
        _config(modules_to_save=["lm_head"]), BASE, None, buffers=[], where="base.pt"
    )
    assert claims["model.norm.running_mean"] == Claim("frozen", "not in the adapter")
    assert claims["model.layers.0.k_proj.weight"] == Claim("frozen", "not in the adapter")
    assert claims["lm_head.weight"] == Claim(
        "trainable", "modules_to_save (adapter weights not given)"
    )
    assert claims["model.norm.num_batches_tracked"] == Claim("held", "not in the adapter")


def test_buffer_globs_and_token_rows_are_refused_in_certifys_name() -> None:
    assert _refused(
        lambda: adapter_claims(_config(), BASE, None, buffers=["type:BatchNorm2d"], where="b.pt"),
        SelectorError,
    ) == (
        "certify(): 'type:BatchNorm2d' selects by module class, which the names do not tell "
        "(there is no model); select by name or glob instead ('trunk', '*.norm.*')"
    )
    ids = {**BASE, "model.ids.weight": _meta(4, dtype=torch.int64)}
    assert _refused(
        lambda: adapter_claims(
            _config(trainable_token_indices={"ids": [1]}), ids, None, where="base.pt"
        )
    ) == (
        "certify(): rows= names 'model.ids.weight' of base.pt, a int64[4] tensor; per-row "
        "claims need a floating-point tensor with rows"
    )


def test_a_target_regex_names_modules_and_one_without_a_weight_is_refused() -> None:
    claims = adapter_claims(
        _config(target_modules=r".*_proj"), BASE, None, where="base.safetensors"
    )
    assert [k for k, c in claims.items() if c.kind == "trainable"] == [
        "model.layers.0.q_proj.weight",
        "model.layers.0.k_proj.weight",
    ]
    assert _refused(
        lambda: adapter_claims(_config(target_modules=["norm"]), BASE, None, where="base.pt")
    ) == (
        "certify(): target_modules ['norm'] names no module of base.pt that has a weight; "
        "give the adapter's weights (adapter=) so its keys decide"
    )
    assert _refused(
        lambda: adapter_claims(_config(target_modules="v_.*"), BASE, None, where="base.pt")
    ) == (
        "certify(): target_modules 'v_.*' names no module of base.pt that has a weight; "
        "give the adapter's weights (adapter=) so its keys decide"
    )


def test_modules_to_save_and_token_rows_name_modules_by_the_end_of_their_name() -> None:
    assert _refused(
        lambda: adapter_claims(_config(modules_to_save=["head"]), BASE, None, where="base.pt")
    ) == (
        "certify(): modules_to_save names 'head', not a module of base.pt; closest: "
        "['lm_head.bias']"
    )
    assert (
        _refused(
            lambda: adapter_claims(
                _config(trainable_token_indices={"embed": [1]}), BASE, None, where="base.pt"
            )
        )
        == "certify(): trainable_token_indices names 'embed', not a module of base.pt"
    )
    claims = adapter_claims(
        _config(modules_to_save=["model.layers.0.k_proj"]), BASE, None, where="base.pt"
    )
    assert claims["model.layers.0.k_proj.weight"].kind == "trainable"


A, B = ".lora_A.weight", ".lora_B.weight"
Q = "base_model.model.model.layers.0.q_proj"


def test_with_the_adapters_weights_its_keys_decide_what_merged_and_with_what_scale() -> None:
    adapter = _Adapter(
        {
            Q + A: _meta(4, 8),
            Q + B: _meta(16, 4),
            "base_model.model.model.layers.0.k_proj.lora_A.weight": _meta(2, 8),
            "base_model.model.model.layers.0.k_proj.lora_B.weight": _meta(16, 2),
            "base_model.model.model.embed_tokens.lora_embedding_A": _meta(4, 12),
            "base_model.model.model.embed_tokens.lora_embedding_B": _meta(8, 4),
            "base_model.model.lm_head.weight": _meta(12, 8),
        }
    )
    config = _config(modules_to_save=["lm_head"], alpha_pattern={"k_proj": 6})
    claims = adapter_claims(config, BASE, adapter, buffers=["*.bias"], where="base.pt")  # type: ignore[arg-type]
    k = "base_model.model.model.layers.0.k_proj"
    e = "base_model.model.model.embed_tokens"
    assert claims == {
        "model.embed_tokens.weight": Claim(
            "merged",
            "LoRA merge, scale 8/4",
            lora=LoraDelta(e + ".lora_embedding_A", e + ".lora_embedding_B", 2.0, 8.0, 4, True),
        ),
        "model.layers.0.q_proj.weight": Claim(
            "merged", "LoRA merge, scale 8/4", lora=LoraDelta(Q + A, Q + B, 2.0, 8.0, 4, False)
        ),
        "model.layers.0.q_proj.bias": Claim("held", "not in the adapter"),
        "model.layers.0.k_proj.weight": Claim(
            "merged", "LoRA merge, scale 6/2", lora=LoraDelta(k + A, k + B, 3.0, 6.0, 2, False)
        ),
        "model.norm.running_mean": Claim("frozen", "not in the adapter"),
        "model.norm.num_batches_tracked": Claim("held", "not in the adapter"),
        "model.positions": Claim("held", "not in the adapter"),
        "lm_head.weight": Claim(
            "saved", "modules_to_save", saved="base_model.model.lm_head.weight"
        ),
        "lm_head.bias": Claim("held", "not in the adapter"),
    }
    # rsLoRA names its scale sqrt(r), and a saved module the adapter lacks is only trainable
    rs = adapter_claims(
        _config(use_rslora=True, modules_to_save=["model.layers.0.k_proj"]),
        BASE,
        adapter,  # type: ignore[arg-type]
        where="base.pt",
    )
    assert rs["model.layers.0.q_proj.weight"] == Claim(
        "merged", "LoRA merge, scale 8/sqrt(4)", lora=LoraDelta(Q + A, Q + B, 4.0, 8.0, 4, False)
    )
    assert rs["model.layers.0.k_proj.weight"] == Claim(
        "trainable", "modules_to_save (adapter weights not given)"
    )


def test_a_fan_in_fan_out_adapter_fits_its_base_weight_transposed() -> None:
    adapter = _Adapter({Q + A: _meta(4, 16), Q + B: _meta(8, 4)})
    claims = adapter_claims(_config(fan_in_fan_out=True), BASE, adapter, where="base.pt")  # type: ignore[arg-type]
    assert claims["model.layers.0.q_proj.weight"].lora == LoraDelta(Q + A, Q + B, 2.0, 8.0, 4, True)
    assert _refused(lambda: adapter_claims(_config(), BASE, adapter, where="base.pt")) == (  # type: ignore[arg-type]
        f"certify(): adapter '{Q + A}' bfloat16[4, 16] and '{Q + B}' bfloat16[8, 4] do not "
        "fit the base weight 'model.layers.0.q_proj.weight' bfloat16[16, 8]; is this the "
        "adapter of this base?"
    )


@pytest.mark.parametrize(
    ("metas", "message"),
    [
        (
            {Q + A: _meta(4, 8), Q + B: _meta(16, 3)},
            f"adapter '{Q + A}' bfloat16[4, 8] and '{Q + B}' bfloat16[16, 3] do not fit the base "
            "weight 'model.layers.0.q_proj.weight' bfloat16[16, 8]; is this the adapter of this "
            "base?",
        ),
        (
            {Q + A: _meta(4, 7), Q + B: _meta(16, 4)},
            f"adapter '{Q + A}' bfloat16[4, 7] and '{Q + B}' bfloat16[16, 4] do not fit the base "
            "weight 'model.layers.0.q_proj.weight' bfloat16[16, 8]; is this the adapter of this "
            "base?",
        ),
        (
            {Q + A: _meta(4, 8, 1, 1), Q + B: _meta(16, 4, 1, 1)},
            f"adapter '{Q + A}' is bfloat16[4, 8, 1, 1]: only 2-D LoRA factors (linear, "
            "embedding) can be checked, not convolutions",
        ),
        (
            {Q + A: _meta(4, 8), Q + B: _meta(16, 4, 1)},
            f"adapter '{Q + A}' is bfloat16[4, 8]: only 2-D LoRA factors (linear, embedding) "
            "can be checked, not convolutions",
        ),
        (
            {Q + A: _meta(4, 8)},
            f"adapter key '{Q + A}' has no '{Q + B}' to go with it; closest: ['{Q + A}']",
        ),
        (
            {"base_model.model.model.layers.0.qproj" + A: _meta(4, 8)},
            "adapter key 'base_model.model.model.layers.0.qproj.lora_A.weight' has no "
            "'model.layers.0.qproj.weight' to go with it; closest: "
            "['model.layers.0.q_proj.weight', 'model.layers.0.k_proj.weight', "
            "'model.layers.0.q_proj.bias']",
        ),
        (
            {Q + A: _meta(), Q + B: _meta(16, 4)},
            f"adapter '{Q + A}' is bfloat16[]: only 2-D LoRA factors (linear, embedding) "
            "can be checked, not convolutions",
        ),
        (
            {"base_model.model.lm_head.weight": _meta(12, 8)},
            "the adapter adapter_model.safetensors holds no LoRA factors (keys ending "
            "'.lora_A.weight'); its keys start ['base_model.model.lm_head.weight']",
        ),
        (
            {f"base_model.model.{n}.weight": _meta(12, 8) for n in ("a", "b", "c", "d")},
            "the adapter adapter_model.safetensors holds no LoRA factors (keys ending "
            "'.lora_A.weight'); its keys start ['base_model.model.a.weight', "
            "'base_model.model.b.weight', 'base_model.model.c.weight']",
        ),
    ],
    ids=[
        "rank",
        "columns",
        "conv",
        "b-not-2d",
        "no-b",
        "no-weight",
        "scalar-a",
        "no-factors",
        "first-three-keys",
    ],
)
def test_an_adapter_that_does_not_fit_its_base_is_refused_word_for_word(
    metas: dict[str, TensorMeta], message: str
) -> None:
    adapter = _Adapter(metas)
    assert _refused(lambda: adapter_claims(_config(), BASE, adapter, where="base.pt")) == (  # type: ignore[arg-type]
        "certify(): " + message
    )
