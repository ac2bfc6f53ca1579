"""Certify from two checkpoints alone what a run froze, trained, merged and tied.

``isolate certify BASE TUNED ...``, the command line over :func:`isolate.certificates.certify`:
``add_arguments`` and ``run`` make it a verb of the ``isolate`` command, ``main`` runs it on
its own. Exit status: 0 when the certificate is clean, 1 when a claim fails, 2 on bad input
(one line on stderr naming the file or tensor and the fix).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from isolate.certificates.api import certify
from isolate.certificates.claims import BUFFERS
from isolate.errors import CertificateError, IsolationError
from isolate.spec.data import SpecData

__all__ = ["DESCRIPTION", "add_arguments", "main", "parser", "run"]

PROG = "isolate certify"

DESCRIPTION = """\
Certify from two checkpoints alone what a run froze, trained, merged and tied; write the
certificate as JSON:

    isolate certify base.safetensors tuned.safetensors --freeze backbone -o certificate.json
    isolate certify base.ckpt last.ckpt --spec isolation.yaml --prefix net
"""
"""What ``isolate certify --help`` says, with examples (kept as written)."""


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        raise _UsageError(f"{message} (see {PROG} --help)")


def _rows(text: str) -> tuple[str, list[int]]:
    key, sep, listed = text.partition("=")
    try:
        indices = [int(i) for i in listed.split(",") if i.strip()]
    except ValueError:
        indices = []
    if not sep or not key or not indices:
        raise argparse.ArgumentTypeError(
            f"expected KEY=ROW,ROW,... (e.g. embed.weight=3,7), got {text!r}"
        )
    return key, indices


def _tie(text: str) -> list[str]:
    keys = [k for k in text.split(",") if k]
    if len(keys) < 2:
        raise argparse.ArgumentTypeError(f"expected KEY,KEY[,...] (two keys or more), got {text!r}")
    return keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``isolate certify``."""
    p.epilog = "A certificate shows which tensors changed; it cannot show which loss changed them."
    p.add_argument(
        "base",
        type=Path,
        help="the checkpoint before: a .safetensors file, a torch.save file, or a "
        "torch.distributed.checkpoint folder",
    )
    p.add_argument(
        "tuned", type=Path, help="the checkpoint after (fine-tuned, merged, or the run's last)"
    )
    _claims(p)
    _options(p)


def _claims(p: argparse.ArgumentParser) -> None:
    claims = p.add_argument_group("claims (give at least one)")
    claims.add_argument("--spec", help="an IsolationSpec as a JSON or YAML file (freeze, thaw, bn)")
    claims.add_argument(
        "--freeze",
        nargs="+",
        metavar="SELECTOR",
        help="frozen keys, as spec freeze selectors (names, globs, '!' exclusions); "
        "instead of --spec",
    )
    claims.add_argument(
        "--bn",
        choices=["eval", "train"],
        default="eval",
        help="with --freeze: BatchNorm statistics of the frozen part are held (eval) or may "
        "update (train); default eval",
    )
    claims.add_argument(
        "--adapter-config",
        metavar="FILE",
        help="a PEFT LoRA adapter_config.json (or its folder): TUNED is the base merged with it",
    )
    claims.add_argument(
        "--adapter",
        metavar="FILE",
        help="the adapter's weights (adapter_model.safetensors): check the merge value by value",
    )
    claims.add_argument(
        "--rows",
        action="append",
        type=_rows,
        default=[],
        metavar="KEY=ROWS",
        help="only these rows of KEY train, e.g. embed.weight=3,7 (repeatable)",
    )
    claims.add_argument(
        "--tie",
        action="append",
        type=_tie,
        default=[],
        metavar="KEYS",
        help="keys that must stay equal, e.g. embed.weight,head.weight (repeatable)",
    )


def _options(p: argparse.ArgumentParser) -> None:
    opts = p.add_argument_group("reading, comparing and output")
    opts.add_argument(
        "--no-detect-ties",
        action="store_true",
        help="do not treat keys bitwise equal in BASE as tied",
    )
    opts.add_argument(
        "--buffers",
        nargs="+",
        default=list(BUFFERS),
        metavar="GLOB",
        help=f"keys that are buffers (default: {' '.join(BUFFERS)})",
    )
    opts.add_argument(
        "--ignore",
        nargs="+",
        default=[],
        metavar="SELECTOR",
        help="keys to leave out of the certificate",
    )
    opts.add_argument(
        "--key",
        default="auto",
        help="where the weights sit in each file: auto (Lightning's state_dict, a distributed "
        "checkpoint's model), a group name, or none for the top level",
    )
    opts.add_argument(
        "--prefix",
        help="prefix the spec's selectors with this module name (a LightningModule holding "
        "the model as self.net: net)",
    )
    opts.add_argument(
        "--ulps",
        type=float,
        default=2.0,
        help="merge tolerance in units of the dtype's rounding (default 2)",
    )
    opts.add_argument(
        "--hash",
        choices=["xxh3", "sha256", "none"],
        default="xxh3",
        help="hash of each file recorded in the certificate (default xxh3: XXH3-128, as "
        "xxhsum -H2 prints it)",
    )
    opts.add_argument(
        "--output", "-o", type=Path, help="write the certificate as JSON to this file"
    )
    opts.add_argument(
        "--json", action="store_true", help="print the JSON certificate instead of the report"
    )


def parser() -> argparse.ArgumentParser:
    """The parser of ``isolate certify`` on its own (see :func:`main`)."""
    p = _Parser(
        prog=PROG, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Certify as ``args`` say, print the report, write the JSON; 0 clean, 1 a claim fails.

    Raises:
        IsolationError: bad input (``main`` prints it as one line and returns 2).
    """
    if args.spec and args.freeze:
        raise CertificateError("give --spec or --freeze, not both")
    spec = SpecData(freeze=tuple(args.freeze), bn=args.bn) if args.freeze else args.spec
    certificate = certify(
        args.base,
        args.tuned,
        spec=spec,
        adapter_config=args.adapter_config,
        adapter=args.adapter,
        rows=dict(args.rows),
        ties=args.tie,
        detect_ties=not args.no_detect_ties,
        buffers=args.buffers,
        ignore=args.ignore,
        key=None if args.key.lower() == "none" else args.key,
        prefix=args.prefix,
        ulps=args.ulps,
        file_hash=args.hash,
    )
    if args.output is not None:
        args.output.write_text(certificate.to_json())
    print(certificate.to_json() if args.json else certificate)
    return 0 if certificate.clean else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``isolate certify``; return 0 (clean), 1 (a claim fails) or 2 (bad input).

    >>> main(["--help"])  # doctest: +ELLIPSIS
    usage: isolate certify ...
    0
    """
    try:
        args = parser().parse_args(argv)
    except _UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as done:  # --help
        return int(done.code or 0)
    try:
        return run(args)
    except IsolationError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
