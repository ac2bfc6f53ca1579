"""Declarative, verifiable gradient isolation for PyTorch.

Freeze parameter subsets, detach auxiliary branches, clone shared features, each with an
exact undo, and prove that a loss cannot reach what it must not touch.
"""

from isolate.cloning import Cloned, clone
from isolate.detaching import Detached, GradientScale, scale_gradient, stop_gradient
from isolate.errors import (
    DriftError,
    GradientLeakError,
    InplaceModificationError,
    IsolationError,
    IsolationTypeError,
    RestoreError,
    SelectorError,
    WrappingError,
)
from isolate.freezing import FreezeHandle, Frozen, freeze, frozen, is_frozen, unfreeze, unfrozen

__all__ = [
    "Cloned",
    "Detached",
    "DriftError",
    "FreezeHandle",
    "Frozen",
    "GradientLeakError",
    "GradientScale",
    "InplaceModificationError",
    "IsolationError",
    "IsolationTypeError",
    "RestoreError",
    "SelectorError",
    "WrappingError",
    "clone",
    "freeze",
    "frozen",
    "is_frozen",
    "scale_gradient",
    "stop_gradient",
    "unfreeze",
    "unfrozen",
]

__version__ = "0.1.0"
