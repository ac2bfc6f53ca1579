"""PyTorch Lightning integration: declare what must not learn from what, without model code.

:class:`IsolationCallback` applies an :class:`isolate.IsolationSpec` for a ``fit``: it
freezes parameters, wraps named submodules in :class:`isolate.Detached` /
:class:`isolate.Cloned`, thaws groups on a schedule, checks while training that the declared
isolation holds, and saves where it stands in checkpoints. Each hook drives the core
:class:`isolate.IsolationHandle`; the spec, its ``Thaw`` steps and the errors are the core's
(``isolate``, ``isolate.errors``).

This is the only package of ``isolate`` that imports Lightning; import it explicitly
(``from isolate.lightning import IsolationCallback``): ``import isolate`` does not. Either
Lightning works, the standalone ``pytorch_lightning`` and the unified ``lightning.pytorch``:
the one ``IsolationCallback`` is a ``Callback`` of each installed, and strategies are checked
against the trainer's own package.
"""

from isolate.lightning.callback import IsolationCallback
from isolate.lightning.losses import LOSSES_ATTRIBUTE

__all__ = ["LOSSES_ATTRIBUTE", "IsolationCallback"]
