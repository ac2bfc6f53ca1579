"""The ``isolate`` command: one entry point, a verb per tool (``python -m isolate`` too).

Each verb is a module with ``add_arguments(parser)`` and ``run(args) -> int``. A user error
(any :class:`~isolate.errors.IsolationError`, a missing file, a factory that does not
import) is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from isolate.errors import IsolationError

__all__ = ["VERBS", "main"]

VERBS = {
    "schedule": (
        "isolate.interop.schedules",
        "print a default thaw schedule (YAML) for a model: module:callable",
    ),
    "migrate": (
        "isolate.interop.migrate",
        "convert a finetuning-scheduler schedule file to an isolate spec (YAML)",
    ),
    "certify": (
        "isolate.certificates.cli",
        "certify from two checkpoints alone what a run froze, trained, merged and tied",
    ),
}
"""Verb -> (module, one-line help)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every verb (each verb's module is imported here, when it is needed)."""
    parser = argparse.ArgumentParser(
        prog="isolate",
        description="Declarative, verifiable gradient isolation for PyTorch: the tools.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, (module_name, help_text) in VERBS.items():
        module = importlib.import_module(module_name)
        sub = verbs.add_parser(
            verb, help=help_text, description=(module.__doc__ or help_text).split("\n\n")[0]
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``isolate VERB ...``; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.run(args)
    except (IsolationError, OSError, ImportError, AttributeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        sys.stderr.write(f"isolate {args.verb}: error: {message}\n")
        return 2
    return status
