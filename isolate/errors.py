"""The exceptions of ``isolate``.

Every error the library raises derives from :class:`IsolationError`, and each subclass also
inherits the builtin that fits, so ``except ValueError`` keeps working for callers that do not
know about ``isolate``.

Certifying checkpoints (:mod:`isolate.certificates`) adds ``CertificateError`` (a
``ValueError``: a claim that does not fit the files) and its subclass ``CheckpointReadError``
(a file that cannot be read safely: truncated, not weights-only, of an unknown format).
The PEFT integration (:mod:`isolate.peft`) adds ``AdapterStateError`` (a ``ValueError``: a
PEFT model whose flags contradict its adapters).
"""

from __future__ import annotations

__all__ = [
    "AdapterStateError",
    "BlindSpotError",
    "CertificateError",
    "CheckpointMismatchError",
    "CheckpointReadError",
    "ContractError",
    "CutOffError",
    "DriftError",
    "GradientLeakError",
    "InplaceModificationError",
    "IsolationError",
    "IsolationTypeError",
    "IsolationWarning",
    "RankDivergenceError",
    "ReplacedParameterError",
    "RestoreError",
    "SelectorError",
    "ShardedGraphError",
    "SpecError",
    "StaleCompileError",
    "UnsupportedStrategyError",
    "WrappingError",
]


class IsolationError(Exception):
    """Base class of every error raised by ``isolate``."""


class SelectorError(IsolationError, ValueError):
    """A selector is malformed or matches nothing."""


class IsolationTypeError(IsolationError, TypeError):
    """An argument has the wrong type (a non-module target, a non-tensor input, ...)."""


class WrappingError(IsolationError, ValueError):
    """A module is wrapped in a way that cannot work (for example, wrapped twice)."""


class RestoreError(IsolationError, RuntimeError):
    """A handle is restored twice, or out of order."""


class InplaceModificationError(IsolationError, RuntimeError):
    """A branch edited a tensor in place that it shares with the main network."""


class GradientLeakError(IsolationError, AssertionError):
    """A loss reaches parameters that were meant to be protected from it."""


class DriftError(IsolationError, AssertionError):
    """Parameters or buffers changed when they were meant to stay fixed."""


class SpecError(IsolationError, ValueError):
    """An isolation spec that cannot work: bad arguments, overlaps, or an optimizer mismatch."""


class CheckpointMismatchError(IsolationError, ValueError):
    """Saved isolation state was written under a different spec, or without one."""


class RankDivergenceError(DriftError):
    """Parameters differ across the processes of a distributed run."""


class ReplacedParameterError(IsolationError, AssertionError):
    """A parameter the spec applies to was replaced by a new object after it was applied
    (re-registered, converted, sharded, loaded with ``assign=True``): the freeze, the thaws
    and the checks still hold the old one."""


class CutOffError(IsolationError, AssertionError):
    """Trainable parameters get no gradient from any loss: they will never learn."""


class StaleCompileError(CutOffError):
    """A ``torch.compile`` region compiled while some of its inputs did not require grad runs
    after they were thawed: its backward has no gradient for them, so they never learn.

    Attributes:
        tensors: the inputs (parameters) the region's backward has no gradient for.
    """

    tensors: tuple[object, ...] = ()


class ContractError(IsolationError, AssertionError):
    """A method's contract does not hold: the message names the contract, the clause that
    failed and the tensors it failed for (see :mod:`isolate.spec.contracts`)."""


class BlindSpotError(IsolationError, RuntimeError):
    """An audit cannot see part of the graph (code re-run in backward), so it refuses."""


class ShardedGraphError(BlindSpotError):
    """The graph's leaves stand for parameters (copies or views a sharding wrapper made) that
    cannot be mapped back to them, so an audit refuses rather than pass vacuously."""


class UnsupportedStrategyError(SpecError):
    """A distributed strategy or wrapper under which the spec cannot hold, with the reason."""


class AdapterStateError(IsolationError, ValueError):
    """A PEFT model's ``requires_grad`` flags contradict its adapters: a base tensor trains, an
    adapter that is not active trains, an active one cannot, or a tied output head trains
    through ``modules_to_save`` apart from the embedding it is tied to."""


class IsolationWarning(UserWarning):
    """Isolation holds for now, but something could quietly break it (see the message)."""


class CertificateError(IsolationError, ValueError):
    """Checkpoints cannot be certified as asked: a claim names no key, a tensor's shape or
    dtype differs between the files, an adapter does not fit its base."""


class CheckpointReadError(CertificateError):
    """A checkpoint cannot be read safely: truncated, not a weights-only pickle, or of a
    format that is not recognised."""
