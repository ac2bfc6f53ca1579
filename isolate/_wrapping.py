"""What every module wrapper of ``isolate`` shares: ``.module``, transparent state_dict keys,
one live wrapper of a kind per module, and ``unwrap()``."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from isolate._selectors import check_module
from isolate.errors import WrappingError

__all__ = ["Wrapper"]

_wrapped: weakref.WeakKeyDictionary[nn.Module, list[weakref.ref[Wrapper]]] = (
    weakref.WeakKeyDictionary()
)


class Wrapper(nn.Module):
    """Base class of the module wrappers. The wrapped module is ``.module``.

    ``state_dict()`` keys are the wrapped module's own (the ``module.`` infix is removed on
    save and added back on load), so a checkpoint written with the wrapper loads without it
    and the other way round. ``named_parameters()`` names keep the infix.
    """

    module: nn.Module

    def __init__(self, module: nn.Module) -> None:
        caller = f"{type(self).__name__}()"
        check_module(module, caller, "the wrapped object")
        if isinstance(module, Wrapper):
            raise WrappingError(
                f"{caller}: the module is already wrapped in {type(module).__name__}; "
                f"wrap the inner module once (use .unwrap() to take a wrapper off)"
            )
        live = [w() for w in _wrapped.get(module, [])]
        if any(type(w) is type(self) for w in live if w is not None):
            raise WrappingError(
                f"{caller}: this {type(module).__name__} is already wrapped in a live "
                f"{type(self).__name__}; reuse that wrapper, or call .unwrap() on it first"
            )
        super().__init__()
        self.module = module
        _wrapped.setdefault(module, []).append(weakref.ref(self))
        self._register_state_dict_hook(_strip_module_infix)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_add_module_infix)  # type: ignore[no-untyped-call]

    def unwrap(self) -> nn.Module:
        """Undo what the wrapper did to the module and return it."""
        refs = _wrapped.get(self.module, [])
        refs[:] = [r for r in refs if r() is not None and r() is not self]
        return self.module


def _strip_module_infix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    # The wrapper's own entries are the last ones added, so pop-and-reinsert keeps order.
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_module_infix(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + "module." + key[len(prefix) :]] = state_dict.pop(key)
