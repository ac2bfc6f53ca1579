"""The ``detach`` / ``clone`` branches of an applied spec: wrapped by name, recorded, undone.

Each branch's submodule is replaced on its parent by :class:`isolate.Detached` or
:class:`isolate.Cloned` (parameters keep their identity; ``state_dict`` keys do not change).
A ``Detached`` branch records the inputs it received that require grad, so a check can name
every parameter upstream of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from isolate._checkpointing import recomputing
from isolate._rerun_safety import recompute_safe
from isolate._tree import iter_tensors
from isolate._wrapping import Wrapper
from isolate.cloning import Cloned
from isolate.detaching import Detached
from isolate.spec.plan import Wrap

__all__ = ["RECORD_LIMIT", "Branches"]

RECORD_LIMIT = 64
"""Calls of one detach branch recorded between two resets (more is an error: a loop)."""


class Branches:
    """The wrappers put in place for a plan's branches, and what the branches received."""

    def __init__(self) -> None:
        self.recording = True
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self.overflow: set[str] = set()
        self._wraps: list[tuple[nn.Module, str, Wrapper]] = []
        self._hooks: list[RemovableHandle] = []

    def wrap(self, wraps: list[Wrap]) -> None:
        """Replace each branch by its wrapper; on an error the caller undoes with :meth:`unwrap`."""
        for w in wraps:
            wrapper: Wrapper = (
                Detached(w.child, name=w.name) if w.kind == "detach" else Cloned(w.child)
            )
            setattr(w.parent, w.leaf, wrapper)
            self._wraps.append((w.parent, w.leaf, wrapper))
            if isinstance(wrapper, Detached):
                hook = wrapper.register_forward_pre_hook(self._recorder(w.name), with_kwargs=True)
                self._hooks.append(hook)

    def _recorder(self, name: str) -> Any:
        @recompute_safe
        def record(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not self.recording or recomputing():  # not an audit's re-run of a segment
                return
            inputs = self.inputs.setdefault(name, [])
            if len(inputs) >= RECORD_LIMIT:
                self.overflow.add(name)
                return
            inputs.extend(t for t in iter_tensors((args, kwargs)) if t.requires_grad)

        return record

    def reset(self, *, record: bool) -> None:
        """Forget what was recorded; record from now on or not."""
        self.inputs.clear()
        self.overflow.clear()
        self.recording = record

    def unwrap(self) -> None:
        """Put every original submodule back and remove the hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for parent, leaf, wrapper in reversed(self._wraps):
            if parent._modules.get(leaf) is wrapper:
                setattr(parent, leaf, wrapper.unwrap())
            else:
                wrapper.unwrap()
        self._wraps.clear()
        self.inputs.clear()
