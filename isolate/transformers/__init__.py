"""transformers integration: an :class:`isolate.IsolationSpec` held through ``Trainer.train()``.

:class:`IsolationTrainerCallback` applies the spec before the Trainer builds its optimizer,
thaws groups on the spec's schedule (in the Trainer's steps and epochs), checks while training
that the declared isolation holds, and saves where it stands in the Trainer's checkpoints, so
that ``train(resume_from_checkpoint=...)`` continues bit for bit. Each event drives the core
:class:`isolate.IsolationHandle`; the spec, its ``Thaw`` steps and the errors are the core's.

This is the only package of ``isolate`` that imports transformers; import it explicitly
(``from isolate.transformers import IsolationTrainerCallback``): ``import isolate`` does not.
"""

from isolate.transformers.callback import IsolationTrainerCallback

__all__ = ["IsolationTrainerCallback"]
