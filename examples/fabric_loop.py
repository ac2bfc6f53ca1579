"""A Lightning Fabric loop under the same isolation spec (single process here).

The same steps as ``examples/plain_loop.py``: apply the spec to the raw model before
``fabric.setup`` (the branches are wrapped in place), attach the optimizer Fabric returns,
and keep the spec's state in Fabric's checkpoint::

    python examples/fabric_loop.py --epochs 4
    python examples/fabric_loop.py --epochs 4 --checkpoint fabric.pt --stop-after 2
    python examples/fabric_loop.py --epochs 4 --checkpoint fabric.pt   # resumes at epoch 2

It prints what ``verify`` checked, and the head's checksum: the plain loop's number.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning_fabric import Fabric

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.plain_loop import STOPPED, load_spec, parser
from examples.toy import Net, batches, losses, summary


def train(
    epochs: int,
    *,
    checkpoint: Path | None = None,
    stop_after: int | None = None,
    verify_every: int = 4,
    verbose: bool = False,
) -> Net:
    """As :func:`examples.plain_loop.train`, with Fabric doing the device work."""
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    model = Net()
    handle = load_spec().apply(model)  # before setup: Fabric wraps the model afterwards
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad],
        lr=0.05,
        momentum=0.9,
        weight_decay=1e-4,
    )
    fabric_model, fabric_optimizer = fabric.setup(model, optimizer)
    handle.attach(fabric_optimizer)  # the wrapper shares the optimizer's param groups
    start, step = 0, 0
    if checkpoint is not None and checkpoint.exists():
        state = fabric.load(checkpoint)
        handle.load_state_dict(state["isolation"])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, step = state["epoch"], state["step"]
    try:
        for epoch in range(start, epochs):
            fabric_model.train()
            for x, y in batches(epoch):
                handle.step(epoch=epoch, step=step)
                x, y = fabric.to_device((x, y))
                loss = losses(fabric_model, x, y)  # type: ignore[arg-type]
                if step % verify_every == 0:
                    handle.verify({"probe": loss["probe"]})
                fabric_optimizer.zero_grad()
                fabric.backward(loss["main"] + loss["probe"])
                fabric_optimizer.step()
                step += 1
            if checkpoint is not None:
                fabric.save(
                    checkpoint,
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "isolation": handle.state_dict(),
                        "epoch": epoch + 1,
                        "step": step,
                    },
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


def main(argv: list[str] | None = None) -> int:
    args = parser("python examples/fabric_loop.py", __doc__).parse_args(argv)
    train(args.epochs, checkpoint=args.checkpoint, stop_after=args.stop_after, verbose=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
