"""MNIST and Fashion-MNIST as an in-memory ``LightningDataModule``, offline first.

Reading, decompressing, checksums and downloads are torchvision's
(``torchvision.datasets.mnist.read_image_file`` / ``read_label_file``,
``torchvision.datasets.utils.check_integrity`` / ``extract_archive`` /
``download_and_extract_archive``). This module adds what torchvision lacks: a search over
folders that may be read-only, the Debian layout of Fashion-MNIST, a seeded carve of the test
split when that is all there is, and typed errors that say which command-line flag fixes them.

Where the data come from: for each file, the first of

1. ``data_root/<Folder>/raw`` (``<Folder>`` is ``MNIST`` or ``FashionMNIST``), torchvision's
   layout, ``.gz`` or decompressed;
2. for Fashion-MNIST only, ``/usr/share/datasets/fashion-mnist``, where the Debian package
   ``dataset-fashion-mnist`` puts the four ``.gz`` files side by side;
3. ``cache_dir/<Folder>/raw``, where downloads go.

**Nothing is ever written into the data root or the system folder**: they belong to whoever
made them (``../shared/data`` is shared by every checkout). Downloads go to ``cache_dir``, by
default ``$XDG_CACHE_HOME/isolate`` or ``~/.cache/isolate``. torchvision's readers read only
decompressed files, so a ``.gz`` is decompressed into a temporary folder that is removed right
after reading (a fraction of a second for MNIST's test split): no decompressed copy is kept
anywhere, so none can go stale or pass for a file it was not made from.

``prepare_data`` downloads the files of the official split that are on disk nowhere (see
``download``), from torchvision's mirrors into ``cache_dir``. ``setup`` checks every file before
use: a ``.gz`` against the md5 in torchvision's resource list, or else its content against
the md5 of the official uncompressed file (the Debian package ships recompressed ``.gz`` files of
the same content); a decompressed file against the latter. torchvision's readers then check the
IDX header against the byte count, and this module the image size and the label range, so
truncated or corrupt files raise :class:`DataCorruptError` instead of training on garbage.

When only the official test split (``t10k-*``, 10,000 images) is found, as in ``../shared/data``,
train, validation and test sets are carved from it with a seeded permutation, and the datamodule
says so in a warning, in :attr:`MNISTDataModule.source_note` and in
:attr:`MNISTDataModule.split_info`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, TensorDataset

__all__ = [
    "ENV_DATA_ROOT",
    "DataCorruptError",
    "DataError",
    "DataNotFoundError",
    "MNISTDataModule",
    "TestSplitOnlyWarning",
    "default_cache_dir",
]

log = logging.getLogger(__name__)

ENV_DATA_ROOT = "ISOLATE_DATA_ROOT"
"""Environment variable read when ``data_root`` is not given."""

DOWNLOAD_TIMEOUT_S = 10.0
"""Socket timeout while downloading, so a network that drops packets fails fast."""

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


class DataError(Exception):
    """Base of the data errors: the data are missing or broken, not the code or the config.

    ``str(error)`` is the whole message: what is wrong, where, expected vs. got, and on its last
    line the fix. :attr:`hint` is that last line alone, in command-line spelling (for example
    ``--data.download=true``), for a command line that prints it without a traceback.

    Args:
        message: What is wrong, naming the file or folder.
        hint: The fix, in one line.
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n{self.hint}" if self.hint else self.message


class DataNotFoundError(DataError, FileNotFoundError):
    """The IDX files of a dataset are in none of the places searched, or a download failed."""


class DataCorruptError(DataError, ValueError):
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
            ``ISOLATE_DATA_ROOT`` environment variable, else ``"data"``. Only read, never
            written: it may be read-only or shared.
        cache_dir: Root (same layout) for downloads. Defaults to
            :func:`default_cache_dir`: ``$XDG_CACHE_HOME/isolate``, else ``~/.cache/isolate``,
            else a folder in the system temp directory.
        batch_size: Batch size of all three loaders.
        val_fraction: Share of the carved pool that goes to validation.
        test_fraction: Share of the 10,000 test images held out as the test set when only the
            test split is available; unused with the official split.
        seed: Seeds both the split and the train loader's shuffling.
        num_workers: ``DataLoader`` workers; 0 is fastest for in-memory tensors.
        download: ``None`` downloads the files of the official split that are on disk nowhere
            into ``cache_dir`` and, if that fails, warns and uses what is on disk; ``True`` does
            the same but a failed download raises; ``False`` never touches the network.
        verify_md5: Check every file against the official md5 (see the module docstring). Turn
            off only for IDX files you made yourself; the IDX header, byte count, image size and
            label range are checked either way.
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
            The paths in ``files`` are where each file was found.

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
        # A data root the user named (not the default "data"): if it does not exist, that is
        # most likely a typo, which a download would only hide.
        self._root_given = bool(data_root or os.environ.get(ENV_DATA_ROOT))
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.source_note = "setup() has not run yet."
        self.split_info: dict[str, Any] = {}
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None
        self._download_error: str | None = None

    # -- Lightning hooks --------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Download what is on disk nowhere, if allowed; :meth:`setup` checks and reads.

        Runs once per node (Lightning calls it on local rank 0 only).

        Raises:
            DataNotFoundError: If the test split is nowhere to be found, or ``download=True``
                and the download failed.
        """
        missing = [name for name in (*TEST_FILES, *TRAIN_FILES) if self._find(name) is None]
        if missing and (self.download is True or (self.download is None and not self._no_root)):
            self._download(missing, required=self.download is True)
        self._locate()  # fails here, before a Trainer sets anything up, if data are missing

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
        files = self._locate()
        arrays = {name: self._read(name, origin) for name, origin in files.items()}
        for images_name, labels_name in (TRAIN_FILES, TEST_FILES):
            if images_name in arrays and len(arrays[images_name]) != len(arrays[labels_name]):
                raise DataCorruptError(
                    f"MNISTDataModule: {files[images_name]} holds {len(arrays[images_name])} "
                    f"images but {files[labels_name]} holds {len(arrays[labels_name])} labels; "
                    "they must come from the same release.",
                    "Delete both and download them again (--data.download=true).",
                )
        test_x, test_y = arrays[TEST_FILES[0]], arrays[TEST_FILES[1]]
        if TRAIN_FILES[0] in arrays:
            mode = "official"
            pool_x, pool_y = arrays[TRAIN_FILES[0]], arrays[TRAIN_FILES[1]]
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

    # -- finding files ----------------------------------------------------------------------

    @property
    def _cache_raw(self) -> Path:
        return self.cache_dir / self._spec.folder / "raw"

    def _search_dirs(self) -> list[tuple[Path, str]]:
        dirs = [(self.data_root / self._spec.folder / "raw", "--data.data_root")]
        dirs += [
            (d, "installed by a system package") for d in SYSTEM_DATA_DIRS.get(self.dataset, ())
        ]
        dirs.append((self._cache_raw, "--data.cache_dir, where downloads go"))
        unique: dict[Path, tuple[Path, str]] = {}
        for path, why in dirs:
            unique.setdefault(path.absolute(), (path, why))
        return list(unique.values())

    @property
    def _no_root(self) -> bool:
        """The data root was named on purpose and is not a folder."""
        return self._root_given and not self.data_root.is_dir()

    def _find(self, name: str) -> Path | None:
        """Where one official file is, decompressed or ``.gz``, if anywhere."""
        for directory, _ in self._search_dirs():
            # torchvision leaves both forms side by side; the decompressed one reads faster.
            for path in (directory / name, directory / f"{name}.gz"):
                if path.is_file():
                    return path
        return None

    def _locate(self) -> dict[str, Path]:
        """Map each official file name to where it is; the train pair is optional."""
        found = {name: self._find(name) for name in (*TEST_FILES, *TRAIN_FILES)}
        missing = [name for name, path in found.items() if path is None]
        # Half a train pair means a broken copy or download, not a test-only data root.
        if any(name in missing for name in TEST_FILES) or len(missing) == 1:
            raise self._not_found(missing)
        return {name: path for name, path in found.items() if path is not None}

    def _not_found(self, missing: list[str]) -> DataNotFoundError:
        title, folder = self._spec.title, self._spec.folder
        searched = "\n".join(f"  - {path} ({why})" for path, why in self._search_dirs())
        if self._no_root:
            searched = searched.replace(
                " (--data.data_root)",
                f" (--data.data_root): the folder {self.data_root} does not exist",
                1,
            )
        tried = ""
        if self._download_error is not None:
            tried = f"\nA download was tried and failed: {self._download_error}"
        hint = (
            f"To fix: pass --data.download=true (with network access) to download them into "
            f"{self.cache_dir}, or --data.data_root=PATH for a folder holding "
            f"{folder}/raw/{TEST_FILES[0]}.gz (or set {ENV_DATA_ROOT}=PATH)"
        )
        if self._no_root:  # a typo in the path is likelier than a wish to download
            hint = (
                f"To fix: the data root {self.data_root} does not exist: pass "
                f"--data.data_root=PATH of a folder holding {folder}/raw/{TEST_FILES[0]}.gz "
                f"(or set {ENV_DATA_ROOT}=PATH), or --data.download=true (with network access) "
                f"to download them into {self.cache_dir}"
            )
        if self.dataset == "fashion_mnist":
            hint += (
                ", or install the Debian package: apt-get install dataset-fashion-mnist "
                f"(it puts them in {DEBIAN_FASHION_MNIST})"
            )
        return DataNotFoundError(
            f"MNISTDataModule: {title} files not found: missing "
            + ", ".join(f"{n}[.gz]" for n in missing)
            + f". Needed: {' and '.join(TEST_FILES)} (the official test split, enough on its "
            f"own), plus {' and '.join(TRAIN_FILES)} for the official train split, each "
            ".gz or decompressed.\nSearched:\n" + searched + tried,
            hint + ".",
        )

    # -- checking and reading files -----------------------------------------------------------

    def _read(self, name: str, origin: Path) -> torch.Tensor:
        """The checked content of one official file: uint8 images or int64 labels."""
        from torchvision.datasets.mnist import read_image_file, read_label_file

        images = "images" in name
        with self._decompressed(name, origin) as path:
            try:
                tensor: torch.Tensor = (read_image_file if images else read_label_file)(str(path))
            except (AssertionError, KeyError, RuntimeError, TypeError, ValueError) as exc:
                # torchvision's reader checks the header against the byte count, mostly with
                # bare asserts; this says which file, and survives python -O as KeyError etc.
                what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                raise self._corrupt(
                    origin, f"is not a complete IDX file of {name} (torchvision: {what})"
                ) from exc
        if images and tuple(tensor.shape[1:]) != (_IMAGE_SIDE, _IMAGE_SIDE):
            raise self._corrupt(
                origin,
                f"holds {tensor.shape[1]}x{tensor.shape[2]} images; expected "
                f"{_IMAGE_SIDE}x{_IMAGE_SIDE}",
            )
        if not images and len(tensor) and int(tensor.max()) >= _NUM_CLASSES:
            raise self._corrupt(
                origin,
                f"holds label {int(tensor.max())}; expected labels in 0..{_NUM_CLASSES - 1}",
            )
        return tensor

    @contextlib.contextmanager
    def _decompressed(self, name: str, origin: Path) -> Iterator[Path]:
        """``origin`` checked and, if a ``.gz``, decompressed into a temporary folder."""
        from torchvision.datasets.utils import check_integrity

        raw_md5 = _RAW_MD5[self.dataset][name]
        if origin.suffix != ".gz":
            if self.verify_md5 and not check_integrity(origin, raw_md5):
                raise self._wrong_md5(origin, raw_md5)
            yield origin
            return
        with tempfile.TemporaryDirectory(prefix="isolate-") as tmp:
            path = self._extract(origin, Path(tmp))
            gz_md5 = _resources(self._spec.folder)[f"{name}.gz"]
            # Another md5 may be a recompressed copy (Debian's) of the official content.
            if (
                self.verify_md5
                and not check_integrity(origin, gz_md5)
                and not check_integrity(path, raw_md5)
            ):
                raise self._wrong_md5(origin, gz_md5, content=path, content_md5=raw_md5)
            yield path

    def _extract(self, origin: Path, folder: Path) -> Path:
        from torchvision.datasets.utils import extract_archive

        try:
            extract_archive(origin, folder)
        except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError; zlib.error too
            raise self._corrupt(origin, f"is not a valid gzip file ({exc})") from exc
        return folder / origin.name.removesuffix(".gz")

    def _corrupt(self, path: Path, problem: str) -> DataCorruptError:
        return DataCorruptError(
            f"MNISTDataModule: {path} {problem}.",
            f"To fix: delete or replace {path}: download it again (--data.download=true, with "
            "network access) or copy a good one.",
        )

    def _wrong_md5(
        self,
        path: Path,
        md5: str,
        *,
        content: Path | None = None,
        content_md5: str | None = None,
    ) -> DataCorruptError:
        from torchvision.datasets.utils import calculate_md5

        source = "torchvision's resource list" if content is not None else "the official file"
        problem = (
            f"has the wrong checksum: md5 expected {md5} ({source}), got {calculate_md5(path)}"
        )
        if content is not None:
            problem += (
                f"; its content's md5 expected {content_md5} (the official {content.name}), "
                f"got {calculate_md5(content)}"
            )
        error = self._corrupt(path, problem)
        error.hint += " For IDX files you made yourself, pass --data.verify_md5=false instead."
        return error

    # -- downloading --------------------------------------------------------------------------

    def _download(self, names: list[str], *, required: bool) -> None:
        """Download ``names`` from torchvision's mirrors into the cache, all or none."""
        from torchvision.datasets.utils import download_and_extract_archive

        raw_dir = self._cache_raw
        created = _missing_dirs(raw_dir)
        mirrors = _mirrors(self._spec.folder)
        resources = _resources(self._spec.folder)
        previous_timeout = socket.getdefaulttimeout()
        # torchvision's urlopen has no timeout of its own; a network that drops packets would
        # otherwise hang prepare_data indefinitely.
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
        try:
            raw_dir.mkdir(parents=True, exist_ok=True)
            # Into a temporary folder first: a failed download leaves nothing half-written, and a
            # train image file never lands without its labels.
            with tempfile.TemporaryDirectory(dir=raw_dir, prefix=".download-") as tmp:
                for name in names:
                    errors = []
                    for mirror in mirrors:
                        try:
                            download_and_extract_archive(
                                f"{mirror}{name}.gz", tmp, md5=resources[f"{name}.gz"]
                            )
                            break
                        except Exception as exc:  # urllib's URLError/OSError, torchvision's more
                            errors.append(f"{mirror}: {type(exc).__name__}: {exc}")
                    else:
                        raise OSError(f"{name}.gz from " + "; ".join(errors))
                for path in Path(tmp).iterdir():
                    path.replace(raw_dir / path.name)
        except Exception as exc:
            self._download_error = " ".join(str(exc).split())
            _remove_empty(created)
            if required:
                raise DataNotFoundError(
                    f"MNISTDataModule: download=True but the {self._spec.title} download into "
                    f"{raw_dir} failed: {self._download_error}.",
                    "To fix: run with network access, or pass --data.download=false to use only "
                    "the files on disk.",
                ) from exc
            rank_zero_warn(
                f"MNISTDataModule: could not download {self._spec.title} "
                f"({self._download_error}); using the files on disk."
            )
        finally:
            socket.setdefaulttimeout(previous_timeout)

    # -- building -----------------------------------------------------------------------------

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
                "split. For the full dataset, pass --data.download=true (with network access) "
                "or --data.data_root=PATH of a full copy."
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


def default_cache_dir() -> Path:
    """Where downloads go unless ``cache_dir`` is given.

    ``$XDG_CACHE_HOME/isolate`` if that variable is set, else ``~/.cache/isolate``; a folder in
    the system temp directory when that cannot be written.

    Example:
        >>> default_cache_dir().name
        'isolate'
    """
    xdg = os.environ.get("XDG_CACHE_HOME")
    with contextlib.suppress(RuntimeError):  # no home directory
        user_cache = (Path(xdg) if xdg else Path.home() / ".cache") / "isolate"
        if _writable(user_cache):
            return user_cache
    return Path(tempfile.gettempdir()) / "isolate"


@functools.cache
def _resources(folder: str) -> dict[str, str]:
    """torchvision's ``.gz`` file names and md5s for one dataset class."""
    from torchvision import datasets

    return dict(getattr(datasets, folder).resources)


def _mirrors(folder: str) -> list[str]:
    from torchvision import datasets

    return list(getattr(datasets, folder).mirrors)


def _permutation(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    path = path.absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the folders of :func:`_missing_dirs` again, as far as they are still empty."""
    for path in dirs:
        with contextlib.suppress(OSError):
            path.rmdir()


def _writable(path: Path) -> bool:
    """Whether files could be created at ``path``, judged on its nearest existing ancestor."""
    probe = path.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return False
    # root may write anywhere, so os.access alone would call a folder that was made read-only
    # on purpose (r-x for everyone) writable.
    if not probe.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return False
    if hasattr(os, "statvfs") and os.statvfs(probe).f_flag & os.ST_RDONLY:
        return False
    return os.access(probe, os.W_OK)
