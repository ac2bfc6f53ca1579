"""Feeding a branch private copies that stay in the graph: ``clone`` / ``Cloned``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from isolate._tree import check_structure, map_tensors
from isolate._wrapping import Wrapper

__all__ = ["Cloned", "clone"]


def clone(x: Any) -> Any:
    """Return ``x`` with every tensor cloned, in the same structure.

    A clone has its own memory, so in-place edits of it never touch the original, and it
    stays in the graph: gradient flows back through it and accumulates onto the source.

    Raises:
        IsolationTypeError: ``x`` is neither a tensor nor a container, or holds tensors that
            cannot be reached (see :func:`isolate.stop_gradient`).

    >>> a = torch.ones(2, requires_grad=True)
    >>> b = clone([a * 2])[0]
    >>> b.mul_(10).sum().backward()
    >>> a.grad
    tensor([20., 20.])
    """
    caller = "clone()"
    check_structure(x, caller)
    return map_tensors(torch.Tensor.clone, x, caller)


class Cloned(Wrapper):
    """Feed a branch copies of its inputs: gradient flows back, in-place edits stay inside.

    Use it for a branch that edits shared features in place and *should* send gradient
    upstream; for a branch that should not, use :class:`isolate.Detached`.

    Args:
        branch: the module to feed.

    >>> shared = torch.tensor([-1.0, 2.0], requires_grad=True) * 1
    >>> editor = Cloned(nn.ReLU(inplace=True))
    >>> editor(shared)
    tensor([0., 2.], grad_fn=<ReluBackward0>)
    >>> shared
    tensor([-1.,  2.], grad_fn=<MulBackward0>)
    """

    def __init__(self, branch: nn.Module) -> None:
        super().__init__(branch)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self._modules["module"]  # no __getattr__ on the way: called every step
        if kwargs:
            args, kwargs = map_tensors(torch.Tensor.clone, (args, kwargs), self._caller())
        else:
            args = map_tensors(torch.Tensor.clone, args, self._caller())
        return module(*args, **kwargs)  # type: ignore[misc]

    def _caller(self) -> str:
        return f"Cloned({type(self._modules['module']).__name__})"
