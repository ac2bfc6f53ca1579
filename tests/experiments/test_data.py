"""Tests of ``experiments.data``: where MNIST is found, what is written where, and the errors.

Every test builds the data state it needs below ``tmp_path``: a copy of the two ``.gz`` files of
``../shared/data/MNIST/raw`` (the official test split), read-only folders made with ``chmod``,
tiny hand-made IDX files. No datamodule reads ``../shared`` itself, so the tests pass whether
that folder is writable or read-only and whatever an earlier run left there or in the user's
cache. An autouse fixture points the cache and the temp directory into ``tmp_path``, blocks the
network, and checks that ``../shared`` is left exactly as it was and no temporary file is left.
"""

from __future__ import annotations

import doctest
import gzip
import hashlib
import pickle
import shutil
import stat
import tempfile
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import experiments.data as data_mod
from experiments.data import (
    TEST_FILES,
    TRAIN_FILES,
    DataCorruptError,
    DataError,
    DataNotFoundError,
    MNISTDataModule,
    TestSplitOnlyWarning,
)
from isolate.errors import IsolationError
from tests._launch import REPO

SHARED = REPO.parent / "shared"
SHARED_MNIST_RAW = SHARED / "data" / "MNIST" / "raw"

DEBIAN_FASHION = data_mod.DEBIAN_FASHION_MNIST
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530


def _listing(root: Path) -> dict[str, tuple[str, int]]:
    """Every file and folder below ``root`` with its sha256 (files) and mode."""
    return {
        str(p.relative_to(root)): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir",
            stat.S_IMODE(p.stat().st_mode),
        )
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(autouse=True)
def hermetic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[urllib.request.Request]]:
    """No network, no system data, cache and temp files in tmp_path, ``../shared`` untouched."""
    calls: list[urllib.request.Request] = []

    def offline(request: urllib.request.Request, *args: Any, **kwargs: Any) -> Any:
        calls.append(request)
        raise urllib.error.URLError("no network in tests")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(data_mod, "SYSTEM_DATA_DIRS", {"mnist": (), "fashion_mnist": ()})
    monkeypatch.delenv("ISOLATE_DATA_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.chdir(tmp_path)  # the default data_root "data" is relative
    before = _listing(SHARED) if SHARED.is_dir() else None
    yield calls
    if before is not None:
        assert _listing(SHARED) == before, "a test wrote into ../shared"
    assert not any((tmp_path / "tmp").iterdir()), "temporary files were left behind"


@pytest.fixture
def shared_raw() -> Path:
    """``../shared/data/MNIST/raw``, the official MNIST test split; only ever copied from."""
    if not all((SHARED_MNIST_RAW / f"{name}.gz").is_file() for name in TEST_FILES):
        pytest.skip(f"the MNIST test split is not in ../shared/data/MNIST/raw ({SHARED_MNIST_RAW})")
    return SHARED_MNIST_RAW


@pytest.fixture
def mnist_root(tmp_path: Path, shared_raw: Path) -> Path:
    """A writable data root in tmp_path holding a copy of the two official ``.gz`` files."""
    return _copy_root(shared_raw, tmp_path / "root")


def _copy_root(shared_raw: Path, root: Path) -> Path:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in TEST_FILES:
        shutil.copyfile(shared_raw / f"{name}.gz", raw / f"{name}.gz")
    return root


@pytest.fixture
def read_only() -> Iterator[Callable[[Path], Path]]:
    """Make a folder below tmp_path read-only (r-x, files r--); undone afterwards."""
    made: list[Path] = []

    def make(root: Path) -> Path:
        for path in [*sorted(root.rglob("*"), reverse=True), root]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        made.append(root)
        return root

    yield make
    for root in made:  # so that pytest can delete tmp_path without root rights
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.fixture
def make(mnist_root: Path, tmp_path: Path) -> Callable[..., MNISTDataModule]:
    """Build a datamodule on a copy of the test split, no download."""

    def build(**kwargs: Any) -> MNISTDataModule:
        kwargs.setdefault("data_root", str(mnist_root))
        kwargs.setdefault("cache_dir", str(tmp_path / "cache"))
        kwargs.setdefault("download", False)
        return MNISTDataModule(**kwargs)

    return build


def _ready(dm: MNISTDataModule) -> MNISTDataModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TestSplitOnlyWarning)
        dm.prepare_data()
        dm.setup("fit")
    return dm


def _official_test_split(raw: Path) -> tuple[torch.Tensor, torch.Tensor]:
    content = {name: gzip.decompress((raw / f"{name}.gz").read_bytes()) for name in TEST_FILES}
    images = torch.frombuffer(bytearray(content[TEST_FILES[0]]), dtype=torch.uint8, offset=16)
    labels = torch.frombuffer(bytearray(content[TEST_FILES[1]]), dtype=torch.uint8, offset=8)
    return images.view(-1, 28, 28), labels.long()


def _to_uint8(x: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    return (x * std + mean).mul(255).round().to(torch.uint8)


def _idx(tensor: torch.Tensor) -> bytes:
    """An IDX file of uint8 labels (1-d) or 28x28 images (3-d)."""
    header = (0x0800 + tensor.dim()).to_bytes(4, "big")
    header += b"".join(d.to_bytes(4, "big") for d in tensor.shape)
    return header + tensor.to(torch.uint8).contiguous().numpy().tobytes()


def _fake_files(n_train: int, n_test: int) -> dict[str, bytes]:
    """Tiny train and test IDX files; image i is filled with the value i, label i % 10."""
    files = {}
    for (images_name, labels_name), n in ((TRAIN_FILES, n_train), (TEST_FILES, n_test)):
        values = torch.arange(n)
        files[images_name] = _idx(values.view(-1, 1, 1).expand(n, 28, 28))
        files[labels_name] = _idx(values % 10)
    return files


def _write_fake_split(folder: Path, n_train: int, n_test: int, *, gz: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in _fake_files(n_train, n_test).items():
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(content, mtime=0))
        else:
            (folder / name).write_bytes(content)


# -- the official test split, carved -------------------------------------------------------


def test_test_split_only_is_carved_into_disjoint_labelled_parts(make, mnist_root) -> None:
    dm = make()
    dm.prepare_data()
    with pytest.warns(TestSplitOnlyWarning, match=r"ONLY THE OFFICIAL TEST SPLIT"):
        dm.setup("fit")

    sets = {"train": dm.train_set, "val": dm.val_set, "test": dm.test_set}
    assert {k: len(v) for k, v in sets.items()} == {"train": 8000, "val": 1000, "test": 1000}
    info = dm.split_info
    assert (info["mode"], info["pool"], info["seed"], info["md5_verified"]) == (
        "test_split_only",
        10000,
        0,
        True,
    )
    assert {k: info[k] for k in sets} == {"train": 8000, "val": 1000, "test": 1000}
    raw = mnist_root / "MNIST" / "raw"
    assert info["files"] == {name: str(raw / f"{name}.gz") for name in TEST_FILES}
    for words in ("MNIST", "8,000", "1,000", "seed 0", "not comparable", str(raw)):
        assert words in dm.source_note
    assert "--data.download=true" in dm.source_note

    # Every served image is an official test image with its own label, each used exactly once.
    images, labels = _official_test_split(raw)
    label_of = {
        bytes(img.flatten().numpy()): int(lab) for img, lab in zip(images, labels, strict=True)
    }
    seen: list[bytes] = []
    for dataset in sets.values():
        x, y = dataset.tensors
        assert x.shape[1:] == (1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
        for img, lab in zip(_to_uint8(x, MNIST_MEAN, MNIST_STD), y, strict=True):
            key = bytes(img.flatten().numpy())
            assert label_of[key] == int(lab)
            seen.append(key)
    assert len(seen) == len(set(seen)) == 10000


def test_the_carve_is_the_one_reported_numbers_were_made_with(make) -> None:
    # Pinned: a different carve would silently change every accuracy in the README's report.
    dm = _ready(make())
    labels = {s: getattr(dm, f"{s}_set").tensors[1] for s in ("train", "val", "test")}
    assert labels["train"][:12].tolist() == [1, 2, 0, 4, 9, 2, 2, 6, 2, 8, 2, 9]
    assert labels["val"][:12].tolist() == [1, 7, 7, 5, 9, 1, 8, 6, 7, 8, 0, 1]
    assert labels["test"][:12].tolist() == [8, 1, 4, 8, 6, 4, 0, 7, 2, 3, 9, 2]
    assert [int(v.sum()) for v in labels.values()] == [35437, 4543, 4454]


def test_values_are_normalized_with_the_mnist_statistics(make) -> None:
    dm = _ready(make())
    x, y = dm.train_set.tensors
    assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05
    assert x.min().item() == pytest.approx(-MNIST_MEAN / MNIST_STD, abs=1e-5)
    assert x.max().item() == pytest.approx((1 - MNIST_MEAN) / MNIST_STD, abs=1e-5)
    counts = torch.bincount(y, minlength=10)
    assert len(counts) == 10 and counts.min().item() > 600  # every digit, roughly balanced
    assert (dm.mean, dm.std, dm.num_classes, dm.image_shape) == (
        MNIST_MEAN,
        MNIST_STD,
        10,
        (1, 28, 28),
    )


def test_the_split_depends_on_the_seed_only(make) -> None:
    a, b, c = _ready(make(seed=0)), _ready(make(seed=0)), _ready(make(seed=1))
    for split in ("train_set", "val_set", "test_set"):
        for ta, tb in zip(getattr(a, split).tensors, getattr(b, split).tensors, strict=True):
            assert torch.equal(ta, tb)
    assert not torch.equal(a.val_set.tensors[0], c.val_set.tensors[0])
    assert len(c.val_set) == len(a.val_set)


def test_batch_order_is_fixed_by_the_seed(make) -> None:
    a, b, c = (_ready(make(seed=s, batch_size=64, limit_train=640)) for s in (0, 0, 1))
    batches = [list(dm.train_dataloader()) for dm in (a, b, c)]
    assert len(batches[0]) == 10
    for (xa, ya), (xb, yb) in zip(batches[0], batches[1], strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(batches[0][0][1], batches[2][0][1])
    # Shuffled: the first batch is not the dataset's first 64 items.
    assert not torch.equal(batches[0][0][1], a.train_set.tensors[1][:64])
    # A second epoch of the same loader takes a new order.
    loader = a.train_dataloader()
    first, second = next(iter(loader))[1], next(iter(loader))[1]
    assert not torch.equal(first, second)
    # Validation and test keep the dataset order.
    xv, yv = next(iter(a.val_dataloader()))
    assert torch.equal(xv, a.val_set.tensors[0][:64]) and torch.equal(yv, a.val_set.tensors[1][:64])
    assert torch.equal(next(iter(a.test_dataloader()))[1], a.test_set.tensors[1][:64])


def test_limits_take_subsets_of_each_split(make) -> None:
    dm = _ready(make(limit_train=100, limit_val=30, limit_test=20))
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (100, 30, 20)
    full = _ready(make())
    assert torch.equal(dm.val_set.tensors[1], full.val_set.tensors[1][:30])
    assert "limit_train=100" in dm.source_note


# -- what is written where -------------------------------------------------------------------


def test_the_data_root_is_never_written_whether_writable_or_read_only(
    tmp_path, shared_raw, read_only
) -> None:
    writable = _copy_root(shared_raw, tmp_path / "writable")
    locked = read_only(_copy_root(shared_raw, tmp_path / "locked"))
    for root in (writable, locked, writable):  # twice in a row, as the README's commands run
        before = _listing(root)
        dm = _ready(MNISTDataModule(data_root=str(root), download=False))
        assert _listing(root) == before, f"{root.name}: the datamodule wrote into its data root"
        assert len(dm.train_set) == 8000
        assert dm.split_info["files"][TEST_FILES[0]] == str(
            root / "MNIST" / "raw" / f"{TEST_FILES[0]}.gz"
        )
    # torchvision's readers need decompressed files: those were temporary (the hermetic fixture
    # checks that they are gone), and nothing needed the cache.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locked", "tmp", "writable"]


def test_the_cache_defaults_to_xdg_then_home_then_temp(tmp_path, monkeypatch, read_only) -> None:
    assert MNISTDataModule().cache_dir == tmp_path / "xdg" / "isolate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert MNISTDataModule().cache_dir == tmp_path / "home" / ".cache" / "isolate"
    (tmp_path / "home").mkdir()
    read_only(tmp_path / "home")
    assert MNISTDataModule().cache_dir == tmp_path / "tmp" / "isolate"
    assert MNISTDataModule(cache_dir="mine").cache_dir == Path("mine")


def test_the_data_root_defaults_to_the_environment_then_data(tmp_path, monkeypatch) -> None:
    assert MNISTDataModule().data_root == Path("data")
    monkeypatch.setenv("ISOLATE_DATA_ROOT", str(tmp_path / "elsewhere"))
    assert MNISTDataModule().data_root == tmp_path / "elsewhere"
    assert MNISTDataModule(data_root="given").data_root == Path("given")


def test_gz_files_are_read_through_a_temporary_copy(tmp_path) -> None:
    _write_fake_split(tmp_path / "FashionMNIST" / "raw", 20, 10)
    dm = _ready(MNISTDataModule("fashion_mnist", data_root=str(tmp_path), verify_md5=False))
    assert len(dm.test_set) == 10
    assert not (tmp_path / "xdg").exists()  # the hermetic fixture checks the temporary copies
    assert sorted(p.name for p in (tmp_path / "FashionMNIST" / "raw").iterdir()) == sorted(
        f"{n}.gz" for n in (*TRAIN_FILES, *TEST_FILES)
    )


# -- errors ---------------------------------------------------------------------------------


def test_no_data_raises_data_not_found_with_the_flags_to_pass(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    before = sorted(tmp_path.rglob("*"))
    dm = MNISTDataModule(data_root="empty", download=False)
    with pytest.raises(DataNotFoundError, match=r"^MNISTDataModule: MNIST files not found") as e:
        dm.prepare_data()
    error = e.value
    assert isinstance(error, FileNotFoundError) and isinstance(error, DataError)
    assert not isinstance(error, IsolationError)  # a missing file is not an isolation failure
    message = str(error)
    for part in (
        *TEST_FILES,
        *TRAIN_FILES,
        "empty/MNIST/raw (--data.data_root)",
        f"{tmp_path / 'xdg' / 'isolate' / 'MNIST' / 'raw'} (--data.cache_dir",
        "ISOLATE_DATA_ROOT",
    ):
        assert part in message
    assert error.hint.startswith("To fix: pass --data.download=true (with network access)")
    assert "--data.data_root=PATH for a folder holding MNIST/raw/t10k-images" in error.hint
    assert message.endswith(error.hint)
    assert "download=True" not in message and "apt-get" not in message
    with pytest.raises(DataNotFoundError):
        dm.setup()
    assert sorted(tmp_path.rglob("*")) == before  # no empty folder left behind


def test_a_failed_download_leaves_no_empty_folders(tmp_path, hermetic) -> None:
    before = sorted(tmp_path.rglob("*"))
    dm = MNISTDataModule(data_root="empty", download=True)
    with pytest.raises(DataNotFoundError, match=r"download=True but the MNIST download") as e:
        dm.prepare_data()
    assert "--data.download=false" in e.value.hint
    assert "URLError" in str(e.value) and "t10k-images-idx3-ubyte.gz" in str(e.value)
    # Each mirror was tried once for the first file, and then the download stopped.
    assert [request.full_url for request in hermetic] == [
        f"{mirror}{TEST_FILES[0]}.gz" for mirror in data_mod._mirrors("MNIST")
    ]
    assert sorted(tmp_path.rglob("*")) == before


def test_data_errors_survive_pickling_with_their_hint() -> None:
    # DDP's spawn start method pickles exceptions across processes.
    for error in (DataNotFoundError("gone", "To fix: x"), DataCorruptError("bad", "To fix: y")):
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), str(copy), copy.hint) == (type(error), str(error), error.hint)


def test_fashion_not_found_lists_the_debian_place_and_package(tmp_path, monkeypatch) -> None:
    system = tmp_path / "usr-share-datasets-fashion-mnist"
    monkeypatch.setattr(data_mod, "SYSTEM_DATA_DIRS", {"mnist": (), "fashion_mnist": (system,)})
    dm = MNISTDataModule("fashion_mnist", data_root=str(tmp_path), download=False)
    with pytest.raises(DataNotFoundError, match=r"Fashion-MNIST files not found") as e:
        dm.prepare_data()
    assert f"{system} (installed by a system package)" in str(e.value)
    assert str(tmp_path / "FashionMNIST" / "raw") in str(e.value)
    assert "apt-get install dataset-fashion-mnist" in e.value.hint


def test_half_a_train_pair_is_not_mistaken_for_a_test_only_root(tmp_path) -> None:
    raw = tmp_path / "FashionMNIST" / "raw"
    _write_fake_split(raw, 20, 10)
    (raw / f"{TRAIN_FILES[1]}.gz").unlink()
    dm = MNISTDataModule("fashion_mnist", data_root=str(tmp_path), verify_md5=False)
    with pytest.raises(DataNotFoundError, match=r"missing train-labels-idx1-ubyte\[\.gz\]\."):
        dm.setup()


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip(data: bytes) -> bytes:
    blob = bytearray(data)
    blob[len(blob) // 2] ^= 0xFF
    return bytes(blob)


def _edit_content(data: bytes) -> bytes:
    return gzip.compress(_flip(gzip.decompress(data)), compresslevel=1)


# Cases run in a loop rather than parametrized: the suite's conftest pays ~0.5 s per test item.
GZ_DAMAGE = {
    "truncated": (TEST_FILES[1], _truncate, r"is not a valid gzip file \("),
    "flipped-byte": (TEST_FILES[0], _flip, r"idx3-ubyte\.gz (is not a valid gzip|has the wrong)"),
    "edited-content": (
        TEST_FILES[0],
        _edit_content,
        r"md5 expected 9fb629c4189551a2d022fa330f9573f3 \(torchvision's resource list\), got "
        r"[0-9a-f]{32}; its content's md5 expected 2646ac647ad5339dbf082846283269ea",
    ),
}


def test_damaged_gz_files_raise_data_corrupt(tmp_path, shared_raw) -> None:
    for case, (name, damage, match) in GZ_DAMAGE.items():
        root = _copy_root(shared_raw, tmp_path / case)
        gz = root / "MNIST" / "raw" / f"{name}.gz"
        gz.write_bytes(damage(gz.read_bytes()))
        dm = MNISTDataModule(data_root=str(root), download=False)
        dm.prepare_data()  # finds the files; setup() reads and checks them
        with pytest.raises(DataCorruptError, match=match) as e:
            dm.setup()
        assert isinstance(e.value, ValueError) and isinstance(e.value, DataError), case
        assert not isinstance(e.value, IsolationError), case
        assert str(e.value).startswith(f"MNISTDataModule: {gz} "), case
        assert e.value.hint.startswith(f"To fix: delete or replace {gz}: download"), case


def test_a_recompressed_gz_of_the_official_content_is_accepted(tmp_path, shared_raw) -> None:
    # The Debian package ships .gz files like this: other bytes, the same content.
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in TEST_FILES:
        content = gzip.decompress((shared_raw / f"{name}.gz").read_bytes())
        (raw / f"{name}.gz").write_bytes(gzip.compress(content, compresslevel=1, mtime=0))
    assert hashlib.md5((raw / f"{TEST_FILES[0]}.gz").read_bytes()).hexdigest() != (
        "9fb629c4189551a2d022fa330f9573f3"
    )
    dm = MNISTDataModule(data_root=str(tmp_path), cache_dir=str(tmp_path / "c"), download=False)
    assert len(_ready(dm).train_set) == 8000


IDX_DAMAGE = {
    "short-images": (
        TEST_FILES[0],
        lambda b: b[:-784],
        r"images-idx3-ubyte is not a complete IDX file .*\[20, 28, 28\]' is invalid for input of "
        r"size 14896",
    ),
    "long-labels": (
        TEST_FILES[1],
        lambda b: b + b"\x00",
        r"labels-idx1-ubyte is not a complete IDX file .*size 21",
    ),
    "bad-label": (TEST_FILES[1], lambda b: b[:8] + b"\x0c" + b[9:], r"holds label 12; expected"),
    "bad-magic": (TEST_FILES[0], lambda b: b"\x00\x00\x08\x01" + b[4:], r"not a complete IDX"),
    "bad-shape": (
        TEST_FILES[0],
        lambda b: b[:8] + (14).to_bytes(4, "big") + (56).to_bytes(4, "big") + b[16:],
        r"holds 14x56 images; expected 28x28",
    ),
}


def test_broken_idx_files_raise_even_without_md5(tmp_path) -> None:
    for case, (name, damage, match) in IDX_DAMAGE.items():
        raw = tmp_path / case / "FashionMNIST" / "raw"
        _write_fake_split(raw, 30, 20, gz=False)
        (raw / name).write_bytes(damage((raw / name).read_bytes()))
        dm = MNISTDataModule("fashion_mnist", data_root=str(tmp_path / case), verify_md5=False)
        with pytest.raises(DataCorruptError, match=match) as e:
            dm.setup()
        assert str(e.value).startswith(f"MNISTDataModule: {raw / name} "), case


def test_images_and_labels_of_different_lengths_are_refused(tmp_path) -> None:
    raw = tmp_path / "FashionMNIST" / "raw"
    _write_fake_split(raw, 30, 20, gz=False)
    (raw / TEST_FILES[1]).write_bytes(_idx(torch.arange(19) % 10))
    dm = MNISTDataModule("fashion_mnist", data_root=str(tmp_path), verify_md5=False)
    with pytest.raises(DataCorruptError, match=r"holds 20 images but .* holds 19 labels"):
        dm.setup()


def test_arguments_are_checked_before_anything_happens(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"dataset='cifar' is unknown"):
        MNISTDataModule("cifar")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"val_fraction=1.0 must be in \(0, 1\)"):
        MNISTDataModule(val_fraction=1.0)
    with pytest.raises(ValueError, match=r"test_fraction=0.5 must be in \(0, 1\) and leave"):
        MNISTDataModule(val_fraction=0.5, test_fraction=0.5)
    with pytest.raises(ValueError, match=r"limit_train=0 must be at least 1"):
        MNISTDataModule(limit_train=0)
    with pytest.raises(RuntimeError, match=r"call prepare_data\(\) and setup\(\)"):
        MNISTDataModule().train_dataloader()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]


# -- Fashion-MNIST and the full split -------------------------------------------------------


def test_fashion_full_split_from_tiny_hand_made_files(tmp_path) -> None:
    _write_fake_split(tmp_path / "FashionMNIST" / "raw", 60, 20)
    dm = MNISTDataModule("fashion_mnist", data_root=str(tmp_path), verify_md5=False, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TestSplitOnlyWarning)
        dm.prepare_data()
        dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (54, 6, 20)
    assert dm.split_info["mode"] == "official" and not dm.split_info["md5_verified"]
    assert dm.source_note.startswith("Fashion-MNIST: official split.")
    assert "not verified" in dm.source_note
    # The official test set is served whole and in order; train and val partition the train set.
    x, y = dm.test_set.tensors
    assert torch.equal(y, torch.arange(20) % 10)
    assert torch.equal(_to_uint8(x, FASHION_MEAN, FASHION_STD)[:, 0, 0, 0], torch.arange(20).byte())
    assert x[5, 0, 3, 7].item() == pytest.approx((5 / 255 - FASHION_MEAN) / FASHION_STD, abs=1e-6)
    seen = [
        int(v)
        for s in (dm.train_set, dm.val_set)
        for v in _to_uint8(s.tensors[0], FASHION_MEAN, FASHION_STD)[:, 0, 0, 0]
    ]
    assert sorted(seen) == list(range(60))
    assert dm.classes[9] == "Ankle boot"


def test_hand_made_files_fail_the_md5_check_with_a_hint(tmp_path) -> None:
    _write_fake_split(tmp_path / "FashionMNIST" / "raw", 20, 10)
    dm = MNISTDataModule("fashion_mnist", data_root=str(tmp_path))
    with pytest.raises(DataCorruptError, match=r"has the wrong checksum") as e:
        dm.setup()
    assert e.value.hint.endswith(
        "For IDX files you made yourself, pass --data.verify_md5=false instead."
    )


def test_fashion_in_the_debian_layout_is_found(tmp_path, monkeypatch) -> None:
    debian = tmp_path / "fashion-mnist"  # files side by side, as dataset-fashion-mnist has them
    _write_fake_split(debian, 40, 10)
    monkeypatch.setattr(data_mod, "SYSTEM_DATA_DIRS", {"mnist": (), "fashion_mnist": (debian,)})
    dm = _ready(MNISTDataModule("fashion_mnist", data_root="nowhere", verify_md5=False))
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (36, 4, 10)
    assert dm.split_info["files"][TRAIN_FILES[0]] == str(debian / f"{TRAIN_FILES[0]}.gz")
    assert not Path("nowhere").exists()


@pytest.mark.skipif(
    not (DEBIAN_FASHION / f"{TRAIN_FILES[0]}.gz").is_file(),
    reason="the Debian package dataset-fashion-mnist is not installed",
)
def test_the_real_debian_fashion_package_passes_the_md5_check(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(data_mod, "SYSTEM_DATA_DIRS", {"fashion_mnist": (DEBIAN_FASHION,)})
    dm = _ready(MNISTDataModule("fashion_mnist", data_root="nowhere", cache_dir=str(tmp_path)))
    assert (dm.split_info["mode"], len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (
        "official",
        54000,
        6000,
        10000,
    )
    assert abs(dm.train_set.tensors[0].mean().item()) < 0.02
    assert torch.bincount(dm.test_set.tensors[1]).tolist() == [1000] * 10


# -- downloading ----------------------------------------------------------------------------


class _Response:
    """What urllib.request.urlopen returns, serving ``body`` in chunks."""

    def __init__(self, request: urllib.request.Request, body: bytes) -> None:
        self.url, self.length, self._body = request.full_url, len(body), body

    def read(self, size: int = -1) -> bytes:
        size = len(self._body) if size < 0 else size
        chunk, self._body = self._body[:size], self._body[size:]
        return chunk

    def __enter__(self) -> _Response:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def test_an_offline_download_falls_back_to_the_files_on_disk(make, hermetic) -> None:
    dm = make(download=None)
    with pytest.warns(UserWarning, match=r"could not download MNIST \(train-images-idx3-ubyte"):
        dm.prepare_data()
    assert hermetic, "the download was not even tried"
    # Only the missing train pair was asked for, never the test split that is on disk.
    assert all("train-" in request.full_url for request in hermetic)
    with pytest.warns(TestSplitOnlyWarning):
        dm.setup()
    assert len(dm.train_set) == 8000


def test_no_download_is_tried_when_not_allowed_or_not_needed(make, tmp_path, hermetic) -> None:
    _ready(make(download=False))
    _write_fake_split(tmp_path / "full" / "FashionMNIST" / "raw", 20, 10)
    _ready(MNISTDataModule("fashion_mnist", data_root=str(tmp_path / "full"), verify_md5=False))
    assert hermetic == []


def test_a_download_lands_in_the_cache_all_or_nothing(tmp_path, monkeypatch) -> None:
    files = {f"{name}.gz": gzip.compress(c, mtime=0) for name, c in _fake_files(30, 10).items()}
    md5 = {name: hashlib.md5(body).hexdigest() for name, body in files.items()}
    served: list[str] = []
    broken: set[str] = set()

    def server(request: urllib.request.Request, *args: Any, **kwargs: Any) -> _Response:
        name = request.full_url.rsplit("/", 1)[-1]
        served.append(name)
        body = files[name]
        return _Response(request, body[: len(body) // 2] if name in broken else body)

    monkeypatch.setattr(urllib.request, "urlopen", server)
    monkeypatch.setattr(data_mod, "_resources", lambda folder: md5)
    monkeypatch.setattr(data_mod, "_mirrors", lambda folder: ["https://mirror.invalid/"])
    root = tmp_path / "root"
    _write_fake_split(root / "FashionMNIST" / "raw", 0, 10)
    for name in TRAIN_FILES:
        (root / "FashionMNIST" / "raw" / f"{name}.gz").unlink()
    before = _listing(root)
    cache_raw = tmp_path / "xdg" / "isolate" / "FashionMNIST" / "raw"

    # The labels arrive broken: the images, complete on their own, must not land either.
    broken.add(f"{TRAIN_FILES[1]}.gz")
    dm = MNISTDataModule("fashion_mnist", data_root=str(root), verify_md5=False)
    with pytest.warns(UserWarning, match=r"could not download Fashion-MNIST .*corrupted"):
        dm.prepare_data()
    assert not (tmp_path / "xdg").exists()

    broken.clear()
    served.clear()
    dm = _ready(MNISTDataModule("fashion_mnist", data_root=str(root), verify_md5=False))
    assert {f"{n}.gz" for n in TRAIN_FILES} <= set(served)
    assert not any(name.startswith("t10k") for name in served)
    assert dm.split_info["mode"] == "official" and len(dm.train_set) == 27
    assert dm.split_info["files"][TRAIN_FILES[0]] == str(cache_raw / TRAIN_FILES[0])
    assert sorted(p.name for p in cache_raw.iterdir()) == sorted(
        [*TRAIN_FILES, *(f"{n}.gz" for n in TRAIN_FILES)]
    )
    assert _listing(root) == before


# -- integration ----------------------------------------------------------------------------


def test_a_trainer_runs_on_it(make, tmp_path) -> None:
    import pytorch_lightning as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(28 * 28, 10)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = make(batch_size=32, limit_train=128, limit_val=64)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and small datasets
        trainer.fit(Net(), datamodule=dm)
    assert trainer.global_step == 8
    assert torch.isfinite(trainer.callback_metrics["val_loss"])


def test_jsonargparse_reads_the_signature() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MNISTDataModule, "data")
    cfg = parser.parse_args(
        ["--data.dataset=fashion_mnist", "--data.limit_train=100", "--data.download=false"]
    )
    assert (cfg.data.dataset, cfg.data.limit_train, cfg.data.download) == (
        "fashion_mnist",
        100,
        False,
    )
    assert (cfg.data.data_root, cfg.data.batch_size, cfg.data.seed) == (None, 128, 0)
    with pytest.raises(jsonargparse.ArgumentError):
        parser.parse_args(["--data.dataset=cifar"])


def test_the_module_doctests_pass() -> None:
    result = doctest.testmod(data_mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_data_root_that_does_not_exist_is_named_before_any_download(tmp_path, hermetic) -> None:
    dm = MNISTDataModule(data_root=str(tmp_path / "typo"))  # download=None: would download
    with pytest.raises(DataNotFoundError) as e:
        dm.prepare_data()
    assert hermetic == []  # no network: the missing folder is the likelier mistake
    assert f"(--data.data_root): the folder {tmp_path / 'typo'} does not exist" in str(e.value)
    assert e.value.hint.startswith(f"To fix: the data root {tmp_path / 'typo'} does not exist")
    dm = MNISTDataModule(data_root=str(tmp_path / "typo"), download=True)  # asked for: tried
    with pytest.raises(DataNotFoundError, match="download=True but the MNIST download"):
        dm.prepare_data()
    assert hermetic
