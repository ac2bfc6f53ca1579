"""Cutting gradient: ``stop_gradient`` / ``Detached``, and scaling it: ``scale_gradient`` /
``GradientScale``."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn

from isolate._tree import is_container, iter_tensors, map_tensors
from isolate._wrapping import Wrapper
from isolate.errors import InplaceModificationError, IsolationTypeError

__all__ = ["Detached", "GradientScale", "scale_gradient", "stop_gradient"]

InplacePolicy = Literal["error", "copy"]


def _check_structure(x: object, caller: str) -> None:
    if not isinstance(x, torch.Tensor) and not is_container(x):
        raise IsolationTypeError(
            f"{caller}: expected a tensor or a tuple/list/dict/dataclass of tensors, "
            f"got {type(x).__name__}"
        )


def stop_gradient(x: Any) -> Any:
    """Return ``x`` with every tensor detached from the graph, in the same structure.

    Works on tensors and on tuples, lists, dicts and dataclasses nesting them; other
    leaves are returned unchanged.

    Args:
        x: a tensor or a nested container of tensors.

    Returns:
        The same structure, each tensor replaced by ``tensor.detach()``.

    Raises:
        IsolationTypeError: ``x`` is neither a tensor nor a container.

    Note:
        A detached tensor **shares storage** with the original: an in-place edit of it
        changes the main branch's values too. Feed branches that edit their input through
        :class:`Detached` (which catches the edit) or :class:`isolate.Cloned`. Setting
        ``requires_grad=True`` on a detached tensor does not reconnect it to the graph.

    >>> a = torch.ones(2, requires_grad=True)
    >>> out = stop_gradient({"feat": a * 2, "n": 3})
    >>> out["feat"].requires_grad, out["n"]
    (False, 3)
    """
    _check_structure(x, "stop_gradient()")
    return map_tensors(torch.Tensor.detach, x)


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    return [t._version for t in tensors]


class Detached(Wrapper):
    """Feed a branch detached inputs: it learns from its own loss, nothing upstream does.

    The branch's own parameters receive gradient as usual; no gradient from the branch
    reaches any tensor or parameter that produced its inputs.

    Args:
        branch: the module to feed.
        inplace: what to do about in-place edits of the inputs. ``"error"`` (default)
            detects an edit after the branch runs, by comparing version counters (integer
            comparisons, no copies), and raises :class:`InplaceModificationError`;
            ``"copy"`` feeds the branch private copies so its edits cannot reach the main
            network (one copy of each input per call).
        name: how error messages name the branch (default: its class name).

    Raises:
        InplaceModificationError: (from ``forward``) the branch edited an input in place.

    Note:
        Detached inputs share storage with the main network's tensors. A branch that edits
        them in place corrupts the main features: backward then fails with "modified by an
        inplace operation" or, when the backward of the main op does not need the edited
        value, training silently continues on corrupted features. Under
        ``torch.inference_mode()`` tensors have no version counter, and inside a
        ``torch.compile`` region version counters cannot be compared, so with
        ``inplace="error"`` those inputs are copied instead of checked.

    >>> trunk, probe = nn.Linear(4, 4), Detached(nn.Linear(4, 2))
    >>> features = trunk(torch.randn(3, 4))
    >>> probe(features).sum().backward()
    >>> trunk.weight.grad is None, probe.module.weight.grad is not None
    (True, True)
    """

    def __init__(
        self, branch: nn.Module, *, inplace: InplacePolicy = "error", name: str | None = None
    ) -> None:
        if inplace not in ("error", "copy"):
            raise IsolationTypeError(
                f"Detached(): inplace={inplace!r} is not a policy; expected 'error' or 'copy'"
            )
        super().__init__(branch)
        self.inplace: InplacePolicy = inplace
        self.name = name or type(branch).__name__

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.inplace == "copy" or torch.compiler.is_compiling():
            # Version counters are data-dependent in a compiled graph and cannot be compared
            # there, so compiled code gets copies (which the compiler drops when the branch
            # does not edit them).
            args, kwargs = _copies((args, kwargs))
            return self.module(*args, **kwargs)
        inputs = map_tensors(_detach_or_copy, (args, kwargs))
        watched = [t for t in iter_tensors(inputs) if not t.is_inference()]
        before = _versions(watched)
        out = self.module(*inputs[0], **inputs[1])
        after = _versions(watched)
        if before != after:
            self._raise_inplace(watched, before, after)
        return out

    def _raise_inplace(
        self, watched: list[torch.Tensor], before: list[int], after: list[int]
    ) -> None:
        edited = [
            f"input {i} (shape {list(t.shape)})"
            for i, (t, b, a) in enumerate(zip(watched, before, after, strict=True))
            if a != b
        ]
        raise InplaceModificationError(
            f"Detached({self.name}): the branch edited {', '.join(edited)} in place; a "
            f"detached tensor shares storage with the main network's tensor, so the main "
            f"network's features are now changed too (backward may fail, or silently train "
            f"on corrupted values). Fix: wrap the branch in isolate.Cloned(...) if gradient "
            f"should flow back, or use Detached(branch, inplace='copy'), or make the branch's "
            f"first op out-of-place"
        )

    def extra_repr(self) -> str:
        return f"inplace={self.inplace!r}"


def _detach_or_copy(t: torch.Tensor) -> torch.Tensor:
    # Inference tensors carry no version counter, so the guard cannot see edits: copy them.
    return t.detach().clone() if t.is_inference() else t.detach()


def _copies(inputs: Any) -> Any:
    return map_tensors(lambda t: t.detach().clone(), inputs)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.alpha, None


def _check_alpha(alpha: object, caller: str) -> float:
    if isinstance(alpha, torch.Tensor) and alpha.numel() == 1:
        alpha = alpha.item()
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise IsolationTypeError(
            f"{caller}: alpha must be a finite real number, got {alpha!r}; use 0 to stop the "
            f"gradient, -1 to reverse it"
        )
    return float(alpha)


def scale_gradient(x: Any, alpha: float) -> Any:
    """Identity going forward; multiplies the gradient by ``alpha`` going back.

    ``alpha=0`` stops the gradient (nothing upstream receives one), a negative value
    reverses it as in domain-adversarial training (gradient reversal). Works on nested
    containers like :func:`stop_gradient`.

    Args:
        x: a tensor or a nested container of tensors.
        alpha: the factor; a finite real number.

    Raises:
        IsolationTypeError: ``x`` is not a tensor or container, or ``alpha`` is not finite.

    >>> a = torch.ones(2, requires_grad=True)
    >>> scale_gradient(a * 3, -0.5).sum().backward()
    >>> a.grad
    tensor([-1.5000, -1.5000])
    """
    caller = "scale_gradient()"
    _check_structure(x, caller)
    factor = _check_alpha(alpha, caller)
    if factor == 0.0:
        # A real cut, so that graph walks (reachable_parameters) see it too.
        return map_tensors(torch.Tensor.detach, x)
    return map_tensors(lambda t: _ScaleGradient.apply(t, factor), x)


class GradientScale(nn.Module):
    """Module twin of :func:`scale_gradient`. Assign ``.alpha`` to change it during training.

    >>> reverse = GradientScale(-1.0)
    >>> reverse.alpha = -0.3
    >>> reverse
    GradientScale(alpha=-0.3)
    """

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha = _check_alpha(value, "GradientScale()")

    def forward(self, x: Any) -> Any:
        return scale_gradient(x, self._alpha)

    def extra_repr(self) -> str:
        return f"alpha={self._alpha}"
