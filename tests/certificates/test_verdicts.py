"""Each verdict of a certificate, on small pairs in every format: frozen, trainable, buffers,
thawed, rows, ties, and keys in one file only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from isolate.certificates import certify
from isolate.certificates.certificate import Certificate, Verdict
from isolate.certificates.checkpoint import Source, TensorMeta
from isolate.certificates.claims import Claim
from isolate.certificates.compare import diff_rows, is_constant
from isolate.certificates.dcp_folder import DcpCheckpoint
from isolate.certificates.verdicts import Pair, judge
from isolate.fingerprints import fingerprint
from isolate.spec import IsolationSpec
from tests.certificates._data import (
    ALPHA,
    FORMATS,
    SPEC,
    R,
    base_state,
    lora_adapter,
    lora_base,
    lora_config,
    merged,
    pair,
    trained,
    write_lora,
)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_run_as_declared_is_certified_clean(tmp_path: Path, fmt: str) -> None:
    cert = certify(*pair(tmp_path, fmt, trained(base_state())), spec=SPEC)
    assert cert.clean, str(cert)
    by_key = {v.key: (v.claim, v.ok, v.finding) for v in cert.verdicts}
    assert by_key["trunk.0.weight"] == ("frozen", True, "bitwise unchanged")
    assert by_key["trunk.1.running_mean"] == ("held", True, "bitwise unchanged")
    assert by_key["trunk.1.num_batches_tracked"] == ("held", True, "bitwise unchanged")
    assert by_key["head.weight"] == ("trainable", True, "moved")
    assert by_key["embed.weight = out.weight"] == ("tied", True, "still tied")
    assert sorted(cert.summary()) == [
        "embed: 1 trainable, moved",
        "head: 2 trainable, moved",
        "out: 1 trainable, moved",
        "trunk: 4 frozen, bitwise unchanged; 3 held, bitwise unchanged",
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_frozen_tensor_that_changed_is_named_with_its_row(tmp_path: Path, fmt: str) -> None:
    tuned = trained(base_state())
    tuned["trunk.0.weight"][4, 2] += 1e-3
    cert = certify(*pair(tmp_path, fmt, tuned), spec=SPEC)
    assert not cert.clean
    [fail] = cert.failures
    assert (fail.key, fail.claim, fail.finding) == ("trunk.0.weight", "frozen", "changed")
    assert "1 of 6 rows differ (rows [4])" in fail.detail
    assert fail.base != fail.tuned


def test_a_trainable_tensor_that_did_not_move_is_named(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["head.bias"] = base_state()["head.bias"]
    cert = certify(*pair(tmp_path, "safetensors", tuned), spec=SPEC)
    [fail] = cert.failures
    assert (fail.key, fail.claim, fail.finding) == ("head.bias", "trainable", "did not move")


def test_bn_train_lets_the_statistics_of_the_frozen_part_move(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["trunk.1.running_mean"] += 1.0
    tuned["trunk.1.num_batches_tracked"] += 5
    files = pair(tmp_path, "torch", tuned)
    held = certify(*files, spec=SPEC)
    assert {v.key for v in held.failures} == {"trunk.1.running_mean", "trunk.1.num_batches_tracked"}
    free = certify(*files, spec={"freeze": ["trunk"], "bn": "train"})
    assert free.clean
    assert free.verdict("trunk.1.running_mean").claim == "free"
    assert free.verdict("trunk.1.running_mean").finding == "moved"


def test_buffers_outside_the_frozen_part_are_free_and_non_float_keys_never_trainable(
    tmp_path: Path,
) -> None:
    tuned = trained(base_state())
    tuned["trunk.1.running_mean"] += 1.0
    cert = certify(*pair(tmp_path, "torch", tuned), spec={"freeze": ["trunk.0"]})
    assert cert.verdict("trunk.1.running_mean").claim == "free"
    # the BatchNorm's own parameters are not frozen: its statistics are not covered
    assert cert.verdict("trunk.1.weight").claim == "trainable"
    assert cert.verdict("trunk.1.num_batches_tracked").claim == "free"


def test_a_frozen_module_covers_its_buffers_through_its_parameters(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["trunk.1.running_var"] += 1.0
    cert = certify(
        *pair(tmp_path, "torch", tuned),
        spec={"freeze": ["trunk.1.weight", "trunk.1.bias", "trunk.0"]},
    )
    assert [v.key for v in cert.failures] == ["trunk.1.running_var"]
    assert cert.failures[0].claim == "held"


def test_thawed_keys_may_move_and_exclusions_apply(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["trunk.0.weight"] += 1.0
    spec = IsolationSpec.from_dict(
        {"freeze": ["trunk", "!trunk.1"], "thaw": [{"select": "trunk.0", "epoch": 2}]}
    )
    cert = certify(*pair(tmp_path, "safetensors", tuned), spec=spec)
    assert cert.verdict("trunk.0.weight").claim == "free"
    assert "thawed by the spec (trunk.0 at epoch 2)" in cert.verdict("trunk.0.weight").source
    assert cert.verdict("trunk.0.weight").finding == "moved"
    # excluded from freeze, so declared trainable; they did not move
    assert {(v.key, v.claim, v.finding) for v in cert.failures} == {
        ("trunk.1.weight", "trainable", "did not move"),
        ("trunk.1.bias", "trainable", "did not move"),
    }
    assert cert.verdict("trunk.1.running_mean").claim == "free"


def test_rows_frozen_except_the_listed_ones(tmp_path: Path) -> None:
    base = base_state()
    tuned = trained(base)
    tuned["embed.weight"] = base["embed.weight"].clone()
    tuned["embed.weight"][[2, 7]] += 1.0
    tuned["out.weight"] = tuned["embed.weight"].clone()
    files = pair(tmp_path, "torch", tuned)
    cert = certify(*files, spec=SPEC, rows={"embed.weight": [2, 7]})
    assert cert.clean, str(cert)
    assert cert.verdict("embed.weight").claim == "rows"
    # one more row moved than declared, and one declared row did not move
    tuned["embed.weight"][3] += 1.0
    tuned["out.weight"] = tuned["embed.weight"].clone()
    files = pair(tmp_path, "torch", tuned)
    bad = certify(*files, spec=SPEC, rows={"embed.weight": [2, 7, 9]}).verdict("embed.weight")
    assert bad.ok is False
    assert "1 frozen rows changed (rows [3])" in bad.detail
    assert "1 trainable rows did not move (rows [9])" in bad.detail


def test_declared_and_detected_ties(tmp_path: Path) -> None:
    base = base_state()
    tuned = trained(base)
    tuned["out.weight"][0, 0] += 1.0
    files = pair(tmp_path, "safetensors", tuned)
    cert = certify(*files, spec=SPEC)
    [fail] = cert.failures
    assert (fail.key, fail.claim, fail.finding) == (
        "embed.weight = out.weight",
        "tied",
        "tie broken",
    )
    assert "['out.weight'] no longer equal 'embed.weight'" in fail.detail
    assert "rows [0]" in fail.detail
    # constant tensors equal by chance (zero biases, unit norms) are not taken for ties
    assert not any("head.bias" in v.key for v in cert.verdicts if v.claim == "tied")
    undetected = certify(*files, spec=SPEC, detect_ties=False)
    assert undetected.clean
    declared = certify(*files, spec=SPEC, detect_ties=False, ties=[["embed.weight", "out.weight"]])
    assert [v.key for v in declared.failures] == ["embed.weight = out.weight"]
    assert declared.failures[0].source == "declared"


def test_a_declared_tie_that_is_not_tied_in_the_base_fails(tmp_path: Path) -> None:
    base = base_state()
    base["copy.weight"] = base["head.weight"] + 1
    cert = certify(
        *pair(tmp_path, "torch", trained(base), base),
        ties=[["head.weight", "copy.weight"], ["embed.weight", "out.weight"]],
        detect_ties=False,
    )
    [fail] = cert.failures
    assert (fail.key, fail.claim, fail.finding, fail.detail, fail.source) == (
        "head.weight = copy.weight",
        "tied",
        "not tied in the base",
        "",
        "declared",
    )
    ties = {v.key: v.finding for v in cert.verdicts if v.claim == "tied"}
    assert ties == {  # the tie declared after the failed one is still checked
        "head.weight = copy.weight": "not tied in the base",
        "embed.weight = out.weight": "still tied",
    }


def test_missing_unexpected_and_renamed_keys(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["backbone.0.bias"] = tuned.pop("trunk.0.bias")  # renamed, bitwise the same values
    tuned["head.linear.weight"] = tuned.pop("head.weight")  # renamed, and trained
    del tuned["head.bias"]  # missing
    tuned["extra.weight"] = torch.randn(2, 2)  # unexpected
    cert = certify(*pair(tmp_path, "safetensors", tuned), spec=SPEC)
    present = {v.key: v.finding for v in cert.verdicts if v.claim == "present"}
    assert present == {
        "trunk.0.bias": "renamed to 'backbone.0.bias'",
        "head.weight": "renamed to 'head.linear.weight'?",
        "head.bias": "missing from the tuned checkpoint",
        "extra.weight": "not in the base checkpoint",
    }
    assert cert.verdict("head.weight", "present").detail == "same dtype and shape; values differ"
    assert all(v.ok is False for v in cert.verdicts if v.claim == "present")
    ignored = certify(
        *pair(tmp_path, "safetensors", tuned),
        spec=SPEC,
        ignore=["head", "trunk.0.bias", "backbone", "!head.linear"],
    )
    # the exclusion keeps head.linear.weight in, now with no base key to be renamed from
    assert sorted((v.key, v.finding) for v in ignored.failures) == [
        ("extra.weight", "not in the base checkpoint"),
        ("head.linear.weight", "not in the base checkpoint"),
    ]


def test_a_lightning_checkpoint_is_read_from_its_state_dict(tmp_path: Path) -> None:
    def ckpt(state: dict[str, torch.Tensor], path: Path) -> Path:
        torch.save({"epoch": 1, "global_step": 5, "state_dict": state, "loops": {}}, path)
        return path

    base = base_state()
    first = ckpt({f"net.{k}": v for k, v in base.items()}, tmp_path / "first.ckpt")
    last = ckpt({f"net.{k}": v for k, v in trained(base).items()}, tmp_path / "last.ckpt")
    cert = certify(first, last, spec=SPEC, prefix="net")
    assert cert.clean, str(cert)
    assert cert.tuned.group == "state_dict"
    assert cert.verdict("net.trunk.0.weight").finding == "bitwise unchanged"
    assert cert.claims["spec"]["freeze"] == ["net.trunk"]


def test_the_largest_change_is_measured_beyond_the_dtypes_range() -> None:
    a = torch.tensor([[60000.0, 1.0], [2.0, 3.0]], dtype=torch.float16)
    b = torch.tensor([[-60000.0, 1.0], [2.0, 3.0]], dtype=torch.float16)
    diff = diff_rows(a, b)  # 120000 overflows float16 (its largest is 65504)
    assert (diff.count, diff.elements, diff.max_abs) == (1, 1, 120000.0)


def test_a_tensor_of_one_element_or_none_counts_as_constant() -> None:
    # Constant tensors (a fresh bias, a norm's ones) are equal in the base without being tied.
    assert is_constant(torch.tensor(3.0)) and is_constant(torch.tensor([5.0]))
    assert is_constant(torch.empty(0)) and is_constant(torch.ones(4))
    assert not is_constant(torch.arange(4.0))


# --------------------------------------------------------------------------------------------
# Each verdict's words, and the parts of a tensor a folder stores in several files


class _Parts:
    """A folder checkpoint (as ``Pair`` sees one) that stores its one tensor ``w`` in parts."""

    def __init__(self, path: Path, tensor: torch.Tensor, sources: list[Source]) -> None:
        self.path, self.tensor, self.parts = path, tensor, sources
        self.metas = {"w": TensorMeta(tensor.dtype, tuple(tensor.shape))}

    def read(self, key: str) -> torch.Tensor:
        return self.tensor

    def sources(self, key: str) -> list[Source]:
        return self.parts


def _judged(tmp: Path, kind: str, base: torch.Tensor, tuned: torch.Tensor, parts: list) -> Verdict:
    sources = [Source(file, offsets, sizes) for file, offsets, sizes in parts]
    first, second = _Parts(tmp, base, sources), _Parts(tmp, tuned, sources)
    claim = Claim(kind, "declared")  # type: ignore[arg-type]
    return judge(
        Pair("w", claim, first, second, fingerprint(base), fingerprint(tuned), None, 2.0)  # type: ignore[arg-type]
    )


def test_parts_stored_unchanged_while_the_others_moved_are_named_with_their_boxes(
    tmp_path: Path,
) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    parts = [("a", (0, 0), (2, 6)), ("b", (2, 0), (2, 3)), ("c", (2, 3), (2, 3))]
    tuned = base.clone()
    tuned[1, 5] += 1  # only the part in a moved
    verdict = _judged(tmp_path, "trainable", base, tuned, parts)
    assert (verdict.ok, verdict.finding) == (False, "part did not move")
    assert verdict.detail == (
        "2 of 3 stored parts are bitwise the base's while the others moved: a stale shard? "
        "(b at [2, 0], c at [2, 3])"
    )
    tuned[3, 2] += 1  # b moved too; c is stale alone
    verdict = _judged(tmp_path, "trainable", base, tuned, parts)
    assert verdict.detail.startswith("1 of 3 stored parts") and verdict.detail.endswith(
        "(c at [2, 3])"
    )
    tuned[2, 3] += 1  # every part moved
    verdict = _judged(tmp_path, "trainable", base, tuned, parts)
    assert (verdict.ok, verdict.finding, verdict.detail) == (True, "moved", "")
    two = [("a", (0, 0), (2, 6)), ("b", (2, 0), (2, 6))]
    tuned = base.clone()
    tuned[0] += 1
    assert _judged(tmp_path, "trainable", base, tuned, two).detail.endswith("(b at [2, 0])")


def test_a_changed_frozen_tensor_names_the_files_that_hold_its_first_thousand_changed_rows(
    tmp_path: Path,
) -> None:
    base = torch.zeros(1002, 1)
    parts = [("a", (0, 0), (1000, 1)), ("b", (1000, 0), (2, 1))]
    verdict = _judged(tmp_path, "frozen", base, base + 1, parts)
    assert (verdict.ok, verdict.finding) == (False, "changed")
    assert verdict.detail == (
        "1002 of 1002 rows differ (rows [0, 1, 2, 3, 4, ...]), 1002 elements, max |diff| 1 in ['a']"
    )
    tuned = base.clone()
    tuned[1] += 1  # held by a, which starts at row 0 and holds 1000 rows
    tuned[1001] += 1  # held by b, from row 1000
    assert _judged(tmp_path, "frozen", base, tuned, parts).detail.endswith(" in ['a', 'b']")


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_verdict_on_a_frozen_tensor_says_exactly_what_changed_and_where(
    tmp_path: Path, fmt: str
) -> None:
    base = base_state()
    tuned = trained(base)
    tuned["trunk.0.weight"][4, 2] += 1.0
    first, second = pair(tmp_path, fmt, tuned)
    cert = certify(first, second, spec={**SPEC, "bn": "train"})
    fail = cert.verdict("trunk.0.weight")
    where = stored = ""
    if fmt == "dcp":
        with DcpCheckpoint(second) as reader:
            where = f" in {[s.file for s in reader.sources('trunk.0.weight')]}"
            stored = f" (stored in {[s.file for s in reader.sources('trunk.1.weight')]})"
    assert fail.detail == f"1 of 6 rows differ (rows [4]), 1 element, max |diff| 1{where}"
    assert fail.base == f"{fingerprint(base['trunk.0.weight']):032x}"
    assert fail.tuned == f"{fingerprint(tuned['trunk.0.weight']):032x}"
    held = cert.verdict("trunk.0.bias")
    assert (held.ok, held.finding, held.detail) == (True, "bitwise unchanged", "")
    free = cert.verdict("trunk.1.running_var")  # bn="train": free, and it did not move
    assert (free.claim, free.ok, free.finding) == ("free", None, "bitwise unchanged")
    still = certify(first, second, spec={"freeze": ["head"]}).verdict("trunk.1.weight")
    assert (still.finding, still.detail) == (
        "did not move",
        f"declared trainable, bitwise unchanged{stored}",
    )


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_a_per_row_verdict_names_the_rows_that_broke_the_claim_and_where(
    tmp_path: Path, fmt: str
) -> None:
    base = {"w": torch.zeros(16, 2)}
    tuned = {"w": torch.zeros(16, 2)}
    tuned["w"][[0, 8, 9, 10, 11, 12, 13]] = 1.0
    good = certify(
        *pair(tmp_path, fmt, {"w": tuned["w"][:1]}, {"w": base["w"][:1]}), rows={"w": [0]}
    )
    assert (good.verdict("w").ok, good.verdict("w").finding) == (
        True,
        "1 rows moved, the others unchanged",
    )
    first, second = pair(tmp_path, fmt, tuned, base)
    verdict = certify(first, second, rows={"w": range(7)}).verdict("w")
    where = ""
    if fmt == "dcp":
        with DcpCheckpoint(second) as reader:
            where = f" in {[s.file for s in reader.sources('w')]}"
    assert (verdict.ok, verdict.finding) == (False, "rows broken")
    assert verdict.detail == (
        f"6 frozen rows changed (rows [8, 9, 10, 11, 12]){where}; "
        "6 trainable rows did not move (rows [1, 2, 3, 4, 5])"
    )


def _lora(
    tmp: Path, tuned: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]
) -> Certificate:
    paths = write_lora(tmp, tuned, adapter, modules_to_save=["lm_head"])
    return certify(
        paths["base"], paths["tuned"], adapter_config=paths["config"], adapter=paths["adapter"]
    )


def test_a_saved_module_is_the_adapters_copy_bitwise_or_after_a_cast_and_named_when_not(
    tmp_path: Path,
) -> None:
    head = "base_model.model.lm_head.weight"
    adapter = lora_adapter(head=True)
    good = _lora(tmp_path, merged(lora_base(), adapter), adapter).verdict("lm_head.weight")
    assert (good.claim, good.ok, good.finding, good.detail) == (
        "saved",
        True,
        "the adapter's copy",
        "bitwise",
    )
    dropped = merged(lora_base(), adapter)
    dropped["lm_head.weight"] = lora_base()["lm_head.weight"]  # the trained copy thrown away
    bad = _lora(tmp_path, dropped, adapter).verdict("lm_head.weight")
    assert bad.detail.startswith(f"differs from {head} in adapter_model.safetensors: 12 of 12 ")
    assert bad.detail.endswith(
        ", max |diff| 3.5; it is the base's: the trained copy was dropped at merge"
    )
    # the adapter kept its copy in float32, the merged model holds it in bfloat16
    wide = {**adapter, head: adapter[head].float()}
    tuned = merged(lora_base(), adapter)
    cast = _lora(tmp_path, tuned, wide).verdict("lm_head.weight")
    assert (cast.ok, cast.finding, cast.detail) == (
        True,
        "the adapter's copy",
        "bitwise (cast from torch.float32)",
    )
    tuned["lm_head.weight"][3] += 1
    off = _lora(tmp_path, tuned, wide).verdict("lm_head.weight")
    assert (off.ok, off.finding) == (False, "not the adapter's copy")
    assert off.detail.startswith(
        f"differs from {head} in adapter_model.safetensors (cast from torch.float32): "
        "1 of 12 rows differ (rows [3]), 8 elements"
    )
    assert "dropped" not in off.detail  # the tuned copy moved: not the base's


def test_a_fan_in_fan_out_merge_is_checked_against_the_transposed_delta(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    weight = "model.c_attn.weight"  # Conv1D: (in, out)
    base = {weight: torch.randn(8, 16, generator=g)}
    a = 0.3 * torch.randn(R, 8, generator=g)
    b = 0.3 * torch.randn(16, R, generator=g)
    adapter = {
        "base_model.model.model.c_attn.lora_A.weight": a,
        "base_model.model.model.c_attn.lora_B.weight": b,
    }
    config = {**lora_config(), "target_modules": ["c_attn"], "fan_in_fan_out": True}
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(
        {weight: base[weight] + (ALPHA / R) * (b @ a).T}, str(tmp_path / "merged.safetensors")
    )
    save_file(adapter, str(tmp_path / "adapter.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    cert = certify(
        tmp_path / "base.safetensors",
        tmp_path / "merged.safetensors",
        adapter_config=tmp_path / "adapter_config.json",
        adapter=tmp_path / "adapter.safetensors",
    )
    assert (cert.verdict(weight).ok, cert.verdict(weight).finding) == (True, "merged")
