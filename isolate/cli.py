"""The ``isolate`` command: one entry point, a verb per tool (``python -m isolate`` too).

Each verb is a module with ``add_arguments(parser)`` and ``run(args) -> int``. A user error
(any :class:`~isolate.errors.IsolationError`, a missing file, a misspelt verb or option) is one
line on stderr that names the culprit and the fix, with a close match where there is one, and
exit status 2, never a traceback::

    $ isolate schedul torchvision.models:resnet18
    isolate: error: unknown verb 'schedul'; did you mean 'schedule'? (verbs: schedule, migrate)
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from isolate._text import did_you_mean
from isolate.errors import IsolationError

__all__ = ["VERBS", "Parser", "build_parser", "main"]

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


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose every error is one line that names the fix, with a
    close match for a misspelt verb, choice or option, and exit status 2 (the ``isolate``
    command and the examples use it).

    >>> parser = Parser(prog="train")
    >>> _ = parser.add_argument("--epochs", type=int, help="epochs to train")
    >>> parser._explain("unrecognized arguments: --epoks 4")
    "unknown option '--epoks'; did you mean '--epochs'?"
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {self._explain(message)} (see '{self.prog} --help')\n")

    def _explain(self, message: str) -> str:
        choice = re.search(
            r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)", message
        )
        if choice:
            options = re.findall(r"'([^']+)'", choice.group(3))
            verb = choice.group(1) == "VERB"
            what, known = ("verb", "verbs") if verb else (f"value for {choice.group(1)}", "choices")
            close = did_you_mean(choice.group(2), options)
            return (
                f"unknown {what} {choice.group(2)!r}{close}{' The' if close else '; the'} "
                f"{known} are {', '.join(options)}"
            )
        if "required: VERB" in message:
            return f"name a verb: {', '.join(VERBS)}"
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            words = unknown.group(1).split()
            options = [w for w in words if w.startswith("-")]
            if options:  # a misspelt option's value shows up as an extra argument too
                return "; ".join(self._unknown(w) for w in options)
            return f"unexpected argument {words[0]!r}"
        return message

    def _unknown(self, word: str) -> str:
        options = [
            s
            for a in self._actions
            for s in a.option_strings
            if s.startswith("--") and s != "--help"
        ]
        name = word.split("=", 1)[0]
        return f"unknown option {name!r}{did_you_mean(name, options)}"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every verb (each verb's module is imported here, when it is needed)."""
    parser = Parser(
        prog="isolate",
        description="Declarative, verifiable gradient isolation for PyTorch: the tools.",
    )
    verbs = parser.add_subparsers(
        dest="verb", required=True, metavar="VERB", help="the tool to run (isolate VERB --help)"
    )
    for verb, (module_name, help_text) in VERBS.items():
        module = importlib.import_module(module_name)
        sub = verbs.add_parser(
            verb,
            help=help_text,
            description=getattr(module, "DESCRIPTION", help_text),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run, verb_parser=sub)
    return parser


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.filename is not None:
        return f"cannot read {str(error.filename)!r}: {error.strerror or error}"
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``isolate VERB ...``; return the exit status (2 for a user error)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        args.verb_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        status: int = args.run(args)
    except (IsolationError, OSError) as error:
        sys.stderr.write(f"isolate {args.verb}: error: {_one_line(error)}\n")
        return 2
    return status
