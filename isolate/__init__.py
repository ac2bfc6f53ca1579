"""Declarative, verifiable gradient isolation for PyTorch.

Freeze parameter subsets, detach auxiliary branches, clone shared features, each with an
exact undo, and prove that a loss cannot reach what it must not touch.
"""

from isolate.cloning import Cloned, clone
from isolate.detaching import Detached, GradientScale, scale_gradient, stop_gradient
from isolate.drift import Exposure, Snapshot, optimizer_exposure, snapshot
from isolate.engine import IsolationHandle
from isolate.errors import (
    BlindSpotError,
    CheckpointMismatchError,
    CutOffError,
    DriftError,
    GradientLeakError,
    InplaceModificationError,
    IsolationError,
    IsolationTypeError,
    IsolationWarning,
    RankDivergenceError,
    RestoreError,
    SelectorError,
    ShardedGraphError,
    SpecError,
    UnsupportedStrategyError,
    WrappingError,
)
from isolate.fingerprints import fingerprint
from isolate.freezing import FreezeHandle, Frozen, freeze, frozen, is_frozen, unfreeze, unfrozen
from isolate.gradients import (
    GradientInvariance,
    GradientReport,
    GroupStats,
    gradient_invariance,
    gradient_report,
)
from isolate.graph import assert_isolated, reachable_parameters
from isolate.reach import CutOff, ForwardTrace, assert_reached, cut_off_parameters, trace_forward
from isolate.spec import IsolationSpec, Thaw

__all__ = [
    "BlindSpotError",
    "CheckpointMismatchError",
    "Cloned",
    "CutOff",
    "CutOffError",
    "Detached",
    "DriftError",
    "Exposure",
    "ForwardTrace",
    "FreezeHandle",
    "Frozen",
    "GradientInvariance",
    "GradientLeakError",
    "GradientReport",
    "GradientScale",
    "GroupStats",
    "InplaceModificationError",
    "IsolationError",
    "IsolationHandle",
    "IsolationSpec",
    "IsolationTypeError",
    "IsolationWarning",
    "RankDivergenceError",
    "RestoreError",
    "SelectorError",
    "ShardedGraphError",
    "Snapshot",
    "SpecError",
    "Thaw",
    "UnsupportedStrategyError",
    "WrappingError",
    "assert_isolated",
    "assert_reached",
    "clone",
    "cut_off_parameters",
    "fingerprint",
    "freeze",
    "frozen",
    "gradient_invariance",
    "gradient_report",
    "is_frozen",
    "optimizer_exposure",
    "reachable_parameters",
    "scale_gradient",
    "snapshot",
    "stop_gradient",
    "trace_forward",
    "unfreeze",
    "unfrozen",
]

__version__ = "0.1.0"
