"""The user's spec: :class:`~isolate.spec.data.SpecData` with the verbs that apply it.

:meth:`IsolationSpec.apply` makes the spec real on a model and returns an
:class:`~isolate.spec.handle.IsolationHandle` that thaws, verifies, saves and undoes it. The
same spec drives a plain PyTorch loop, Lightning Fabric, and the Lightning callback
(:class:`isolate.lightning.IsolationCallback`), which is a thin adapter over it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Literal

from torch import nn

from isolate._sharding import check_wrappers, settle
from isolate.errors import IsolationTypeError, SpecError
from isolate.spec.data import SpecData
from isolate.spec.handle import IsolationHandle, warn_user
from isolate.spec.optimizers import Optimizers, as_optimizers, place
from isolate.spec.plan import resolve

__all__ = ["IsolationSpec", "apply"]


class IsolationSpec(SpecData):
    """What must not learn from what, as data: validated when built, applied to a model.

    Args:
        freeze: parameters to freeze: module names (``"trunk"``), parameter names or globs
            over them (``"trunk.*"``, ``"*.bias"``).
        detach: names of submodules to feed detached inputs (:class:`isolate.Detached`): they
            learn from their own loss, nothing upstream of them does.
        clone: names of submodules to feed cloned inputs (:class:`isolate.Cloned`): gradient
            still flows back, in-place edits stay inside.
        bn: BatchNorm layers among the frozen parameters: ``"eval"`` holds them in eval mode,
            through ``model.train()``, so their running statistics do not move; ``"train"``
            lets them update.
        thaw: the unfreezing schedule: :class:`Thaw` steps, or mappings with their keys.
        protect: loss name -> selectors of the parameters that loss must not reach. ``None``
            protects everything upstream of ``detach`` branches from every named loss.
        frozen_in_optimizer: what to do with frozen parameters found in an optimizer, where
            weight decay or momentum could move them: ``"remove"`` takes them out (with a
            warning naming them; a thaw puts them back), ``"error"`` refuses.
        mode: hold the frozen part as a whole: ``"eval"`` holds every layer in it whose
            behaviour depends on its mode (dropout, drop path, BatchNorm, ...; see
            :func:`isolate.freeze`) in eval mode, through ``model.train()``; ``"train"`` lets
            them all follow the model. ``None`` (default): ``bn`` decides, for BatchNorm only.
        contracts: what the training method promises, checked by ``verify`` and on the
            loop's schedule: mappings with a ``kind`` (``teacher``, ``ema``,
            ``stop_gradient``, ``reversal``, ``probe``, ``trains``) and its keys, or
            :class:`~isolate.spec.contracts.Contract` objects; see
            :mod:`isolate.spec.contracts`.

    Raises:
        SpecError: an argument has the wrong type or value, a thaw name repeats, a branch
            is both detached and cloned, or a contract has an unknown kind or key (with the
            closest known one) or lacks one.

    >>> from isolate.spec import Thaw
    >>> spec = IsolationSpec(freeze=["trunk"], detach=["probe"], thaw=[Thaw("trunk", epoch=2)])
    >>> spec
    IsolationSpec(freeze=['trunk'], detach=['probe'], thaw=[trunk at epoch 2])
    >>> IsolationSpec.from_dict({"freeze": "trunk", "bn": "eval"}).freeze
    ('trunk',)
    >>> IsolationSpec.from_dict({"frezze": ["trunk"]})
    Traceback (most recent call last):
    ...
    isolate.errors.SpecError: IsolationSpec.from_dict() has unknown keys ['frezze'] (did you ...
    """

    def apply(
        self,
        model: nn.Module,
        optimizer: Optimizers = None,
        *,
        drift: Literal["fingerprint", "copy"] = "fingerprint",
    ) -> IsolationHandle:
        """Check the whole spec against ``model``, then freeze, hold and wrap.

        Args:
            model: the module to isolate.
            optimizer: an optimizer (or a list of them) to take the frozen parameters out of,
                and for thawed groups to join; it can also be attached later with
                :meth:`~isolate.spec.handle.IsolationHandle.attach`.
            drift: how ``verify`` checks that frozen tensors stay put: ``"fingerprint"``
                keeps a 128-bit fingerprint of each (O(number of tensors) memory; any changed
                bit is caught, its size is not known), ``"copy"`` a copy in host memory (the
                size of a change is reported; costs the size of the frozen part).

        Returns:
            An :class:`~isolate.spec.handle.IsolationHandle`: ``thaw``, ``step``, ``verify``,
            ``state_dict`` / ``load_state_dict`` and an exact ``restore``.

        Raises:
            SelectorError: a selector matches nothing, or a branch is not a submodule.
            SpecError: the spec does not fit the model or the optimizer. On any error the
                model (and the optimizer) are exactly as before.
        """
        return apply(self, model, optimizer, drift=drift)

    def expectations(self, model: nn.Module) -> dict[str, str]:
        """Parameter key -> what the spec expects of it on ``model`` before training starts
        (``"still"``, ``"still until epoch 2"``, ``"EMA of <online>"``, ``"moves"``): the
        ``expects`` column of :func:`isolate.ledger.ledger`. Changes nothing.

        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
        >>> IsolationSpec(freeze=["0"]).expectations(net)
        {'0.weight': 'still', '0.bias': 'still', '1.weight': 'moves', '1.bias': 'moves'}
        """
        plan = resolve(self, model)
        return plan.expectations(plan.frozen, ())

    @contextlib.contextmanager
    def applied(
        self,
        model: nn.Module,
        optimizer: Optimizers = None,
        *,
        drift: Literal["fingerprint", "copy"] = "fingerprint",
    ) -> Iterator[IsolationHandle]:
        """:meth:`apply` as a context manager: restored on exit, exceptions included.

        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with IsolationSpec(freeze=["0"]).applied(model) as handle:
        ...     model[0].weight.requires_grad, handle.frozen
        (False, ('0.weight', '0.bias'))
        >>> model[0].weight.requires_grad
        True
        """
        handle = self.apply(model, optimizer, drift=drift)
        try:
            yield handle
        finally:
            if handle.active:
                handle.restore()


def apply(
    spec: SpecData,
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    caller: str = "IsolationSpec",
    warn: Callable[[str], None] = warn_user,
    drift: Literal["fingerprint", "copy"] = "fingerprint",
) -> IsolationHandle:
    """Resolve ``spec`` on ``model``, check it whole, then change: what
    :meth:`IsolationSpec.apply` does, with the caller and warning channel of an integration.

    Raises:
        SelectorError: as :meth:`IsolationSpec.apply`.
        SpecError: as :meth:`IsolationSpec.apply`. On any error the model and the optimizer
            are exactly as before.
    """
    if not isinstance(spec, SpecData):
        raise IsolationTypeError(f"{caller}: spec must be an IsolationSpec, got {type(spec)}")
    settle(model)  # FSDP2: resolve and flip the sharded parameters, not temporaries
    check_wrappers(model, {}, caller, warn)  # FSDP1 flat parameters: refuse first
    plan = resolve(spec, model, caller)
    check_wrappers(model, plan.frozen, caller, warn)  # FSDP1 mixed units: warn
    optimizers = as_optimizers(optimizer, caller)
    if optimizers:
        place(plan, optimizers, set(), caller)  # only to refuse before anything changes
    if drift not in ("fingerprint", "copy"):
        raise SpecError(f"{caller}: drift must be 'fingerprint' or 'copy', got {drift!r}")
    handle = IsolationHandle(plan, caller=caller, warn=warn)
    handle.drift = drift
    handle.start()
    if optimizers:
        try:
            handle.attach(optimizers)
        except BaseException:
            handle.restore()
            raise
    return handle
