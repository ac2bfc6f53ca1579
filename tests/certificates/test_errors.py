"""Bad input gets a typed error with one line naming the file (and the tensor) and the fix,
raised before anything is certified."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from isolate.certificates import certify
from isolate.certificates.dcp_folder import DcpCheckpoint
from isolate.errors import CertificateError, CheckpointReadError, IsolationError, SelectorError
from tests.certificates._data import SPEC, base_state, pair, save, trained


def _one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(error.value)
    assert "\n" not in text and isinstance(error.value, IsolationError), text
    return text


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_a_truncated_safetensors_file_names_the_first_tensor_cut(tmp_path: Path) -> None:
    base, tuned = pair(tmp_path, "safetensors", trained(base_state()))
    _truncate(tuned, 0.9)
    with pytest.raises(CheckpointReadError) as error:
        certify(base, tuned, spec=SPEC)
    assert _one_line(error).startswith("tuned.safetensors, tensor ")
    assert "truncated" in str(error.value) and "re-copy the file" in str(error.value)


def test_a_safetensors_file_cut_after_the_headers_first_byte_is_named_as_one(
    tmp_path: Path,
) -> None:
    base, tuned = pair(tmp_path, "safetensors", trained(base_state()))
    tuned.write_bytes(tuned.read_bytes()[:9])  # the header's length, then its "{"
    with pytest.raises(CheckpointReadError) as error:
        certify(base, tuned, spec=SPEC)
    assert _one_line(error).startswith(
        "tuned.safetensors: not a safetensors file or truncated in its header (header of "
    )
    assert _one_line(error).endswith("file of 9); re-copy or re-save the file")


def test_a_truncated_torch_file(tmp_path: Path) -> None:
    base, tuned = pair(tmp_path, "torch", trained(base_state()))
    _truncate(tuned, 0.5)
    with pytest.raises(CheckpointReadError) as error:
        certify(base, tuned, spec=SPEC)
    assert _one_line(error).startswith("tuned.pt: cannot be read as a torch.save zip file")


def test_a_truncated_shard_names_its_file_and_tensor(tmp_path: Path) -> None:
    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    with DcpCheckpoint(tuned) as reader:
        [source] = reader.sources("head.weight")
    _truncate(tuned / source.file, 0.5)
    with pytest.raises(CheckpointReadError) as error:
        certify(base, tuned, spec=SPEC)
    assert _one_line(error).startswith(f"tuned/{source.file}, tensor 'head.weight': the chunk")


def test_a_pickle_that_is_not_weights_only_is_refused_without_running_it(tmp_path: Path) -> None:
    base, _ = pair(tmp_path, "torch", trained(base_state()))
    torch.save({**base_state(), "config": _Opaque()}, tmp_path / "opaque.pt")
    with pytest.raises(CheckpointReadError) as error:
        certify(base, tmp_path / "opaque.pt", spec=SPEC)
    text = _one_line(error)
    assert text.startswith("opaque.pt: not a weights-only pickle (it needs ")
    assert "_mark_loaded" in text and not _Opaque.loaded
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointReadError, match=r"^plain\.pkl: a plain pickle"):
        certify(base, plain, spec=SPEC)


def test_dcp_metadata_with_foreign_classes_is_refused(tmp_path: Path) -> None:
    base, tuned = pair(tmp_path, "dcp", trained(base_state()))
    (tuned / ".metadata").write_bytes(pickle.dumps(_Opaque()))
    with pytest.raises(CheckpointReadError) as error:
        certify(base, tuned, spec=SPEC)
    assert _one_line(error).startswith("tuned/.metadata: holds more than checkpoint metadata")
    assert not _Opaque.loaded


def test_a_dtype_or_shape_mismatch_names_both_files_and_the_tensor(tmp_path: Path) -> None:
    tuned = trained(base_state())
    tuned["head.weight"] = tuned["head.weight"].double()
    with pytest.raises(CertificateError) as error:
        certify(*pair(tmp_path, "safetensors", tuned), spec=SPEC)
    assert _one_line(error) == (
        "base.safetensors, tensor 'head.weight' is float32[3, 6] but tuned.safetensors, tensor "
        "'head.weight' is float64[3, 6]: the dtype differs, so bits cannot be compared; "
        "compare checkpoints of one dtype, or leave the key out with ignore="
    )
    tuned["head.weight"] = torch.zeros(4, 6)
    with pytest.raises(CertificateError, match=r"the shape differs"):
        certify(*pair(tmp_path, "torch", tuned), spec=SPEC)


def test_a_selector_matching_no_key_names_the_file_and_the_closest_key(tmp_path: Path) -> None:
    files = pair(tmp_path, "torch", trained(base_state()))
    with pytest.raises(SelectorError) as error:
        certify(*files, spec={"freeze": ["trunc"]})
    assert _one_line(error).startswith(
        "certify(): 'trunc' matched none of the keys of base.pt; closest: ['trunk'"
    )
    with pytest.raises(SelectorError, match=r"'type:BatchNorm1d' selects by module class"):
        certify(*files, spec={"freeze": ["type:BatchNorm1d"]})
    with pytest.raises(SelectorError, match=r"the exclusion '!head' takes nothing out of"):
        certify(*files, spec={"freeze": ["trunk", "!head"]})
    with pytest.raises(CertificateError, match=r"rows= names 'embed\.weigth'.*'embed\.weight'"):
        certify(*files, spec=SPEC, rows={"embed.weigth": [1]})


def test_nothing_to_certify_is_an_error_not_a_vacuous_pass(tmp_path: Path) -> None:
    files = pair(tmp_path, "torch", trained(base_state()))
    with pytest.raises(CertificateError, match=r"nothing to certify"):
        certify(*files)
    with pytest.raises(CertificateError, match=r"adapter= needs adapter_config="):
        certify(*files, spec=SPEC, adapter=files[0])
    with pytest.raises(CertificateError, match=r"give spec= or adapter_config=, not both"):
        certify(*files, spec=SPEC, adapter_config={"r": 2, "lora_alpha": 4})


def test_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    base = save("torch", base_state(), tmp_path / "base.pt")
    with pytest.raises(CheckpointReadError, match=r"^notes\.txt: not a safetensors file"):
        certify(base, tmp_path / "notes.txt", spec=SPEC)
    with pytest.raises(CheckpointReadError, match=r"no such file or folder"):
        certify(base, tmp_path / "missing.pt", spec=SPEC)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointReadError, match=r"^empty: a folder without \.metadata"):
        certify(base, tmp_path / "empty", spec=SPEC)
    torch.save({"optimizer": {"lr": 1.0}, "epoch": 2}, tmp_path / "no_weights.pt")
    with pytest.raises(CheckpointReadError, match=r"^no_weights\.pt: holds no tensors"):
        certify(base, tmp_path / "no_weights.pt", spec=SPEC)


class _Opaque:
    """An object whose unpickling would be visible: certify must never unpickle it."""

    loaded = False

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_mark_loaded, ())


def _mark_loaded() -> _Opaque:
    _Opaque.loaded = True
    return _Opaque()
