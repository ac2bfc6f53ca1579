"""PyTorch Lightning integration: declare what must not learn from what, without model code.

:class:`IsolationCallback` applies an :class:`isolate.IsolationSpec` for a ``fit``: it
freezes parameters, wraps named submodules in :class:`isolate.Detached` /
:class:`isolate.Cloned`, thaws groups on a schedule, checks while training that the declared
isolation holds, and saves where it stands in checkpoints. :class:`Thaw` is one step of the
schedule (the core's, re-exported here).

This is the only package of ``isolate`` that imports Lightning; import it explicitly
(``from isolate.lightning import IsolationCallback``): ``import isolate`` does not.
"""

from isolate.errors import (
    CheckpointMismatchError,
    IsolationWarning,
    RankDivergenceError,
    SpecError,
)
from isolate.lightning.callback import LOSSES_ATTRIBUTE, IsolationCallback
from isolate.spec import IsolationSpec, Thaw, ThawKeys

__all__ = [
    "LOSSES_ATTRIBUTE",
    "CheckpointMismatchError",
    "IsolationCallback",
    "IsolationSpec",
    "IsolationWarning",
    "RankDivergenceError",
    "SpecError",
    "Thaw",
    "ThawKeys",
]
