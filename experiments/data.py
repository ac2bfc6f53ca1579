"""MNIST and Fashion-MNIST as an in-memory ``LightningDataModule`` that also works offline.

Where the data come from: for each file, the first of

1. ``data_root/<Folder>/raw`` (``<Folder>`` is ``MNIST`` or ``FashionMNIST``), torchvision's
   layout, ``.gz`` or decompressed. The data root may be read-only (``../shared/data`` is);
   nothing is ever written next to a read-only root.
2. For Fashion-MNIST only, ``/usr/share/datasets/fashion-mnist``, where the Debian package
   ``dataset-fashion-mnist`` puts the four ``.gz`` files.
3. ``cache_dir/<Folder>/raw``, where torchvision downloads go.

``prepare_data`` leaves a decompressed copy of each verified ``.gz`` in ``cache_dir``, and later
runs read that copy in place of the ``.gz`` (reports still name the ``.gz`` it came from).

Before searching, ``prepare_data`` asks torchvision to download the files into ``cache_dir`` if
the full official split is not on disk (see ``download``). Every file is checked before use: a
``.gz`` against the md5 in torchvision's resource list, or else its decompressed content against
the md5 of the official uncompressed file (the Debian package ships recompressed ``.gz`` files of
the same content); a decompressed file against the latter; and every file's IDX header (magic
number, 28x28 images, byte count) and labels (0..9), so truncated or corrupt files raise
:class:`DataCorruptError` instead of training on garbage.

When only the official test split (``t10k-*``, 10,000 images) is found, as in ``../shared/data``,
train, validation and test sets are carved from it with a seeded permutation, and the datamodule
says so in a warning, in :attr:`MNISTDataModule.source_note` and in
:attr:`MNISTDataModule.split_info`.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import logging
import os
import socket
import stat
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, TensorDataset

from isolate.errors import IsolationError

__all__ = [
    "DataCorruptError",
    "DataNotFoundError",
    "MNISTDataModule",
    "TestSplitOnlyWarning",
]

log = logging.getLogger(__name__)

ENV_DATA_ROOT = "ISOLATE_DATA_ROOT"
"""Environment variable read when ``data_root`` is not given."""

DOWNLOAD_TIMEOUT_S = 10.0
"""Socket timeout while torchvision downloads, so a network that drops packets fails fast."""

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
"""Where the Debian package ``dataset-fashion-mnist`` installs the four ``.gz`` files."""

SYSTEM_DATA_DIRS: dict[str, tuple[Path, ...]] = {
    "mnist": (),
    "fashion_mnist": (DEBIAN_FASHION_MNIST,),
}
"""Folders searched after the data root, each holding the ``.gz`` files side by side."""

TRAIN_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
TEST_FILES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

# md5 of the official *uncompressed* IDX files. torchvision lists only the .gz checksums, and a
# recompressed .gz (the Debian package's) has another md5 but the same content.
_RAW_MD5 = {
    "mnist": {
        "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
        "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
        "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
        "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
    },
    "fashion_mnist": {
        "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
        "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
        "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
    },
}

_IMAGE_SIDE = 28
_NUM_CLASSES = 10


class DataNotFoundError(IsolationError, FileNotFoundError):
    """The IDX files of a dataset are in none of the places searched."""


class DataCorruptError(IsolationError, ValueError):
    """A data file is truncated, has the wrong checksum, or is not a valid IDX file."""


class TestSplitOnlyWarning(UserWarning):
    """Only the official test split was found; train and validation sets are carved from it."""

    __test__ = False  # keeps pytest from collecting this class when a test module imports it


@dataclass(frozen=True)
class _Spec:
    folder: str  # torchvision's class name, which is also its folder under the root
    title: str
    mean: float
    std: float
    classes: tuple[str, ...]


_SPECS = {
    "mnist": _Spec("MNIST", "MNIST", 0.1307, 0.3081, tuple(str(i) for i in range(10))),
    "fashion_mnist": _Spec(
        "FashionMNIST",
        "Fashion-MNIST",
        0.2860,
        0.3530,
        (
            "T-shirt/top",
            "Trouser",
            "Pullover",
            "Dress",
            "Coat",
            "Sandal",
            "Shirt",
            "Sneaker",
            "Bag",
            "Ankle boot",
        ),
    ),
}


class MNISTDataModule(pl.LightningDataModule):
    """MNIST or Fashion-MNIST held in memory as normalized tensors.

    Images are served as float32 tensors of shape ``(1, 28, 28)``, standardized with the
    dataset's usual mean and std, and labels as int64 in ``0..9``, through ``TensorDataset`` and
    plain ``DataLoader`` objects (no per-item transforms). The train loader shuffles with a
    ``torch.Generator`` seeded from ``seed``; the validation and test loaders keep a fixed order.

    With the official split on disk, train and validation are a seeded split of the 60,000
    training images and test is the official 10,000-image test set. With only the test split,
    train, validation and test are disjoint seeded parts of those 10,000 images.

    Args:
        dataset: ``"mnist"`` or ``"fashion_mnist"``.
        data_root: Root folder in torchvision's layout (``<root>/MNIST/raw/...``). Defaults to the
            ``ISOLATE_DATA_ROOT`` environment variable, else ``"data"``. May be read-only.
        cache_dir: Writable root (same layout) for downloads and decompressed copies. Defaults
            to ``data_root`` when that is writable, else ``$XDG_CACHE_HOME/isolate`` (or
            ``~/.cache/isolate``), else a folder in the system temp directory.
        batch_size: Batch size of all three loaders.
        val_fraction: Share of the carved pool that goes to validation.
        test_fraction: Share of the 10,000 test images held out as the test set when only the
            test split is available; unused with the official split.
        seed: Seeds both the split and the train loader's shuffling.
        num_workers: ``DataLoader`` workers; 0 is fastest for in-memory tensors.
        download: ``None`` tries a torchvision download into ``cache_dir`` when the official
            split is missing and, if that fails, warns and uses what is on disk; ``True`` does the
            same but a failed download raises; ``False`` never touches the network.
        verify_md5: Check every file against the official md5 (see the module docstring). Turn
            off only for IDX files you made yourself; the IDX header, byte count and label range
            are checked either way.
        limit_train: Keep at most this many training images (a seeded subset), for fast runs.
        limit_val: Same for validation.
        limit_test: Same for test.

    Attributes:
        source_note: One human-readable paragraph on where the data came from and how it was
            split; set by :meth:`setup`, printable in a report.
        split_info: The same as a dict: ``dataset``, ``mode`` (``"official"`` or
            ``"test_split_only"``), ``seed``, the ``train``/``val``/``test`` counts, ``pool``
            (the size of the set carved from), ``files`` (official name to its path) and
            ``md5_verified``.
            The paths in ``files`` are where each file was found, even when a decompressed copy
            in ``cache_dir`` was read in its place.

    Raises:
        ValueError: On an unknown dataset name or a fraction or limit out of range.

    Note:
        The order is identical across runs only within one process layout: under a distributed
        strategy Lightning swaps the shuffling sampler for a ``DistributedSampler``, and
        ``train_dataloader`` reseeds from ``seed`` plus the trainer's current epoch each time it
        is called, so a resumed run does not replay the order of an uninterrupted one.

    Example:
        >>> dm = MNISTDataModule(dataset="fashion_mnist", batch_size=64, download=False)
        >>> dm.hparams.batch_size, dm.num_classes, dm.classes[0]
        (64, 10, 'T-shirt/top')
    """

    num_classes = _NUM_CLASSES
    image_shape = (1, _IMAGE_SIDE, _IMAGE_SIDE)

    def __init__(
        self,
        dataset: Literal["mnist", "fashion_mnist"] = "mnist",
        data_root: str | None = None,
        cache_dir: str | None = None,
        batch_size: int = 128,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
        download: bool | None = None,
        verify_md5: bool = True,
        limit_train: int | None = None,
        limit_val: int | None = None,
        limit_test: int | None = None,
    ) -> None:
        super().__init__()
        if dataset not in _SPECS:
            raise ValueError(
                f"MNISTDataModule: dataset={dataset!r} is unknown; choose one of {sorted(_SPECS)}"
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"MNISTDataModule: val_fraction={val_fraction} must be in (0, 1)")
        if not 0.0 < test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
            raise ValueError(
                f"MNISTDataModule: test_fraction={test_fraction} must be in (0, 1) and leave "
                f"room for training next to val_fraction={val_fraction}"
            )
        for name, value in [
            ("batch_size", batch_size),
            ("limit_train", limit_train),
            ("limit_val", limit_val),
            ("limit_test", limit_test),
        ]:
            if value is not None and value < 1:
                raise ValueError(f"MNISTDataModule: {name}={value} must be at least 1")
        if num_workers < 0:
            raise ValueError(f"MNISTDataModule: num_workers={num_workers} must be at least 0")
        self.save_hyperparameters()

        self.dataset = dataset
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.download = download
        self.verify_md5 = verify_md5
        self.limit_train = limit_train
        self.limit_val = limit_val
        self.limit_test = limit_test
        self._spec = _SPECS[dataset]
        self.classes = self._spec.classes
        self.mean = self._spec.mean
        self.std = self._spec.std
        self.data_root = Path(data_root or os.environ.get(ENV_DATA_ROOT) or "data")
        self.cache_dir = (
            Path(cache_dir) if cache_dir else _default_cache_dir(self.data_root, self._spec)
        )
        self.source_note = "setup() has not run yet."
        self.split_info: dict[str, Any] = {}
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None
        self._download_error: str | None = None

    # -- Lightning hooks --------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Download if needed and allowed, then leave decompressed, verified copies in the cache.

        Runs once per node (Lightning calls it on local rank 0 only); :meth:`setup` only reads.

        Raises:
            DataNotFoundError: If the test split is nowhere to be found, or ``download=True``
                and the download failed.
            DataCorruptError: If a file fails its checks.
        """
        download = self.download
        if download is not False and not self._has_official_split():
            self._try_download(required=download is True)
        for name, (path, _) in self._locate().items():
            if path.suffix != ".gz":
                continue
            raw = self._read(name, path)
            if self.verify_md5:
                # The cache holds only official content, which can stand in for any good copy.
                self._store(name, raw)

    def setup(self, stage: str | None = None) -> None:
        """Load, normalize and split the data; later calls do nothing.

        Args:
            stage: Lightning's stage name; all three splits are built whatever it is.

        Raises:
            DataNotFoundError: If the test split is nowhere to be found.
            DataCorruptError: If a file fails its checks.
        """
        if self.train_set is not None:
            return
        located = self._locate()
        files = {name: origin for name, (_, origin) in located.items()}
        arrays = {name: self._read_idx(name, path) for name, (path, _) in located.items()}
        for images_name, labels_name in (TRAIN_FILES, TEST_FILES):
            if images_name in arrays and len(arrays[images_name]) != len(arrays[labels_name]):
                raise DataCorruptError(
                    f"MNISTDataModule: {files[images_name]} holds {len(arrays[images_name])} "
                    f"images but {files[labels_name]} holds {len(arrays[labels_name])} labels; "
                    "they must come from the same release. Delete both and download them again."
                )
        test_x, test_y = arrays[TEST_FILES[0]], arrays[TEST_FILES[1]].long()
        if TRAIN_FILES[0] in arrays:
            mode = "official"
            pool_x, pool_y = arrays[TRAIN_FILES[0]], arrays[TRAIN_FILES[1]].long()
            pool = len(pool_y)
            n_val = round(self.val_fraction * pool)
            val_idx, train_idx = torch.split(_permutation(pool, self.seed), [n_val, pool - n_val])
            # The official test set is kept whole and in order unless a limit asks for a subset.
            test_idx = (
                torch.arange(len(test_y))
                if self.limit_test is None
                else _permutation(len(test_y), self.seed)
            )
            parts = {
                "train": (pool_x, pool_y, train_idx),
                "val": (pool_x, pool_y, val_idx),
                "test": (test_x, test_y, test_idx),
            }
        else:
            mode = "test_split_only"
            pool = len(test_y)
            n_val = round(self.val_fraction * pool)
            n_test = round(self.test_fraction * pool)
            val_idx, test_idx, train_idx = torch.split(
                _permutation(pool, self.seed), [n_val, n_test, pool - n_val - n_test]
            )
            parts = {
                "train": (test_x, test_y, train_idx),
                "val": (test_x, test_y, val_idx),
                "test": (test_x, test_y, test_idx),
            }
        limits = {"train": self.limit_train, "val": self.limit_val, "test": self.limit_test}
        sets = {}
        for split, (x, y, idx) in parts.items():
            idx = idx[: limits[split]]
            if len(idx) == 0:
                raise ValueError(
                    f"MNISTDataModule: the {split} split came out empty from a pool of {pool} "
                    f"images with val_fraction={self.val_fraction}, "
                    f"test_fraction={self.test_fraction}; adjust the fractions or use more data"
                )
            sets[split] = TensorDataset(self._normalize(x[idx]), y[idx])
        self.train_set, self.val_set, self.test_set = sets["train"], sets["val"], sets["test"]
        self._describe(mode, files, pool, {k: len(v) for k, v in sets.items()})

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        """Shuffled batches in an order fixed by ``seed`` (and the trainer's epoch, if any)."""
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return self._loader(self._require(self.train_set), shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        """Validation batches in a fixed order."""
        return self._loader(self._require(self.val_set), shuffle=False)

    def test_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        """Test batches in a fixed order."""
        return self._loader(self._require(self.test_set), shuffle=False)

    # -- finding and reading files ----------------------------------------------------------

    def _search_dirs(self) -> list[tuple[Path, str]]:
        folder = self._spec.folder
        dirs = [(self.data_root / folder / "raw", "data_root")]
        dirs += [(d, "system default") for d in SYSTEM_DATA_DIRS.get(self.dataset, ())]
        dirs.append((self.cache_dir / folder / "raw", "cache_dir"))
        unique: dict[Path, tuple[Path, str]] = {}
        for path, why in dirs:
            unique.setdefault(path.absolute(), (path, why))
        return list(unique.values())

    def _find(self, name: str) -> tuple[Path, Path] | None:
        """The path to read for one official file and the path it came from, if any."""
        cached = self.cache_dir / self._spec.folder / "raw" / name
        for directory, _ in self._search_dirs():
            # torchvision leaves both forms side by side; the decompressed one reads faster.
            for origin in (directory / name, directory / f"{name}.gz"):
                if not origin.is_file():
                    continue
                # A cached copy is verified official content: it may stand in for a .gz only
                # when that .gz must be official content too.
                if origin.suffix == ".gz" and self.verify_md5 and cached.is_file():
                    return cached, origin
                return origin, origin
        return None

    def _locate(self) -> dict[str, tuple[Path, Path]]:
        """Map each official file name to (path to read, origin); the train pair is optional."""
        found = {name: self._find(name) for name in (*TEST_FILES, *TRAIN_FILES)}
        missing = [name for name, paths in found.items() if paths is None]
        # Half a train pair means a broken copy or download, not a test-only data root.
        if any(name in missing for name in TEST_FILES) or len(missing) == 1:
            raise DataNotFoundError(self._not_found_message(missing))
        return {name: paths for name, paths in found.items() if paths is not None}

    def _has_official_split(self) -> bool:
        return all(self._find(name) is not None for name in (*TEST_FILES, *TRAIN_FILES))

    def _not_found_message(self, missing: list[str]) -> str:
        title = self._spec.title
        searched = "\n".join(f"  - {path} ({why})" for path, why in self._search_dirs())
        how = [
            "run once with network access (download=None or True) so torchvision downloads "
            f"them into cache_dir={self.cache_dir}",
            f"or point data_root (or the {ENV_DATA_ROOT} environment variable) at a folder "
            f"holding {self._spec.folder}/raw/<files> in torchvision's layout",
        ]
        if self.dataset == "fashion_mnist":
            how.append(
                "or install the Debian package: apt-get install dataset-fashion-mnist "
                f"(it puts them in {DEBIAN_FASHION_MNIST})"
            )
        tried = ""
        if self._download_error is not None:
            tried = f"\nA download was tried and failed: {self._download_error}"
        return (
            f"MNISTDataModule: {title} files not found: missing "
            + ", ".join(f"{n}[.gz]" for n in missing)
            + f". Needed: {' and '.join(TEST_FILES)} (the official test split, enough on its "
            f"own), plus {' and '.join(TRAIN_FILES)} for the official train split, each "
            ".gz or decompressed.\nSearched:\n"
            + searched
            + "\nTo get them: "
            + "; ".join(how)
            + "."
            + tried
        )

    def _read(self, name: str, path: Path) -> bytes:
        """The checked, decompressed bytes of one official file."""
        data = path.read_bytes()
        fix = (
            f"Delete or replace {path}: download it again (run once with network access) or "
            "copy a good one"
        )
        own_files = "; for IDX files you made yourself, pass verify_md5=False"
        raw_md5 = _RAW_MD5[self.dataset][name]
        got_md5 = hashlib.md5(data).hexdigest()
        if path.suffix == ".gz":
            gz_md5 = _torchvision_md5(self._spec.folder)[f"{name}.gz"]
            try:
                raw = gzip.decompress(data)
            except (OSError, EOFError, zlib.error) as exc:
                raise DataCorruptError(
                    f"MNISTDataModule: {path} is not a valid gzip file ({exc}); md5 expected "
                    f"{gz_md5} (torchvision's {self._spec.folder} resource list), got {got_md5}, "
                    f"size {len(data)} bytes. {fix}."
                ) from exc
            if self.verify_md5 and got_md5 != gz_md5:
                content_md5 = hashlib.md5(raw).hexdigest()
                if content_md5 != raw_md5:
                    raise DataCorruptError(
                        f"MNISTDataModule: {path} has the wrong checksum: md5 expected {gz_md5} "
                        f"(torchvision's {self._spec.folder} resource list), got {got_md5}; its "
                        f"content's md5 expected {raw_md5} (the official {name}), got "
                        f"{content_md5}. {fix}{own_files}."
                    )
        else:
            raw = data
            if self.verify_md5 and got_md5 != raw_md5:
                raise DataCorruptError(
                    f"MNISTDataModule: {path} has the wrong checksum: md5 expected {raw_md5} (the "
                    f"official {name}), got {got_md5}, size {len(raw)} bytes. {fix}{own_files}."
                )
        _check_idx(raw, name, path, fix)
        return raw

    def _read_idx(self, name: str, path: Path) -> torch.Tensor:
        raw = self._read(name, path)
        if "images" in name:
            images = torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=16)
            return images.view(-1, _IMAGE_SIDE, _IMAGE_SIDE)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=8)

    def _store(self, name: str, raw: bytes) -> None:
        target = self.cache_dir / self._spec.folder / "raw" / name
        if target.is_file():
            return
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename, so an interrupted run or a parallel one never sees half a file.
            tmp = target.with_name(f"{name}.tmp-{os.getpid()}")
            tmp.write_bytes(raw)
            tmp.replace(target)
        except OSError as exc:
            # The cache only saves decompressing again; setup() reads the .gz just as well.
            log.warning("could not cache %s in %s: %s", name, target.parent, exc)
        else:
            log.info("cached a decompressed copy of %s in %s", name, target.parent)

    def _try_download(self, *, required: bool) -> None:
        from torchvision import datasets

        raw_dir = self.cache_dir / self._spec.folder / "raw"
        before = set(raw_dir.iterdir()) if raw_dir.is_dir() else set()
        previous_timeout = socket.getdefaulttimeout()
        # torchvision's urlopen has no timeout of its own; a network that drops packets would
        # otherwise hang prepare_data indefinitely.
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
        try:
            getattr(datasets, self._spec.folder)(str(self.cache_dir), train=False, download=True)
        except Exception as exc:  # torchvision raises RuntimeError, urllib OSError, http more
            self._download_error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            self._discard_partial_downloads(raw_dir, before)
            if required:
                raise DataNotFoundError(
                    f"MNISTDataModule: download=True but the {self._spec.title} download "
                    f"into {raw_dir} failed: {self._download_error}. Run with network access, "
                    "or pass download=None to fall back to the files on disk."
                ) from exc
            rank_zero_warn(
                f"MNISTDataModule: could not download {self._spec.title} "
                f"({self._download_error}); using the files on disk."
            )
        finally:
            socket.setdefaulttimeout(previous_timeout)

    def _discard_partial_downloads(self, raw_dir: Path, before: set[Path]) -> None:
        """Remove .gz files a failed download left half-written, so they cannot shadow others."""
        expected = _torchvision_md5(self._spec.folder)
        for path in set(raw_dir.iterdir()) - before if raw_dir.is_dir() else ():
            md5 = expected.get(path.name)
            if md5 is not None and hashlib.md5(path.read_bytes()).hexdigest() != md5:
                with contextlib.suppress(OSError):
                    path.unlink()

    # -- building ---------------------------------------------------------------------------

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        x = images.unsqueeze(1).to(torch.float32).div_(255.0)
        return x.sub_(self._spec.mean).div_(self._spec.std)

    def _describe(
        self, mode: str, files: dict[str, Path], pool: int, counts: dict[str, int]
    ) -> None:
        title = self._spec.title
        n = {k: f"{v:,}" for k, v in counts.items()}
        if mode == "official":
            note = (
                f"{title}: official split. Train ({n['train']}) and validation ({n['val']}) "
                f"are a split with seed {self.seed} of the {pool:,} official training images; "
                f"test ({n['test']}) is the official test set."
            )
        else:
            note = (
                f"{title}: ONLY THE OFFICIAL TEST SPLIT (t10k-*, {pool:,} images) was found, in "
                f"{files[TEST_FILES[0]].parent}. Train ({n['train']}), validation ({n['val']}) "
                f"and test ({n['test']}) are disjoint parts of it, carved with seed {self.seed}, "
                "so accuracies are not comparable with results on the official 60,000/10,000 "
                "split. For the full dataset, run once with network access or point data_root "
                "at a full copy."
            )
        limits = {
            k: getattr(self, f"limit_{k}")
            for k in counts
            if getattr(self, f"limit_{k}") is not None
        }
        if limits:
            note += " Limited by " + ", ".join(f"limit_{k}={v}" for k, v in limits.items()) + "."
        if not self.verify_md5:
            note += " Checksums were not verified (verify_md5=False)."
        self.source_note = note
        self.split_info = {
            "dataset": self.dataset,
            "mode": mode,
            "seed": self.seed,
            **counts,
            "pool": pool,
            "files": {name: str(path) for name, path in files.items()},
            "md5_verified": self.verify_md5,
        }
        if mode == "test_split_only":
            rank_zero_warn(note, category=TestSplitOnlyWarning)
        else:
            log.info(note)

    def _loader(
        self, dataset: TensorDataset, *, shuffle: bool, generator: torch.Generator | None = None
    ) -> DataLoader[tuple[torch.Tensor, ...]]:
        workers = self.num_workers
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    def _require(self, dataset: TensorDataset | None) -> TensorDataset:
        if dataset is None:
            raise RuntimeError(
                "MNISTDataModule: call prepare_data() and setup() before asking for a loader "
                "(a Trainer does both)"
            )
        return dataset


def _check_idx(raw: bytes, name: str, path: Path, fix: str) -> None:
    """Raise unless ``raw`` is a complete IDX file of 28x28 uint8 images or of uint8 labels."""
    ndim = 3 if "images" in name else 1
    magic = 0x0800 + ndim  # two zero bytes, 0x08 for uint8, then the number of dimensions
    header = 4 + 4 * ndim
    if len(raw) < header or int.from_bytes(raw[:4], "big") != magic:
        got = raw[:4].hex() if len(raw) >= 4 else f"only {len(raw)} bytes"
        raise DataCorruptError(
            f"MNISTDataModule: {path} is not an IDX file of {name}: magic number expected "
            f"{magic:08x}, got {got}. {fix}."
        )
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + dims[0] * (_IMAGE_SIDE * _IMAGE_SIDE if ndim == 3 else 1)
    if ndim == 3 and dims[1:] != [_IMAGE_SIDE, _IMAGE_SIDE]:
        raise DataCorruptError(
            f"MNISTDataModule: {path} holds {dims[1]}x{dims[2]} images; expected "
            f"{_IMAGE_SIDE}x{_IMAGE_SIDE}. {fix}."
        )
    if len(raw) != expected:
        raise DataCorruptError(
            f"MNISTDataModule: {path} is truncated or padded: its header announces {dims[0]} "
            f"items, that is {expected} bytes decompressed, got {len(raw)}. {fix}."
        )
    if ndim == 1 and len(raw) > header and max(raw[header:]) >= _NUM_CLASSES:
        raise DataCorruptError(
            f"MNISTDataModule: {path} holds label {max(raw[header:])}; expected labels in "
            f"0..{_NUM_CLASSES - 1}. {fix}."
        )


@functools.cache
def _torchvision_md5(folder: str) -> dict[str, str]:
    from torchvision import datasets

    return dict(getattr(datasets, folder).resources)


def _permutation(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def _writable(path: Path) -> bool:
    """Whether files could be created at ``path``, judged on its nearest existing ancestor."""
    probe = path.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return False
    # root may write anywhere, so os.access alone would call a folder that was made read-only
    # on purpose (like ../shared/data, r-x for everyone) writable.
    if not probe.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return False
    if hasattr(os, "statvfs") and os.statvfs(probe).f_flag & os.ST_RDONLY:
        return False
    return os.access(probe, os.W_OK)


def _default_cache_dir(data_root: Path, spec: _Spec) -> Path:
    if _writable(data_root / spec.folder / "raw"):
        return data_root
    xdg = os.environ.get("XDG_CACHE_HOME")
    with contextlib.suppress(RuntimeError):  # no home directory
        user_cache = Path(xdg) if xdg else Path.home() / ".cache"
        if _writable(user_cache / "isolate" / spec.folder / "raw"):
            return user_cache / "isolate"
    return Path(tempfile.gettempdir()) / "isolate"
