"""Declarative, verifiable gradient isolation for PyTorch.

Freeze parameter subsets, detach auxiliary branches, clone shared features, each with an
exact undo, and prove that a loss cannot reach what it must not touch.

The package has three layers, each importing only the ones below it:

* the toolkit, at the root. *Do*: :mod:`isolate.freezing`, :mod:`isolate.detaching`,
  :mod:`isolate.cloning`. *Prove*: :mod:`isolate.reachability` (what a loss reaches),
  :mod:`isolate.cutoff` (what no loss reaches), :mod:`isolate.gradients` (how much),
  :mod:`isolate.ledger` (all of it, one row per parameter),
  :mod:`isolate.drift` and :mod:`isolate.fingerprints` (what moved), :mod:`isolate.exposure`
  (what an optimizer moves), :mod:`isolate.testing` (pytest helpers). Every exception is in
  :mod:`isolate.errors`.
* the declarative path, :mod:`isolate.spec`: a spec as data, resolved into a plan, applied
  as a handle that thaws, checks, saves and undoes.
* the ways in and out, :mod:`isolate.interop` (migration from finetuning-scheduler, leaving
  isolate, default schedules), :mod:`isolate.certificates` (what a run did, proven from its
  checkpoints alone: :func:`certify`), and the integrations at the edge (:mod:`isolate.lightning`),
  which ``import isolate`` does not import.
"""

from isolate._version import __version__ as __version__
from isolate.certificates import certify
from isolate.cloning import Cloned, clone
from isolate.cutoff import assert_reached
from isolate.detaching import Detached, GradientScale, scale_gradient, stop_gradient
from isolate.drift import snapshot
from isolate.errors import IsolationError, IsolationWarning
from isolate.freezing import Frozen, freeze, frozen
from isolate.gradients import gradient_report
from isolate.ledger import ledger
from isolate.reachability import assert_isolated
from isolate.spec import IsolationHandle, IsolationSpec, Thaw

__all__ = [
    "Cloned",
    "Detached",
    "Frozen",
    "GradientScale",
    "IsolationError",
    "IsolationHandle",
    "IsolationSpec",
    "IsolationWarning",
    "Thaw",
    "assert_isolated",
    "assert_reached",
    "certify",
    "clone",
    "freeze",
    "frozen",
    "gradient_report",
    "ledger",
    "scale_gradient",
    "snapshot",
    "stop_gradient",
]
