"""Certify from two checkpoints alone what a run froze, trained, merged and tied.

:func:`certify` reads a base and a tuned checkpoint (safetensors, ``torch.save`` loaded
weights-only, torch.distributed.checkpoint folders) one tensor at a time, with no model
class and no training code, and checks them against an :class:`~isolate.spec.IsolationSpec`
or a PEFT LoRA adapter config. The :class:`Certificate` it returns holds one
:class:`Verdict` per claim, the files' own hashes, the claims, the tolerances and the
versions, so that anyone can check it again. ``main`` is the command line
(``isolate certify BASE TUNED --spec spec.yaml``).

A certificate shows which tensors changed; it cannot show which loss changed them.
"""

from isolate.certificates.api import certify
from isolate.certificates.certificate import Certificate, FileRecord, Verdict
from isolate.certificates.cli import main
from isolate.certificates.peft import LoraConfig

__all__ = ["Certificate", "FileRecord", "LoraConfig", "Verdict", "certify", "main"]
