"""The parsers of ``python -m experiments``: the command's name and the configs it reads,
errors as one short message with the fix, and the options of ``suite``.

The suite's options live here, not in :mod:`experiments.suite`, because the one-run command
(:mod:`experiments.cli`) lists ``suite`` in its ``--help`` while the suite runs its variants
through that command: the imports point one way, suite -> cli -> parsing.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

from pytorch_lightning.cli import LightningArgumentParser

__all__ = [
    "BASE_PRESET",
    "CONFIGS",
    "PROG",
    "REPO",
    "SUITE_DESCRIPTION",
    "ExperimentParser",
    "suite_parser",
    "variant_names",
]

PROG = "python -m experiments"
REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
BASE_PRESET = CONFIGS / "presets" / "base.yaml"
SUITE_DESCRIPTION = (
    "Run every variant in configs/ with identical seeds and data order, check what each "
    "declares, and write the report (Markdown, JSON, PNG) into --output."
)


def variant_names() -> list[str]:
    """The stems of ``configs/*.yaml``: the variants a run or the suite can start from."""
    return sorted(path.stem for path in CONFIGS.glob("*.yaml"))


# --------------------------------------------------------------------------------------------
# Errors: one short message with the fix, not the whole usage


def _short(message: str) -> str:
    """The part of a jsonargparse message that names the culprit.

    A config value that fails inside a ``class_path`` comes wrapped in the list of every type
    the value could have had; only the class's own complaint says what is wrong.
    """
    found = re.search(r"Problem with given class_path '([\w.]+)':\n((?:\s{6,}.*\n?)+)", message)
    if not found:
        return message.strip()
    inner = " ".join(line.strip() for line in found.group(2).splitlines() if line.strip())
    key = re.match(r'Parser key "([\w.]+)"', message)
    where = f"{key.group(1)} ({found.group(1)})" if key else found.group(1)
    return f"{where}: {inner}"


def _parameters(class_path: str) -> list[str]:
    """The ``__init__`` parameters of ``class_path``, for "did you mean"; ``[]`` if unknown."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=2, cutoff=0.75)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _options(parser: Any) -> list[str]:
    return [a.dest for a in getattr(parser, "_actions", []) if a.dest and a.dest != "help"]


def _explain(message: str, parser: Any) -> str:
    """``message`` shortened, with a "did you mean" or the flag that fixes it where one fits."""
    short = _short(message)
    # A key in a config file that the class does not take (a typo, mostly).
    option = re.search(r"Option '(\w+)' is not accepted", short)
    class_path = re.search(r"\(([\w.]+)\)|^([\w.]+):", short)
    if option and class_path:
        path = class_path.group(1) or class_path.group(2)
        return f"{short}{_did_you_mean(option.group(1), _parameters(path))}"
    # An option (or config key) the parser does not know.
    group = re.search(r"Group '([\w.]+)' does not accept option '(\w+)'", short)
    if group:
        word = f"{group.group(1)}.{group.group(2)}"
        return f"{short}{_did_you_mean(word, _options(parser))}"
    given = re.search(r"unrecognized arguments: --([\w.]+)", short)
    if given:
        return f"{short}{_did_you_mean(given.group(1), _options(parser))}"
    unknown = re.search(
        r"does not accept option '([\w.]+)'|Option '([\w.]+)' is not accepted", short
    )
    if unknown:
        word = unknown.group(1) or unknown.group(2)
        return f"{short}{_did_you_mean(word, _options(parser))}"
    choice = re.search(r"invalid choice: '([\w.-]+)' \(choose from (.*)\)", short)
    if choice:
        choices = re.findall(r"'([^']+)'", choice.group(2))
        return f"{short}{_did_you_mean(choice.group(1), choices)}"
    required = re.search(r"required: (\w+)\.model\b", short)
    if required:
        sub = required.group(1)
        return (
            f"{sub} needs a model: pass a variant's config, e.g. "
            f"{PROG} {sub} --config configs/detached.yaml "
            f"(variants in configs/: {', '.join(variant_names())})"
        )
    return short


class ExperimentParser(LightningArgumentParser):
    """LightningCLI's parser, with errors as one short message instead of 40 lines of usage.

    The message names the culprit, adds a "did you mean" for a misspelt key or option and the
    flag to pass for a missing model, and points at ``--help`` for the full usage.
    """

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {_explain(message, parser)}\n")
        sys.stderr.write(f"See '{prog} --help' for every option.\n")
        self.exit(2)


# --------------------------------------------------------------------------------------------
# The suite's options


def suite_parser() -> ExperimentParser:
    """The parser of ``python -m experiments suite``, also listed in ``python -m experiments
    --help``."""
    parser = ExperimentParser(
        prog=f"{PROG} suite",
        description=SUITE_DESCRIPTION + " Any other option of fit (--trainer.*, --model.*, "
        "--data.*, --record.*) is passed to every run, e.g. --data.limit_train=640.",
    )
    parser.add_argument("--output", type=str, default="outputs/suite", help="the report's folder")
    parser.add_argument("--quick", action="store_true", help="add configs/presets/quick.yaml")
    parser.add_argument(
        "--ddp", action="store_true", help="add configs/presets/ddp.yaml (2 CPU processes)"
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="add configs/presets/fsdp.yaml (FSDP2 through ModelParallelStrategy, 2 CPU "
        "processes); variants whose model cannot be sharded are skipped, with the reason",
    )
    parser.add_argument(
        "--config", action="append", default=[], help="another config for every run (repeat)"
    )
    parser.add_argument(
        "--only",
        type=str | None,
        default=None,
        help="comma-separated variant names (and the runs they are compared with)",
    )
    parser.add_argument(
        "--data.dataset",
        choices=["mnist", "fashion_mnist"],  # no type=: jsonargparse would show a lambda
        default="mnist",
        help="the same experiments on Fashion-MNIST with fashion_mnist",
    )
    parser.add_argument(
        "--data.data_root",
        type=str | None,
        default=None,
        help="default: ISOLATE_DATA_ROOT, else ../shared/data",
    )
    parser.add_argument(
        "--data.cache_dir", type=str | None, default=None, help="the datamodule's cache folder"
    )
    parser.add_argument(
        "--data.download",
        type=bool | None,
        default=None,
        help="download the dataset if the full dataset is missing (default: only when the data "
        "root lacks even the test split)",
    )
    parser.add_argument(
        "--threads",
        type=int | None,
        default=1,
        help="torch threads of every run, as in fit (default 1)",
    )
    return parser
