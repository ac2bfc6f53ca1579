"""The command line of the experiments: LightningCLI for one run, with ``suite`` beside it.

One run (``configs/presets/base.yaml`` is loaded first, then each ``--config`` in order)::

    python -m experiments fit --config configs/detached.yaml
    python -m experiments fit --config configs/detached.yaml --config configs/presets/ddp.yaml
    python -m experiments fit --config configs/detached.yaml --config configs/presets/fsdp.yaml

The suite, which runs every variant and writes the report (see :mod:`experiments.suite`)::

    python -m experiments suite [--output outputs/suite] [--quick] [--ddp | --fsdp]

A run logs its metrics (per step and per epoch) with the logger of ``trainer.logger``, a
``CSVLogger`` by default, in ``<trainer.default_root_dir>/<run name>/version_<n>/``; after
``fit`` it evaluates the test split with ``trainer.test``. ``--threads`` (default 1, as in
the suite) sets torch's thread count: the last bits of the results depend on it.

MNIST is read from ``--data.data_root`` if given, else from ``ISOLATE_DATA_ROOT``, else from
``../shared/data`` (next to the repository) when that folder exists, else it is downloaded by
torchvision (see :func:`resolve_data_root`). The data root is passed on relative to the
working directory when it lies below or beside it (see :func:`display_path`), so that what a
run records names no folder of this machine.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

from experiments.data import ENV_DATA_ROOT, TEST_FILES, MNISTDataModule
from experiments.parsing import (
    BASE_PRESET,
    PROG,
    REPO,
    SUITE_DESCRIPTION,
    ExperimentParser,
    suite_parser,
)
from experiments.recording import Recorder

__all__ = [
    "ExperimentCLI",
    "cli_main",
    "default_data_root",
    "display_path",
    "has_test_split",
    "resolve_data_root",
]

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


def resolve_data_root(
    data_root: str | None, download: bool | None, dataset: str = "mnist"
) -> tuple[str | None, bool | None]:
    """The data root a run reads, as it is shown and passed on, and the ``download`` to use.

    The one policy of the CLI and the suite: ``data_root`` if given, else ``ISOLATE_DATA_ROOT``,
    else ``../shared/data`` beside the repository (:func:`default_data_root`); ``None`` leaves
    the datamodule's own default. A data root that already holds the official test split is
    used as it is: the datamodule's ``download=None`` would try the network for the training
    split at every run (and wait on a timeout where packets are dropped), so it becomes
    ``False`` there; ``download=True`` still fetches the training split.

    Args:
        data_root: the data root given on the command line, or ``None``.
        download: the ``download`` given, or ``None``.
        dataset: ``"mnist"`` or ``"fashion_mnist"``.

    Returns:
        ``(root, download)``, the root relative to the working directory when it lies below or
        beside it (:func:`display_path`), so that the records name no folder of this machine.
    """
    root = data_root or os.environ.get(ENV_DATA_ROOT) or default_data_root()
    if root is None:
        return None, download
    if download is None and has_test_split(root, dataset):
        download = False
    return display_path(root), download


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
    ``name`` defaults to the stem of the last ``--config`` file outside ``presets/``),
    ``--threads``, the ``variant:`` block of the config files (the suite's declaration, which
    a run ignores), the data-root policy of :func:`resolve_data_root`, the logger's folder
    (``trainer.default_root_dir``, under the run's name), ``trainer.test`` after ``fit``, and
    the ``suite`` subcommand to ``--help``.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("prog", PROG)
        kwargs.setdefault(
            "description",
            "The MNIST isolation experiments: one run of a variant (fit, validate, test, "
            "predict; e.g. fit --config configs/detached.yaml), or the suite of all of them.",
        )
        return super().init_parser(**kwargs)

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        # Listed beside fit and the rest; `python -m experiments suite` runs it
        # (experiments/__main__.py), since it is many runs, not one Trainer call.
        subcommands = parser._subcommands_action
        if subcommands is not None:
            subcommands.add_subcommand("suite", suite_parser(), help=SUITE_DESCRIPTION)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(Recorder, "record")
        parser.add_argument(
            "--threads",
            type=int | None,
            default=1,
            help="torch threads, and OMP_NUM_THREADS for processes the run starts (DDP); the "
            "last bits of the results depend on it. null keeps torch's default",
        )
        parser.add_argument(
            "--variant",
            type=dict[str, Any | None],
            default=None,
            help="the suite's declaration of a variant (role, claims, report); a run ignores it",
        )
        parser.link_arguments("trainer.default_root_dir", "trainer.logger.init_args.save_dir")
        root = default_data_root()
        if root is not None:
            # That folder holds only the official test split, on purpose: read it, and do not
            # go looking for the training split online.
            parser.set_defaults({"data.data_root": display_path(root), "data.download": False})

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        data = config.data
        data.data_root, data.download = resolve_data_root(
            data.data_root, data.download, data.dataset
        )
        configs = [Path(str(c)) for c in config.get("config") or []]
        variants = [c for c in configs if c.parent.name != "presets"] or configs
        if config.record.name == "run" and variants:
            config.record.name = variants[-1].stem
        logger = config.trainer.get("logger")
        init_args = getattr(logger, "init_args", None)
        if init_args is not None and init_args.get("name") == "lightning_logs":
            init_args.name = config.record.name  # one folder per variant, not all in one
        if config.threads is not None:
            torch.set_num_threads(config.threads)
            # Else a DDP launch gives each process cores // processes threads.
            os.environ["OMP_NUM_THREADS"] = str(config.threads)

    def after_fit(self) -> None:
        """The test split through ``trainer.test``, after a ``fit`` that finished."""
        if not self.trainer.interrupted:
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)


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
        Silences known noise for the whole process (:func:`quiet_known_noise`), and sets the
        process's torch thread count (``--threads``).
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
        parser_class=ExperimentParser,
        args=list(args) if args is not None else None,
        run=run,
    )


def data_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions of the data module that a command reports in one line."""
    from experiments import data

    base = getattr(data, "DataError", None)
    if isinstance(base, type):
        return (base,)
    return tuple(getattr(data, n) for n in ("DataNotFoundError", "DataCorruptError"))


def report_data_errors(run: Callable[[], int]) -> int:
    """Run ``run``; a data error becomes one message with the flags to pass, and status 1."""
    try:
        return run()
    except data_error_types() as error:
        message = str(error).strip()
        hint = ""
        if "--data." not in message:
            hint = (
                "\nPass --data.data_root=<folder holding MNIST/raw>, or --data.download=true "
                "to fetch it."
            )
        sys.stderr.write(f"{PROG}: data error: {message}{hint}\n")
        return 1
