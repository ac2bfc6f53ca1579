"""What an optimizer does to a parameter that must not move: the one rule, and its audit.

:func:`zero_grad_risks` is the rule: what in a param group and a parameter's optimizer state
moves the parameter on ``step()`` when its gradient is zero. :func:`optimizer_exposure` applies
it to every frozen parameter an optimizer still holds; the spec engine applies it when it
takes frozen parameters out of an optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from isolate.errors import IsolationTypeError

__all__ = [
    "MOMENTUM_STATE",
    "Exposure",
    "optimizer_exposure",
    "steps_without_grad",
    "unwrap_optimizer",
    "zero_grad_risks",
]

MOMENTUM_STATE = ("momentum_buffer", "exp_avg")
"""Optimizer state that keeps moving a parameter: a momentum buffer, or Adam's first moment."""


def _nonzero(t: torch.Tensor) -> bool:
    """Whether any stored value of ``t`` is non-zero (of a sparse tensor: its values)."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce().values()
    elif t.layout != torch.strided:
        t = t.values()
    return bool(t.ne(0).any())


def steps_without_grad(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` moves parameters whose ``.grad`` is ``None``: LBFGS steps every
    parameter it holds along one flat search direction; the other built-in optimizers skip
    them.

    >>> steps_without_grad(torch.optim.LBFGS([torch.zeros(1, requires_grad=True)]))
    True
    """
    return isinstance(optimizer, torch.optim.LBFGS)


def _search_history(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], param: torch.Tensor
) -> tuple[str, ...]:
    """LBFGS keeps its search direction and history over the flat view of its parameters,
    under the first one: non-zero entries for ``param`` move it. Conservative: a step whose
    new curvature pair LBFGS skips (which depends on the gradient the step computes) may
    leave a parameter that only the last direction holds where it is."""
    params = group["params"]
    state = optimizer.state.get(params[0], {}) if params else {}
    offset = 0
    for p in params:
        if p is param:
            break
        offset += p.numel()
    part = slice(offset, offset + param.numel())
    kept = [state.get("d"), state.get("prev_flat_grad"), *state.get("old_dirs", [])]
    kept += state.get("old_stps", [])
    if any(
        isinstance(t, torch.Tensor) and t.numel() >= part.stop and _nonzero(t[part]) for t in kept
    ):
        steps = len(state.get("old_dirs", []))
        return (
            f"LBFGS's search direction and history ({steps} steps) hold it, so its steps "
            f"move it, whatever its .grad (None included)",
        )
    return ()


def zero_grad_risks(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], param: torch.Tensor
) -> tuple[str, ...]:
    """Why ``optimizer.step()`` moves ``param`` (of param group ``group``) when its gradient
    is zero; empty when a zero gradient leaves it alone.

    The rule: weight decay (and ASGD's ``lambd``) shrinks it; a non-zero momentum buffer or
    Adam-style first moment keeps moving it (``SparseAdam`` only at the rows a sparse
    gradient stores); LBFGS moves it along a search direction that holds it, even when its
    ``.grad`` is ``None``. Second moments only scale a gradient.

    >>> p = torch.zeros(2, requires_grad=True)
    >>> zero_grad_risks(torch.optim.SGD([p], lr=0.1, weight_decay=0.01), {"weight_decay": 0.01}, p)
    ('weight_decay=0.01 shrinks it on every step',)
    >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    >>> zero_grad_risks(opt, opt.param_groups[0], p)
    ()
    """
    reasons = []
    decay = group.get("weight_decay", 0.0)
    if decay:
        reasons.append(f"weight_decay={decay} shrinks it on every step")
    if group.get("lambd"):  # ASGD decays every parameter it steps, weight decay or not
        reasons.append(f"lambd={group['lambd']} (ASGD) shrinks it on every step")
    state = optimizer.state.get(param, {})
    rows = not isinstance(optimizer, torch.optim.SparseAdam) or param.grad is None
    if not rows:  # SparseAdam steps only the rows its gradient stores
        grad = param.grad
        rows = grad is not None and (grad.layout == torch.strided or grad._nnz() > 0)
    for key in MOMENTUM_STATE:
        value = state.get(key)
        if rows and isinstance(value, torch.Tensor) and _nonzero(value):
            reasons.append(f"optimizer state {key!r} is non-zero and keeps moving it")
    if steps_without_grad(optimizer):
        reasons.extend(_search_history(optimizer, group, param))
    return tuple(reasons)


def unwrap_optimizer(optimizer: object, caller: str) -> torch.optim.Optimizer:
    """``optimizer`` itself, or the optimizer a wrapper holds in ``.optimizer`` (Lightning's
    ``LightningOptimizer``, Fabric's ``_FabricOptimizer``, accelerate's ``AcceleratedOptimizer``).

    Raises:
        IsolationTypeError: neither is a ``torch.optim.Optimizer``.
    """
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):  # accelerate's wrapper is an Optimizer too
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise IsolationTypeError(
            f"{caller}: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; pass the torch optimizer itself, or a wrapper that "
            f"holds it in .optimizer"
        )
    return optimizer


@dataclass(frozen=True)
class Exposure:
    """A frozen parameter that an optimizer still holds.

    Attributes:
        name: its qualified name in the model, or ``"param_groups[g][i]"`` without a model.
        group: the index of the optimizer's param group that holds it.
        index: its position in that group's ``"params"``.
        grad: ``"none"``, ``"zero"`` or ``"nonzero"``: what its ``.grad`` holds now.
        reasons: why a zero ``.grad`` would still move it (weight decay, momentum or Adam
            state, an LBFGS search direction); empty when a zero grad would leave it alone.
        steps_without_grad: whether the optimizer steps it even while its ``.grad`` is
            ``None`` (LBFGS).
    """

    name: str
    group: int
    index: int
    grad: Literal["none", "zero", "nonzero"]
    reasons: tuple[str, ...]
    steps_without_grad: bool = False

    @property
    def at_risk(self) -> bool:
        """Whether a zero ``.grad`` would move it on ``step()``."""
        return bool(self.reasons)

    @property
    def moves_on_step(self) -> bool:
        """Whether the next ``step()`` moves it, given its ``.grad`` now (for LBFGS, whose
        step depends on the gradient it computes: whether its history holds it)."""
        stepped = self.grad == "zero" or self.steps_without_grad
        return self.grad == "nonzero" or (stepped and self.at_risk)

    def __str__(self) -> str:
        why = "; ".join(self.reasons) if self.reasons else "harmless while .grad is None or zero"
        return f"{self.name} (param group {self.group}, .grad {self.grad}): {why}"


def optimizer_exposure(
    optimizer: torch.optim.Optimizer, model: nn.Module | None = None
) -> tuple[Exposure, ...]:
    """The parameters with ``requires_grad=False`` that ``optimizer`` still holds, and why.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or a wrapper with an ``.optimizer``
            attribute (Lightning's ``LightningOptimizer``).
        model: the model, to name parameters by their qualified names.

    Returns:
        One :class:`Exposure` per frozen parameter held, in param-group order. Filter on
        ``.at_risk`` (a zero grad would move it) or ``.moves_on_step`` (the next step will).

    Raises:
        IsolationTypeError: ``optimizer`` is not an optimizer, or ``model`` not a module.

    Note:
        Every built-in optimizer but LBFGS skips a parameter whose ``.grad`` is ``None``; the
        danger is a zero-filled ``.grad`` (``zero_grad(set_to_none=False)``, or a grad left
        from before the freeze), which weight decay, a momentum buffer or Adam's first moment
        turn into a real step. LBFGS moves every parameter it holds along its search
        direction, which keeps entries for a parameter frozen after it stepped: take frozen
        parameters out of it (or build it anew). The tests check the prediction against a
        real step for every optimizer in ``torch.optim``, sparse and fused variants included.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    >>> _ = model[0].requires_grad_(False)
    >>> for exposure in optimizer_exposure(opt, model):
    ...     print(exposure)
    0.weight (param group 0, .grad none): weight_decay=0.0001 shrinks it on every step
    0.bias (param group 0, .grad none): weight_decay=0.0001 shrinks it on every step
    """
    caller = "optimizer_exposure()"
    optimizer = unwrap_optimizer(optimizer, caller)
    names: dict[int, str] = {}
    if model is not None:
        if not isinstance(model, nn.Module):
            raise IsolationTypeError(
                f"{caller}: model must be a torch.nn.Module, got {type(model).__name__}"
            )
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
    found: list[Exposure] = []
    blind = steps_without_grad(optimizer)
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.requires_grad:
                continue
            reasons = zero_grad_risks(optimizer, group, p)
            if p.grad is None:
                grad: Literal["none", "zero", "nonzero"] = "none"
            else:
                grad = "nonzero" if _nonzero(p.grad) else "zero"
            name = names.get(id(p), f"param_groups[{g}][{i}]")
            found.append(Exposure(name, g, i, grad, reasons, blind))
    return tuple(found)
