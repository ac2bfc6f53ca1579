"""Feeding a branch private copies that stay in the graph: ``clone`` / ``Cloned``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from isolate._tree import is_container, map_tensors
from isolate._wrapping import Wrapper
from isolate.errors import IsolationTypeError

__all__ = ["Cloned", "clone"]


def clone(x: Any) -> Any:
    """Return ``x`` with every tensor cloned, in the same structure.

    A clone has its own memory, so in-place edits of it never touch the original, and it
    stays in the graph: gradient flows back through it and accumulates onto the source.

    Raises:
        IsolationTypeError: ``x`` is neither a tensor nor a container.

    >>> a = torch.ones(2, requires_grad=True)
    >>> b = clone([a * 2])[0]
    >>> b.mul_(10).sum().backward()
    >>> a.grad
    tensor([20., 20.])
    """
    if not isinstance(x, torch.Tensor) and not is_container(x):
        raise IsolationTypeError(
            f"clone(): expected a tensor or a tuple/list/dict/dataclass of tensors, "
            f"got {type(x).__name__}"
        )
    return map_tensors(torch.Tensor.clone, x)


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
        args, kwargs = clone((args, kwargs))
        return self.module(*args, **kwargs)
