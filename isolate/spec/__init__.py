"""The declarative path: a spec as data, resolved once into a plan, applied as a handle.

``IsolationSpec`` (data, checked when built) -> ``plan`` (its selectors resolved against one
model) -> ``IsolationHandle`` (the flags flipped, branches wrapped, groups thawed on schedule,
checks run, state saved, everything undone exactly). The modules below, in the order a spec
travels: ``thaw`` and ``data`` (the declaration), ``plan`` (resolution), ``clock`` and
``thawing`` (when a group thaws), ``optimizers`` and ``lr_schedulers`` (how it joins the
optimizer), ``branches``, ``checks``, ``verifier`` and ``cadence`` (what is checked, against
what, and when), ``contracts`` (what a method promises, as data) with ``contract_checks``,
``contract_clauses``, ``ema`` and ``reversal`` (how it is checked), ``state`` (saved state),
``ranks`` (several processes), ``handle`` and ``isolation`` (the verbs).
"""

from isolate.spec.handle import IsolationHandle
from isolate.spec.isolation import IsolationSpec
from isolate.spec.thaw import Thaw, ThawKeys

__all__ = ["IsolationHandle", "IsolationSpec", "Thaw", "ThawKeys"]
