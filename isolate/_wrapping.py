"""What every module wrapper of ``isolate`` shares: ``.module``, transparent state_dict keys,
one live wrapper of a kind per module, ``unwrap()``, and copies that are wrappers of their own."""

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
    and the other way round; the missing and unexpected keys ``load_state_dict`` reports are
    named the same way. ``named_parameters()`` names keep the infix.

    A copy of a wrapper (``copy.deepcopy``, pickling, ``torch.save``/``torch.load``, the
    copy that EMA and SWA averaging make) wraps the copied module and is registered as that
    module's live wrapper: it is independent of the original.

    ``wrapper.module = other`` wraps ``other`` in place of the old module, checked as a new
    wrap is (nothing changes if it is refused); the old module is released.
    """

    module: nn.Module
    isolate_passthrough = "module"  # the child state_dict keys leave out (_walker.PASSTHROUGH)

    def __init__(self, module: nn.Module) -> None:
        self._check_wrappable(module, f"{type(self).__name__}()")
        super().__init__()
        self.module = module
        self._claim(module)
        self._register_state_dict_hook(_strip_module_infix)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_add_module_infix)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_post_hook(_drop_module_infix)  # type: ignore[no-untyped-call]

    def _check_wrappable(self, obj: object, caller: str) -> None:
        module = check_module(obj, caller, "the wrapped object")
        if isinstance(module, Wrapper):
            raise WrappingError(
                f"{caller}: the module is already wrapped in {type(module).__name__}; "
                f"wrap the inner module once (use .unwrap() to take a wrapper off)"
            )
        live = [w() for w in _wrapped.get(module, [])]
        if any(type(w) is type(self) for w in live if w is not None and w is not self):
            raise WrappingError(
                f"{caller}: this {type(module).__name__} is already wrapped in a live "
                f"{type(self).__name__}; reuse that wrapper, or call .unwrap() on it first"
            )

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get("_modules", {}).get("module") if name == "module" else None
        if old is None or value is old:
            super().__setattr__(name, value)
            return
        # ``wrapper.module = other`` (by hand, or by model surgery that replaces children):
        # the wrapper now wraps ``other``, checked as a new wrap is, and lets go of ``old``.
        self._check_wrappable(value, f"{type(self).__name__}.module = ...")
        self._rewrap(old, value)

    def _rewrap(self, old: nn.Module, new: nn.Module) -> None:
        """Wrap ``new`` in place of ``old`` (both checked); subclasses undo and redo their
        own hold on the module around this."""
        self._release(old)
        super().__setattr__("module", new)
        self._claim(new)

    def _claim(self, module: nn.Module) -> None:
        """Register this wrapper as one of ``module``'s live wrappers."""
        _wrapped.setdefault(module, []).append(weakref.ref(self))

    def _release(self, module: nn.Module) -> None:
        """Take this wrapper (and any dead one) off ``module``'s live wrappers."""
        refs = _wrapped.get(module, [])
        refs[:] = [r for r in refs if r() is not None and r() is not self]

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Called for copy.deepcopy and for unpickling alike: the copy wraps the copied module,
        # so it registers as that module's live wrapper (the original stays the original's).
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        module = self._modules.get("module")
        if module is not None:
            self._claim(module)
        if _drop_module_infix not in self._load_state_dict_post_hooks.values():
            self.register_load_state_dict_post_hook(_drop_module_infix)  # type: ignore[no-untyped-call]

    def __getattr__(self, name: str) -> Any:
        # torch.distributed.checkpoint (Lightning's ModelParallelStrategy, FSDP2) finds each
        # state_dict key's tensor by walking attributes, and the keys have no ``module.``
        # infix: let the wrapped module's children, parameters and buffers be reached
        # through the wrapper too. Only called when the normal lookup fails.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is not None and (
                name in inner._modules or name in inner._parameters or name in inner._buffers
            ):
                return getattr(inner, name)
            raise

    def unwrap(self) -> nn.Module:
        """Undo what the wrapper did to the module and return it."""
        self._release(self.module)
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
    # Read back by _drop_module_infix once the wrapped module has loaded.
    module.__dict__["_isolate_loading"] = (prefix, error_msgs, len(error_msgs))


def _drop_module_infix(module: nn.Module, incompatible: Any) -> None:
    """Name missing and unexpected keys (and size mismatches) as ``state_dict()`` names
    them, without the ``module.`` infix that ``_add_module_infix`` put in to load them."""
    loading = module.__dict__.pop("_isolate_loading", None)
    if loading is None:
        return
    prefix, error_msgs, start = loading
    inner = prefix + "module."
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [prefix + k[len(inner) :] if k.startswith(inner) else k for k in keys]
    for i in range(start, len(error_msgs)):
        error_msgs[i] = (
            error_msgs[i]
            .replace(f"for {inner}", f"for {prefix}")
            .replace(f'named "{inner}', f'named "{prefix}')
        )
