"""Cutting gradient: ``stop_gradient`` / ``Detached``, and scaling it: ``scale_gradient`` /
``GradientScale``."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn

from isolate._tree import check_structure, map_tensors
from isolate._wrapping import Wrapper
from isolate.errors import InplaceModificationError, IsolationTypeError

__all__ = ["Detached", "GradientScale", "gradient_scale_of", "scale_gradient", "stop_gradient"]

InplacePolicy = Literal["error", "copy"]


def stop_gradient(x: Any) -> Any:
    """Return ``x`` with every tensor detached from the graph, in the same structure.

    Works on tensors and on tuples, lists, dicts, dataclasses and registered pytree nodes
    nesting them; values that hold no tensor (numbers, strings, ``None``) are returned
    unchanged.

    Args:
        x: a tensor or a nested container of tensors.

    Returns:
        The same structure, each tensor replaced by ``tensor.detach()``.

    Raises:
        IsolationTypeError: ``x`` is neither a tensor nor a container, or holds an object
            that keeps tensors where they cannot be reached (a plain class such as a
            PyG-style batch, a set, a generator): register the class with
            ``torch.utils._pytree.register_pytree_node``.

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
    caller = "stop_gradient()"
    check_structure(x, caller)
    return map_tensors(torch.Tensor.detach, x, caller)


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
        IsolationTypeError: (from ``forward``) an input holds tensors where they cannot be
            reached to detach them: an object of an unregistered class (a PyG-style batch),
            a set, a generator. Register the class with
            ``torch.utils._pytree.register_pytree_node``, or pass its tensors in a tuple,
            list, dict or dataclass.

    Note:
        Detached inputs share storage with the main network's tensors. A branch that edits
        them in place corrupts the main features: backward then fails with "modified by an
        inplace operation" or, when the backward of the main op does not need the edited
        value, training silently continues on corrupted features. Under
        ``torch.inference_mode()`` tensors have no version counter, and inside a
        ``torch.compile`` region version counters cannot be compared, so with
        ``inplace="error"`` those inputs are copied instead of checked.

        Edits through ``x.data`` (``x.data.mul_(2)``) or through a NumPy array sharing the
        memory (``x.numpy()``) do not bump the version counter, so the guard does not see
        them; a branch that writes that way needs ``inplace="copy"``.

        A copy of the wrapper (``copy.deepcopy``, pickling, EMA/SWA averaging) is a wrapper
        of its own over the copied branch.

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

    def _rewrap(self, old: nn.Module, new: nn.Module) -> None:
        # A name left to its default is the branch's type name: it follows the new branch.
        if self.name == type(old).__name__:
            self.name = type(new).__name__
        super()._rewrap(old, new)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        caller = f"Detached({self.name})"
        if self.inplace == "copy" or torch.compiler.is_compiling():
            # Version counters are data-dependent in a compiled graph and cannot be compared
            # there, so compiled code gets copies (which the compiler drops when the branch
            # does not edit them).
            args, kwargs = map_tensors(_copy, (args, kwargs), caller)
            return self.module(*args, **kwargs)
        watched: list[torch.Tensor] = []

        def detach(t: torch.Tensor) -> torch.Tensor:
            # Inference tensors carry no version counter, so the guard cannot see edits of
            # them: the branch gets a copy instead.
            if t.is_inference():
                return t.detach().clone()
            detached = t.detach()
            watched.append(detached)
            return detached

        # One pass detaches and collects: the per-call cost stays a few microseconds.
        if kwargs:
            args, kwargs = map_tensors(detach, (args, kwargs), caller)
        else:
            args = map_tensors(detach, args, caller)
        before = [t._version for t in watched]
        out = self._modules["module"](*args, **kwargs)  # type: ignore[misc]
        after = [t._version for t in watched]
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


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _alias(x: torch.Tensor) -> torch.Tensor:
    # A new tensor object over the same memory, not a view: autograd refuses in-place ops on
    # a view made inside a custom Function ("Output 0 of _ScaleGradient is a view and is
    # being modified inplace"), while an alias behaves as nn.Identity's output does and
    # shares the version counter, so autograd still catches an edit of a value a backward
    # needs. A leaf that requires grad (a parameter) is copied instead, so that an in-place
    # op after the scale cannot write into the parameter.
    if x.is_leaf and x.requires_grad:
        return x.clone()
    return x.detach()


class _ScaleGradient(torch.autograd.Function):
    """Identity forward, ``alpha * grad`` backward (the fast form, outside ``torch.func``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return _alias(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _scaled(grad, ctx.alpha), None


class _ScaleGradientFunc(torch.autograd.Function):
    """The same under ``torch.func`` transforms (``vmap(grad(f))``), which need ``forward``
    without ``ctx`` plus ``setup_context``. That form binds its arguments with
    ``inspect.signature`` on every call (about 30 us), so it is used only there."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, alpha: float) -> torch.Tensor:
        return _alias(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.alpha = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _scaled(grad, ctx.alpha), None


def gradient_scale_of(node: object) -> float | None:
    """The factor of the autograd node of a :func:`scale_gradient` (or
    :class:`GradientScale`), or ``None`` for any other node: how graph audits tell a gradient
    reversal from the operations around it.

    >>> x = torch.ones(2, requires_grad=True)
    >>> gradient_scale_of(scale_gradient(x * 2, -0.5).grad_fn), gradient_scale_of((x * 2).grad_fn)
    (-0.5, None)
    """
    forward = getattr(type(node), "_forward_cls", None)
    if forward in (_ScaleGradient, _ScaleGradientFunc):
        return float(node.alpha)  # type: ignore[attr-defined]
    return None


def _scaled(grad: torch.Tensor, alpha: float) -> torch.Tensor:
    # neg() for gradient reversal: a multiplication by a Python number costs a few us more
    return grad.neg() if alpha == -1.0 else grad * alpha


def _scale(t: torch.Tensor, alpha: float) -> torch.Tensor:
    if torch._C._are_functorch_transforms_active():
        return _ScaleGradientFunc.apply(t, alpha)  # type: ignore[no-any-return]
    return _ScaleGradient.apply(t, alpha)  # type: ignore[no-any-return]


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
        IsolationTypeError: ``x`` is not a tensor or container (or holds tensors that cannot
            be reached, see :func:`stop_gradient`), or ``alpha`` is not finite.

    Note:
        Like ``nn.Identity``, the output shares memory with ``x``: an in-place op after
        the scale (``nn.ReLU(inplace=True)``) also changes ``x``. With ``alpha=0`` the
        output is ``x.detach()``, a real cut that graph walks see. Works under
        ``torch.func`` transforms (``vmap(grad(f))`` for per-sample gradients).

    >>> a = torch.ones(2, requires_grad=True)
    >>> scale_gradient(a * 3, -0.5).sum().backward()
    >>> a.grad
    tensor([-1.5000, -1.5000])
    """
    caller = "scale_gradient()"
    check_structure(x, caller)
    return _apply_scale(x, _check_alpha(alpha, caller), caller)


def _apply_scale(x: Any, factor: float, caller: str) -> Any:
    if factor == 0.0:
        # A real cut, so that graph walks (reachable_parameters) see it too.
        return map_tensors(torch.Tensor.detach, x, caller)
    return map_tensors(lambda t: _scale(t, factor), x, caller)


class GradientScale(nn.Module):
    """Module twin of :func:`scale_gradient`. Assign ``.alpha`` to change it during training.

    ``alpha`` is checked when it is assigned (:class:`IsolationTypeError` unless a finite
    real number), not in ``forward``: under ``torch.compile(..., fullgraph=True)`` a new
    alpha recompiles the graph (or makes it take alpha as an input) and takes effect.

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
        # alpha was validated when it was set: checking it here again would put a
        # math.isfinite call on a symbolic float into every compiled forward.
        caller = "GradientScale()"
        check_structure(x, caller)
        return _apply_scale(x, self._alpha, caller)

    def extra_repr(self) -> str:
        return f"alpha={self._alpha}"
