"""One walk of a model, for every part of isolate that names its tensors.

:class:`Tree` lists every module, parameter and buffer under every name it has, in the order
of ``named_parameters(remove_duplicate=False)``. One rule names them everywhere: a parameter's
name is the one ``named_parameters()`` gives (selectors match these), and its *key* is the one
``state_dict()`` gives: a wrapper that declares :data:`PASSTHROUGH` (isolate's ``Detached`` and
``Cloned``) adds nothing to its child's keys. :class:`Names` is the map by key, first alias
first, with FSDP2 temporaries replaced by the sharded parameters they stand for; drift checks,
plans, saved state and rank checks all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from isolate._sharding import sharded_view

__all__ = ["PASSTHROUGH", "Names", "Tree"]

PASSTHROUGH = "isolate_passthrough"
"""A class attribute naming the child a wrapper module leaves out of ``state_dict`` keys."""


@dataclass
class Tree:
    """Every module, parameter and buffer of a model, under every name it has."""

    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)
    buffer_names: list[str] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module, *, keys: bool = False) -> Tree:
        """Walk ``model``: by ``named_parameters()`` names, or with ``keys=True`` by
        ``state_dict()`` keys.

        A direct walk over ``_parameters`` / ``_modules``, several times faster than
        ``named_parameters()``, whose generator machinery dominates on large models.
        """
        tree = cls()
        stack: list[tuple[str, nn.Module]] = [("", model)]
        while stack:
            prefix, module = stack.pop()
            tree.modules.append((prefix, module))
            base = prefix + "." if prefix else ""
            for name, p in module._parameters.items():
                if p is not None:
                    tree.names.append(base + name)
                    tree.params.append(p)
            for name, b in module._buffers.items():
                if b is not None:
                    tree.buffer_names.append(base + name)
                    tree.buffers.append(b)
            passthrough = getattr(type(module), PASSTHROUGH, None) if keys else None
            stack.extend(
                (prefix if name == passthrough else base + name, child)
                for name, child in reversed(module._modules.items())
                if child is not None
            )
        tree.ids = list(map(id, tree.params))
        return tree


@dataclass
class Names:
    """Every parameter and buffer of a model by its ``state_dict`` key (first alias wins);
    FSDP2 parameters as the sharded parameters, not their unsharded temporaries."""

    params: dict[str, nn.Parameter] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    of_id: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module, *, aliases: bool = False) -> Names:
        """The names of ``model``; with ``aliases=True`` every name of a tied tensor is kept
        (``params`` / ``buffers`` then map each alias), ``of_id`` still the first."""
        names = cls()
        view = sharded_view([model], "isolate")
        tree = Tree.of(model, keys=True)
        for name, p in zip(tree.names, tree.params, strict=True):
            p = view.canonical(p)
            if aliases or id(p) not in names.of_id:
                names.params[name] = p
            names.of_id.setdefault(id(p), name)
        for name, b in zip(tree.buffer_names, tree.buffers, strict=True):
            if aliases or id(b) not in names.of_id:
                names.buffers[name] = b
            names.of_id.setdefault(id(b), name)
        names.of_id.update(view.aliases(names.of_id))
        return names

    def name(self, tensor: torch.Tensor) -> str:
        """The key of ``tensor``, or a description of it when the model does not hold it."""
        return self.of_id.get(id(tensor), f"<tensor of shape {tuple(tensor.shape)}>")
