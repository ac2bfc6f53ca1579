"""The readers: every format hands out exactly the saved tensors, one at a time, whatever
the mapping window; the groups that hold the weights; what the certificate records."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from isolate.certificates import certify
from isolate.certificates.opening import open_checkpoint
from isolate.errors import CheckpointReadError
from isolate.fingerprints import fingerprint
from tests.certificates._data import FORMATS, SPEC, base_state, pair, save, save_dcp, trained


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "a.bf16": torch.randn(5, 3, generator=g).bfloat16(),
        "a.f64": torch.randn(4, generator=g, dtype=torch.float64),
        "a.int": torch.arange(6).reshape(2, 3),
        "a.bool": torch.tensor([True, False, True]),
        "a.scalar": torch.tensor(2.5),
        "b.f16": torch.randn(2, 2, 2, generator=g).half(),
    }


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [1, 1 << 30])
def test_each_format_reads_back_the_saved_tensors(tmp_path: Path, fmt: str, window: int) -> None:
    state = _mixed()
    path = save(fmt, state, tmp_path / f"ckpt.{fmt}")
    with open_checkpoint(path) as reader:
        reader.window = window  # 1: the mapping is released before every tensor
        assert set(reader.metas) == set(state)
        for key, expected in state.items():
            assert reader.metas[key].dtype == expected.dtype
            assert reader.metas[key].shape == tuple(expected.shape)
            got = reader.read(key)
            assert got.dtype == expected.dtype and torch.equal(got, expected), key
            # safetensors: streamed from the file's bytes, a block at a time
            assert reader.print_of(key) == fingerprint(expected), key
        assert reader.format == fmt


def test_safetensors_are_read_in_the_order_of_their_bytes(tmp_path: Path) -> None:
    path = save("safetensors", _mixed(), tmp_path / "x.safetensors")
    with open_checkpoint(path) as reader:
        offsets = [reader.offsets[k][0] for k in reader.metas]  # type: ignore[attr-defined]
    assert offsets == sorted(offsets)


def test_groups_that_hold_the_weights(tmp_path: Path) -> None:
    state = base_state()
    torch.save({"epoch": 3, "state_dict": state}, tmp_path / "run.ckpt")
    with open_checkpoint(tmp_path / "run.ckpt") as reader:
        assert list(reader.metas) == list(state) and reader.skipped == []
    with pytest.raises(CheckpointReadError, match=r"has no group 'model'.*\['state_dict'\]"):
        open_checkpoint(tmp_path / "run.ckpt", key="model")
    save_dcp({"model": state, "optim": {"lr": torch.tensor(0.1)}}, tmp_path / "dcp")
    with open_checkpoint(tmp_path / "dcp") as reader:
        assert set(reader.metas) == set(state)
        assert reader.skipped == ["optim.lr"]
    prefixed = {f"model.{k}": v.contiguous() for k, v in state.items()}
    save_file({**prefixed, "extra": torch.ones(1)}, str(tmp_path / "p.safetensors"))
    with open_checkpoint(tmp_path / "p.safetensors", key="model") as reader:
        assert set(reader.metas) == set(state) and reader.skipped == ["extra"]
    with open_checkpoint(tmp_path / "p.safetensors") as reader:  # flat files stay flat
        assert set(reader.metas) == {*prefixed, "extra"}


def test_key_none_reads_the_top_level_only_and_refuses_one_without_tensors(
    tmp_path: Path,
) -> None:
    state = base_state()
    torch.save({"epoch": 3, "state_dict": state}, tmp_path / "run.ckpt")
    for key in (None, ""):
        with pytest.raises(CheckpointReadError) as error:
            open_checkpoint(tmp_path / "run.ckpt", key=key)
        assert str(error.value) == (
            f"run.ckpt: holds no tensors at its top level, which key={key!r} reads; its groups "
            "are ['state_dict']: name the one with the weights, e.g. key='state_dict'"
        )
    torch.save({"scale": torch.ones(2), "state_dict": state}, tmp_path / "mixed.ckpt")
    with open_checkpoint(tmp_path / "mixed.ckpt", key=None) as reader:
        assert list(reader.metas) == ["scale"]
        assert reader.skipped == ["state_dict"]
    with open_checkpoint(tmp_path / "mixed.ckpt", key="state_dict") as reader:
        assert list(reader.metas) == list(state)


def test_a_file_with_no_tensors_where_auto_looks_names_its_groups_or_says_it_has_none(
    tmp_path: Path,
) -> None:
    torch.save({"epoch": 3, "weights": base_state()}, tmp_path / "w.ckpt")
    with pytest.raises(CheckpointReadError) as error:
        open_checkpoint(tmp_path / "w.ckpt")
    assert str(error.value) == (
        "w.ckpt: holds no tensors at its top level and none of the groups ['state_dict', "
        "'model', 'module']; its groups are ['weights']: name the one with the weights, "
        "e.g. key='weights'"
    )
    with open_checkpoint(tmp_path / "w.ckpt", key="weights") as reader:
        assert "head.weight" in reader.metas
    torch.save({"epoch": 3}, tmp_path / "e.ckpt")
    for key in ("auto", None):
        with pytest.raises(CheckpointReadError, match=r"it holds no group of tensors either$"):
            open_checkpoint(tmp_path / "e.ckpt", key=key)


def _hash(path: Path, kind: str) -> str:
    data = path.read_bytes()
    if kind == "xxh3":
        return f"xxh3_128:{xxhash.xxh3_128(data).hexdigest()}"
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["xxh3", "sha256"])
def test_the_certificate_records_the_files_own_hashes(tmp_path: Path, fmt: str, kind: str) -> None:
    tuned_state = trained(base_state())
    tuned_state["aaa.extra"] = torch.ones(3)  # read after the others: out of the file's order
    base, tuned = pair(tmp_path, fmt, tuned_state)
    for ignore in ([], ["trunk.0"]):  # a gap in the keys read
        cert = certify(base, tuned, spec=SPEC, file_hash=kind, ignore=ignore)  # type: ignore[arg-type]
        files = [tuned] if tuned.is_file() else [tuned / n for n in cert.tuned.hashes]
        assert cert.tuned.hashes == {f.name: _hash(f, kind) for f in files}
        if base.is_file():
            assert cert.base.hashes == {base.name: _hash(base, kind)}
    if fmt == "dcp":  # the metadata, one shard file per tensor and one for the step count
        assert ".metadata" in cert.tuned.hashes and len(cert.tuned.hashes) == 2 + len(tuned_state)


def test_the_certificate_json_holds_what_is_needed_to_check_it_again(tmp_path: Path) -> None:
    base, tuned = pair(tmp_path, "torch", trained(base_state()))
    cert = certify(base, tuned, spec=SPEC, ties=[["embed.weight", "out.weight"]])
    data = json.loads(cert.to_json())
    assert data["clean"] is True
    assert data["claims"]["spec"]["freeze"] == ["trunk"]
    assert data["claims"]["ties"] == [["embed.weight", "out.weight"]]
    assert data["claims"]["detect_ties"] is True
    head = next(v for v in data["verdicts"] if v["key"] == "head.weight")
    assert (head["claim"], head["meta"]) == ("trainable", "float32[3, 6]")
    assert cert.to_json() == json.dumps(cert.to_dict(), indent=2)
    with pytest.raises(KeyError, match=r"^\"no verdict on 'nope'\"$"):
        cert.verdict("nope")
    with pytest.raises(KeyError, match=r"^\"no verdict on 'nope' of claim 'frozen'\"$"):
        cert.verdict("nope", "frozen")
    assert set(data["versions"]) >= {"isolate", "torch", "python"}
    assert data["tolerances"] == {  # the rules the verdicts applied, to check them again
        "frozen": "bitwise (XXH3-128 fingerprints of dtype, shape and bytes)",
        "merge_ulps": 2.0,
        "merge_rule": "|merged - (W + s*B@A)| <= ulps*eps(dtype)*(|W + s*B@A| + s*|B|@|A|)",
    }
    assert any("cannot show which loss" in line for line in data["limits"])
    head = next(v for v in data["verdicts"] if v["key"] == "head.weight")
    assert head["tuned"] == f"{fingerprint(trained(base_state())['head.weight']):032x}"
    assert "CLEAN" in str(cert) and "trunk: 4 frozen, bitwise unchanged" in str(cert)


def test_a_file_left_in_a_dcp_folder_by_another_save_is_noted(tmp_path: Path) -> None:
    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    (tuned / "__7_0.distcp").write_bytes(b"old")
    cert = certify(base, tuned, spec=SPEC)
    assert cert.clean
    assert cert.notes == (
        "__7_0.distcp in tuned is not referenced by its index (left by another save?)",
    )


def test_formats_can_be_mixed(tmp_path: Path) -> None:
    base = save("safetensors", base_state(), tmp_path / "base.safetensors")
    tuned = save("dcp", trained(base_state()), tmp_path / "tuned")
    assert certify(base, tuned, spec=SPEC).clean
