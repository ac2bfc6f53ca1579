"""A plain PyTorch loop under an isolation spec read from YAML.

Apply the spec, train, thaw on schedule, verify, checkpoint and resume, restore::

    python examples/plain_loop.py --epochs 4
    python examples/plain_loop.py --epochs 4 --checkpoint run.pt --stop-after 2
    python examples/plain_loop.py --epochs 4 --checkpoint run.pt   # resumes at epoch 2

The spec is ``examples/isolation.yaml``: the trunk is frozen (BatchNorm statistics too), the
probe learns on detached features, and the trunk's last layer thaws at epoch 2. At the end
the script prints what ``verify`` checked, and the head's checksum: the same number as the
Fabric and Lightning examples and as a resumed run print.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import isolate
from examples.toy import Net, batches, losses, summary
from isolate.cli import Parser

SPEC = Path(__file__).with_name("isolation.yaml")
STOPPED = "run the same command without --stop-after to finish from the checkpoint."


def load_spec(path: Path = SPEC) -> isolate.IsolationSpec:
    """The spec from a YAML file: plain data only."""
    return isolate.IsolationSpec.from_dict(yaml.safe_load(path.read_text()))


def train(
    epochs: int,
    *,
    checkpoint: Path | None = None,
    stop_after: int | None = None,
    verify_every: int = 4,
    verbose: bool = False,
) -> Net:
    """Train for ``epochs`` epochs; resume from ``checkpoint`` if it exists, and save it after
    every epoch. ``stop_after`` ends the run after that many epochs (an interruption).
    ``verbose`` prints the thaws, what ``verify`` checked and the head's checksum.

    Returns:
        The model, with the spec restored (every flag as before ``apply``).
    """
    model = Net()
    handle = load_spec().apply(model)
    # Built after apply, from what is trainable: frozen parameters never sit in the optimizer.
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad],
        lr=0.05,
        momentum=0.9,
        weight_decay=1e-4,
    )
    handle.attach(optimizer)
    start, step = 0, 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        handle.load_state_dict(state["isolation"])  # thaws again what was thawed, no re-freeze
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, step = state["epoch"], state["step"]
    try:
        for epoch in range(start, epochs):
            model.train()
            for x, y in batches(epoch):
                thawed = handle.step(epoch=epoch, step=step)
                if thawed and verbose:
                    print(f"epoch {epoch}, step {step}: thawed {thawed}")
                loss = losses(model, x, y)
                if step % verify_every == 0:  # before backward, while the graph is alive
                    handle.verify({"probe": loss["probe"]})
                optimizer.zero_grad()
                (loss["main"] + loss["probe"]).backward()
                optimizer.step()
                step += 1
            if checkpoint is not None:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "isolation": handle.state_dict(),
                        "epoch": epoch + 1,
                        "step": step,
                    },
                    checkpoint,
                )
            if stop_after is not None and epoch + 1 >= stop_after:
                break
        handle.verify(checks=("drift", "flags", "optimizers"), when="at the end")
    finally:
        handle.restore()
    if verbose:
        stopped = stop_after is not None and stop_after < epochs
        print(summary(model, handle.tally, stopped=STOPPED if stopped else ""))
    return model


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The options of the plain and Fabric examples; ``--help`` shows the docstring as written."""
    parser = Parser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=4, help="epochs to train (default 4)")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="resume from this file if it exists; save to it after every epoch",
    )
    parser.add_argument(
        "--stop-after", type=int, default=None, help="stop after this many epochs (an interruption)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser("python examples/plain_loop.py", __doc__).parse_args(argv)
    train(args.epochs, checkpoint=args.checkpoint, stop_after=args.stop_after, verbose=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
