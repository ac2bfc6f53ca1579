"""What a PEFT model says of each of its parameters, read from PEFT's own structure.

PEFT keeps its intent in the modules it inserts, not in names: every tuner layer
(``BaseTunerLayer``: LoRA, IA3, TrainableTokens, ...) lists the attributes that hold its
adapters' tensors in ``adapter_layer_names``, each a ``ModuleDict`` or ``ParameterDict`` keyed
by adapter name, and says which adapters are active (``active_adapters``, unless
``disable_adapters``). A ``ModulesToSaveWrapper`` keeps one trainable copy per adapter in
``modules_to_save`` and the frozen ``original_module``; a ``TrainableTokensWrapper`` trains
only the rows ``token_indices`` lists, through a delta tensor, over the frozen embedding. An
adapter config's ``bias`` (``"all"``, ``"lora_only"``) makes biases trainable. Everything
else is the base, frozen. :func:`layout` reads all of it into one :class:`Part` per tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from isolate.errors import IsolationTypeError

__all__ = ["ROLES", "Layout", "Part", "layout"]

ROLES = ("adapter", "saved", "tokens", "bias", "original", "base")
"""What a tensor is to PEFT: an adapter's tensor (LoRA A/B, IA3 vectors, a prompt encoder), a
``modules_to_save`` copy, a TrainableTokens delta, a bias the config trains, the original a
``modules_to_save`` wrapper keeps, or the base model's."""

_TRAINED = ("adapter", "saved", "tokens", "bias")


@dataclass(frozen=True)
class Part:
    """What one parameter tensor is to PEFT.

    Attributes:
        role: one of :data:`ROLES`.
        adapter: the adapter it belongs to (``None`` for the base and the originals).
        active: whether that adapter is active where the tensor lives (the base: ``False``).
        module: the module PEFT inserted (tuner layer or wrapper) that holds it.
        rows: for ``tokens``, the embedding rows the delta trains.
        trains: whether PEFT means it to train: a tensor of an active adapter (but those an
            adapter variant declares frozen), or a bias the active config trains.
    """

    role: str
    adapter: str | None = None
    active: bool = False
    module: str = ""
    rows: tuple[int, ...] = ()
    trains: bool = False

    def describe(self) -> str:
        """``"LoRA of adapter 'default' (active)"``-like text for messages and reports."""
        if self.role in ("base", "original"):
            what = "base weight" if self.role == "base" else "original kept by modules_to_save"
            return what + (f" of {self.module}" if self.module else "")
        kind = {
            "adapter": "adapter tensor",
            "saved": "modules_to_save copy",
            "tokens": f"trainable tokens (rows {list(self.rows)})",
            "bias": "bias the adapter config trains",
        }[self.role]
        state = "active" if self.active else "not active"
        return f"{kind} of adapter {self.adapter!r} ({state})"


@dataclass(frozen=True)
class Layout:
    """Every parameter of a PEFT model, by name (``named_parameters()``: a tied tensor once, by
    its first name), with what PEFT says of it.

    Attributes:
        parts: name -> :class:`Part`, in model order.
        active: the model's active adapters.
        adapters: every adapter the model holds.
        params: name -> the parameter.
        aliases: name -> every name of that tensor (tied tensors have several).
    """

    parts: Mapping[str, Part]
    active: tuple[str, ...]
    adapters: tuple[str, ...]
    params: Mapping[str, nn.Parameter]
    aliases: Mapping[str, tuple[str, ...]]

    @property
    def trains(self) -> tuple[str, ...]:
        """The names PEFT means to train."""
        return tuple(n for n, p in self.parts.items() if p.trains)

    @property
    def frozen(self) -> tuple[str, ...]:
        """The names PEFT means to keep still: the base, the originals, inactive adapters."""
        return tuple(n for n, p in self.parts.items() if not p.trains)

    def role(self, role: str) -> tuple[str, ...]:
        return tuple(n for n, p in self.parts.items() if p.role == role)


def _peft_types() -> tuple[Any, Any, Any, Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    try:
        from peft.tuners.trainable_tokens import TrainableTokensLayer
    except ImportError:  # PEFT before TrainableTokens
        TrainableTokensLayer = None  # type: ignore[assignment,misc]
    return BaseTunerLayer, AuxiliaryTrainingWrapper, ModulesToSaveWrapper, TrainableTokensLayer


def _attr(module: nn.Module, dotted: str) -> Any:
    for part in dotted.split("."):
        module = getattr(module, part, None)  # type: ignore[assignment]
        if module is None:
            return None
    return module


def _by_adapter(container: Any) -> dict[str, list[nn.Parameter]]:
    """Adapter name -> its tensors, from a ``ModuleDict`` / ``ParameterDict`` keyed by it."""
    if isinstance(container, nn.ModuleDict):
        return {k: list(m.parameters()) for k, m in container.items()}
    if isinstance(container, nn.ParameterDict):
        return {k: [p] for k, p in container.items()}
    return {}


def _active(module: nn.Module) -> set[str]:
    if getattr(module, "disable_adapters", False):
        return set()
    active = getattr(module, "active_adapters", ())
    return {active} if isinstance(active, str) else set(active)


def layout(model: nn.Module, *, caller: str = "layout()") -> Layout:
    """What PEFT says of every parameter of ``model``, a ``PeftModel`` (or a tuner model):
    its adapters' tensors, ``modules_to_save`` copies and originals, trainable token rows,
    trained biases, and the base. Reads flags nowhere: only the structure PEFT built.

    Raises:
        IsolationTypeError: ``model`` holds no PEFT tuner layer or wrapper.

    >>> import torch
    >>> from torch import nn
    >>> from peft import LoraConfig, get_peft_model
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"], modules_to_save=["2"]))
    >>> parts = layout(model).parts
    >>> parts["base_model.model.0.lora_A.default.weight"].describe()
    "adapter tensor of adapter 'default' (active)"
    >>> [parts[f"base_model.model.2.{k}.weight"].role for k in ("original_module", "modules_to_save.default")]
    ['original', 'saved']
    >>> parts["base_model.model.0.base_layer.weight"].role
    'base'
    """  # noqa: E501
    tuner, wrapper, saved_type, tokens_type = _peft_types()
    named = dict(model.named_parameters())
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    first = {id(p): n for n, p in named.items()}
    parts: dict[int, Part] = {}
    adapters: set[str] = set()
    layers_active: set[str] = set()
    for mname, module in model.named_modules():
        if not isinstance(module, (tuner, wrapper)):
            continue
        active = _active(module)
        layers_active |= active
        frozen_by_variant = getattr(module, "frozen_peft_weight_names", None) or {}
        role = "saved" if saved_type is not None and isinstance(module, saved_type) else "adapter"
        is_tokens = (tokens_type is not None and isinstance(module, tokens_type)) or hasattr(
            module, "token_adapter"
        )
        for layer_name in module.adapter_layer_names:
            for adapter, tensors in _by_adapter(_attr(module, layer_name)).items():
                adapters.add(adapter)
                rows: tuple[int, ...] = ()
                kind = role
                if is_tokens:
                    kind = "tokens"
                    source = getattr(module, "token_adapter", module)
                    rows = tuple(int(i) for i in source.token_indices.get(adapter, ()))
                variant_frozen = layer_name in frozen_by_variant.get(adapter, ())
                for p in tensors:
                    on = adapter in active
                    parts.setdefault(
                        id(p), Part(kind, adapter, on, mname, rows, on and not variant_frozen)
                    )
        if role == "saved":
            original = getattr(module, "original_module", None)
            for p in original.parameters() if original is not None else ():
                parts.setdefault(id(p), Part("original", module=mname))
    active_model = _model_active(model, layers_active)
    _prompt_encoders(model, parts, active_model, adapters)
    if not parts:
        raise IsolationTypeError(
            f"{caller}: {type(model).__name__} holds no PEFT tuner layer or modules_to_save "
            f"wrapper; wrap it first: peft.get_peft_model(model, config)"
        )
    _biases(model, tuner, parts, active_model)
    out = {
        name: parts.get(id(p), Part("base", module=name.rpartition(".")[0]))
        for name, p in named.items()
    }
    return Layout(
        parts=out,
        active=tuple(sorted(active_model)),
        adapters=tuple(sorted(adapters)),
        params=named,
        aliases={first[i]: tuple(names) for i, names in aliases.items() if i in first},
    )


def _model_active(model: nn.Module, layers_active: set[str]) -> set[str]:
    """The model's ``active_adapters``; where it has none (LoRA put in by
    ``peft.inject_adapter_in_model``, or a transformers model's method of that name), the
    adapters active in its layers."""
    active = getattr(model, "active_adapters", None)
    if callable(active):  # a transformers model's method, not PEFT's property
        active = None
    if active is None:
        return layers_active
    return {active} if isinstance(active, str) else set(active)


def _prompt_encoders(
    model: nn.Module, parts: dict[int, Part], active: set[str], adapters: set[str]
) -> None:
    """Prompt learning (prefix, prompt, p-tuning): the encoders in ``model.prompt_encoder``."""
    encoders = getattr(model, "prompt_encoder", None)
    for adapter, tensors in _by_adapter(encoders).items():
        adapters.add(adapter)
        for p in tensors:
            on = adapter in active
            parts.setdefault(
                id(p), Part("adapter", adapter, on, f"prompt_encoder.{adapter}", (), on)
            )


def _biases(model: nn.Module, tuner: Any, parts: dict[int, Part], active: set[str]) -> None:
    """A config's ``bias="all"`` trains every bias, ``"<method>_only"`` the biases of the
    layers it adapts (PEFT's ``_mark_only_adapters_as_trainable``)."""
    configs = getattr(model, "peft_config", None) or {}
    for adapter in sorted(active):
        bias = str(getattr(configs.get(adapter), "bias", "none"))
        if bias == "all":
            found = [
                (n.rpartition(".")[0], p)
                for n, p in model.named_parameters()
                if n == "bias" or n.endswith(".bias")
            ]
        elif bias.endswith("_only"):
            found = [
                (n, m.bias)
                for n, m in model.named_modules()
                if isinstance(m, tuner) and isinstance(getattr(m, "bias", None), nn.Parameter)
            ]
        else:
            continue
        for module, p in found:
            if id(p) not in parts:
                parts[id(p)] = Part("bias", adapter, True, module, (), True)
