"""``python -m experiments``: one run through LightningCLI, or the whole suite.

One run (``configs/presets/base.yaml`` is loaded first, then each ``--config`` in order)::

    python -m experiments fit --config configs/detached.yaml
    python -m experiments fit --config configs/detached.yaml --config configs/presets/ddp.yaml

The suite, which runs every variant and writes the report (see :mod:`experiments.suite`)::

    python -m experiments suite [--output outputs/suite] [--quick] [--ddp]

``python -m experiments --help`` lists both. A missing or corrupt dataset is reported in one
message with the flag to pass, and exit status 1; a spec that cannot work (a selector that
matches nothing, a bad thaw, a checkpoint of another spec) in one line, and exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def report_spec_errors(run: Callable[[], int]) -> int:
    """Run ``run``; an isolation spec that cannot work becomes one line and status 2."""
    from isolate.errors import (
        CheckpointMismatchError,
        IsolationTypeError,
        SelectorError,
        SpecError,
        WrappingError,
    )

    try:
        return run()
    except (
        CheckpointMismatchError,
        IsolationTypeError,
        SelectorError,
        SpecError,
        WrappingError,
    ) as error:
        message = " ".join(str(error).split())
        sys.stderr.write(f"python -m experiments: error: {type(error).__name__}: {message}\n")
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the suite or to LightningCLI; returns the exit status."""
    from experiments.cli import cli_main, report_data_errors

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["suite"]:
        from experiments.suite import main as suite_main

        return report_data_errors(lambda: suite_main(args[1:]))

    def one_run() -> int:
        # None lets LightningCLI read sys.argv itself, as DDP's relaunch of this command expects.
        cli_main(None if argv is None else args)
        return 0

    return report_spec_errors(lambda: report_data_errors(one_run))


if __name__ == "__main__":
    sys.exit(main())
