"""Both Lightnings: the standalone ``pytorch_lightning`` and the unified ``lightning.pytorch``.

The two are one source published under two names: their classes are distinct, so an
``isinstance`` check against one package's ``Strategy`` or ``Callback`` is false for the
other's objects. Recent ``lightning`` releases install ``pytorch-lightning`` beside them, so
what is installed does not tell which one a user's ``Trainer`` comes from. Here:

* :data:`Callback` derives from the ``Callback`` of every Lightning installed, so one
  :class:`~isolate.lightning.IsolationCallback` is a callback of either ``Trainer``
  (``Trainer(callbacks=cb)``, LightningCLI's ``class_path``, ``is_overridden`` all check it);
* :func:`package` finds the package an object comes from, so that strategies are compared
  with the classes of the trainer's own package.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = ["PACKAGES", "Callback", "package"]

PACKAGES = ("pytorch_lightning", "lightning.pytorch")
"""The import names of Lightning's trainer package: standalone, unified."""


def _installed() -> list[ModuleType]:
    found = []
    for name in PACKAGES:
        try:
            found.append(importlib.import_module(name))
        except ModuleNotFoundError as error:
            # Only the package itself may be missing; a broken install must not pass for one.
            if error.name is None or not (name == error.name or name.startswith(error.name + ".")):
                raise
    if not found:
        raise ModuleNotFoundError(
            "isolate.lightning needs Lightning, an optional dependency: pip install "
            "'isolate[lightning]' (pytorch-lightning), or pip install lightning",
            name="pytorch_lightning",
        )
    return found


def _callback() -> type:
    bases: tuple[type, ...] = tuple(p.Callback for p in _installed())
    if len(bases) == 1:
        return bases[0]
    return type(
        "Callback",
        bases,
        {
            "__module__": __name__,
            "__doc__": "A Callback of " + " and of ".join(PACKAGES) + ".",
        },
    )


if TYPE_CHECKING:
    from pytorch_lightning import Callback
else:
    Callback = _callback()


def package(obj: object, kind: str) -> ModuleType | None:
    """The Lightning package whose ``kind`` (``"Trainer"``, ``"LightningModule"``,
    ``"strategies.Strategy"``, ...) ``obj`` is an instance of; ``None`` if no Lightning's.

    Only packages already imported are asked: an object of a package implies its import.

    >>> import lightning.pytorch
    >>> strategy = lightning.pytorch.strategies.SingleDeviceStrategy("cpu")
    >>> package(strategy, "strategies.Strategy").__name__
    'lightning.pytorch'
    >>> package(strategy, "Trainer") is None
    True
    """
    for name in PACKAGES:
        module = sys.modules.get(name)
        if module is None:
            continue
        cls: Any = module
        for part in kind.split("."):
            cls = getattr(cls, part)
        if isinstance(obj, cls):
            return module
    return None
