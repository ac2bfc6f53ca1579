"""A run's own certificate: its weights at the first and the last step, and what
:func:`isolate.certify` proves from those two files alone under the run's spec.

A variant declares ``certify: true`` in its ``variant:`` block; its run then writes
``first.pt`` and ``last.pt`` (the LightningModule's ``state_dict``) and ``certificate.json``
into its folder, and the report links the certificate. One process only: a sharded run's
weights are not whole on any one rank, so it records why it has no certificate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

import isolate
from isolate.lightning import IsolationCallback

__all__ = ["CERTIFICATE", "save_weights", "write_certificate"]

CERTIFICATE = "certificate.json"


def save_weights(pl_module: pl.LightningModule, path: Path) -> None:
    """The module's ``state_dict`` as plain host tensors, loadable with ``weights_only``."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.state_dict().items()}
    torch.save(state, path)


def write_certificate(trainer: pl.Trainer, output: Path) -> dict[str, Any]:
    """Certify ``output/first.pt`` against ``output/last.pt`` under the run's spec; write
    ``certificate.json`` and return what the run record keeps of it."""
    if trainer.world_size > 1:
        return {"skipped": "a sharded or replicated run: no rank holds the whole model"}
    spec = next(
        (c.spec for c in trainer.callbacks if isinstance(c, IsolationCallback)),  # type: ignore[attr-defined]
        None,
    )
    if spec is None:
        return {"skipped": "no IsolationCallback: no spec to certify against"}
    certificate = isolate.certify(output / "first.pt", output / "last.pt", spec=spec)
    (output / CERTIFICATE).write_text(certificate.to_json())
    return {"clean": certificate.clean, "summary": certificate.summary(), "file": CERTIFICATE}
