"""The command line of the experiments: LightningCLI for one run, and the data root default.

One run (``configs/presets/base.yaml`` is loaded first, then each ``--config`` in order)::

    python -m experiments fit --config configs/detached.yaml
    python -m experiments fit --config configs/detached.yaml --config configs/presets/ddp.yaml

The suite, which runs every variant and writes the report (see :mod:`experiments.suite`)::

    python -m experiments suite [--output outputs/suite] [--quick] [--ddp]

MNIST is read from ``--data.data_root`` if given, else from ``ISOLATE_DATA_ROOT``, else from
``../shared/data`` (next to the repository) when that folder exists, else it is downloaded by
torchvision. A data root that already holds the official test split is used as it is: the
datamodule's default ``download=None`` would try the network for the training split at every
run, so the CLI makes it ``False`` there (``--data.download=true`` fetches the training split).
The data root is passed on relative to the working directory when it lies below or beside it
(see :func:`display_path`), so that what a run records names no folder of this machine.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

from experiments.data import ENV_DATA_ROOT, TEST_FILES, MNISTDataModule
from experiments.recording import Recorder

__all__ = [
    "BASE_PRESET",
    "CONFIGS",
    "REPO",
    "ExperimentCLI",
    "cli_main",
    "default_data_root",
    "display_path",
    "has_test_split",
]

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
BASE_PRESET = CONFIGS / "presets" / "base.yaml"
SHARED_DATA = REPO.parent / "shared" / "data"
_SUBCOMMANDS = ("fit", "validate", "test", "predict")
# torchvision's folder under a data root, per ``MNISTDataModule(dataset=...)``.
_FOLDERS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}


def default_data_root() -> str | None:
    """``../shared/data`` next to the repository, when it exists and the environment is silent.

    ``None`` leaves the choice to :class:`~experiments.data.MNISTDataModule`: the
    ``ISOLATE_DATA_ROOT`` variable, else ``data`` with a torchvision download.
    """
    if os.environ.get(ENV_DATA_ROOT) or not SHARED_DATA.is_dir():
        return None
    return str(SHARED_DATA)


def display_path(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the working directory when it lies below or beside it, else as given.

    Beside means below the working directory's parent (``../shared/data``), unless that parent
    is the filesystem's root; anything further away is returned as given, since a chain of
    ``../..`` says less than the path itself.

    Args:
        path: a file or folder, relative to the working directory or absolute.

    Returns:
        The path to show (and to pass on to runs in the same working directory), with ``/``.

    >>> display_path(Path.cwd() / "data" / "MNIST")
    'data/MNIST'
    """
    given = os.fspath(path)
    here = Path.cwd()
    beside = 1 if len(here.parts) > 2 else 0  # from /tmp, all of / would be "beside"
    # The path as written first, then with symlinks resolved (the working directory is).
    for candidate in (os.path.abspath(given), str(Path(given).resolve())):
        try:
            relative = Path(os.path.relpath(candidate, here))
        except ValueError:  # another drive on Windows
            continue
        ups = relative.parts.count("..")  # relpath puts every ".." first
        if ups == 0 or (ups <= beside and len(relative.parts) > ups):
            return relative.as_posix()
    return given


def has_test_split(data_root: str | os.PathLike[str], dataset: str = "mnist") -> bool:
    """Whether ``data_root`` holds the official test split of ``dataset`` (``.gz`` or not)."""
    raw = Path(data_root) / _FOLDERS.get(dataset, "MNIST") / "raw"
    return all((raw / name).is_file() or (raw / f"{name}.gz").is_file() for name in TEST_FILES)


def quiet_known_noise() -> None:
    """Silence the warnings every run here would print and that say nothing about it."""
    # The data are in-memory tensors: worker processes would only add start-up time.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Lightning 2.6 calls a torch pytree API that newer torch deprecates; nothing to act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # IsolationCallback(bn="eval") holds frozen BatchNorm layers in eval mode on purpose.
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of train.*")
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)


class ExperimentCLI(LightningCLI):
    """LightningCLI over :class:`~experiments.data.MNISTDataModule` and any LightningModule.

    Adds a :class:`~experiments.recording.Recorder` callback under ``--record.*`` (its
    ``name`` defaults to the stem of the last ``--config`` file outside ``presets/``), the
    default data root, and ``download=False`` for a data root that holds the test split
    already (see the module docstring).
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(Recorder, "record")
        root = default_data_root()
        if root is not None:
            # That folder holds only the official test split, on purpose: read it, and do not
            # go looking for the training split online.
            parser.set_defaults({"data.data_root": display_path(root), "data.download": False})

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        data = config.data
        root = data.data_root or os.environ.get(ENV_DATA_ROOT)
        if root:
            data.data_root = display_path(root)
            # download=None would try the network at every run for the training split, and
            # wait on a timeout where packets are dropped; data on disk were put there to be used.
            if data.download is None and has_test_split(root, data.dataset):
                data.download = False
        configs = [Path(str(c)) for c in config.get("config") or []]
        variants = [c for c in configs if c.parent.name != "presets"] or configs
        if config.record.name == "run" and variants:
            config.record.name = variants[-1].stem


def cli_main(args: Sequence[str] | None = None, *, run: bool = True) -> ExperimentCLI:
    """Build the LightningCLI of the experiments and, with ``run``, run its subcommand.

    Args:
        args: command-line arguments, e.g. ``["fit", "--config", "configs/detached.yaml"]``;
            ``None`` reads ``sys.argv[1:]``.
        run: ``False`` only instantiates the model, datamodule and trainer (then ``args`` has
            no subcommand), for code that wants to call ``cli.trainer.fit`` itself.

    Returns:
        The :class:`ExperimentCLI`, with ``.model``, ``.datamodule`` and ``.trainer``.

    Note:
        Silences known noise for the whole process (:func:`quiet_known_noise`).
    """
    quiet_known_noise()
    if args is not None:
        # Runs started from Python (the suite, tests) pass their own args on purpose.
        warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter is intended.*")
    kwargs: dict[str, Any] = {
        sub: {"default_config_files": [str(BASE_PRESET)]} for sub in _SUBCOMMANDS
    }
    if not run:
        kwargs = {"default_config_files": [str(BASE_PRESET)]}
    return ExperimentCLI(
        pl.LightningModule,
        MNISTDataModule,
        subclass_mode_model=True,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=kwargs,
        args=list(args) if args is not None else None,
        run=run,
    )
