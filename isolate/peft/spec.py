"""An isolation spec derived from a PEFT model, and the faults that make one impossible.

:func:`spec_for` reads the model's :func:`~isolate.peft.layout.layout` and says it as an
:class:`~isolate.IsolationSpec`: freeze every tensor PEFT keeps still (the base, the originals
``modules_to_save`` keeps, inactive adapters), and a ``trains`` contract over the tensors of
the active adapter(s) (each must be reached by the loss and move). Before that,
:func:`check_flags` refuses a model whose flags contradict its adapters, naming the tensors
and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch import nn

from isolate.errors import AdapterStateError, SpecError
from isolate.freezing import reads_training
from isolate.peft.layout import Layout, layout
from isolate.spec.isolation import IsolationSpec

__all__ = ["check_flags", "spec_for"]

_CALLER = "spec_for()"


def _listed(names: Sequence[str], limit: int = 6) -> str:
    shown = list(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{shown}{more}"


def check_flags(model: nn.Module, *, caller: str = "check_flags()") -> Layout:
    """Refuse a PEFT model whose ``requires_grad`` flags contradict its adapters; return its
    :class:`~isolate.peft.layout.Layout` when they agree.

    Raises:
        AdapterStateError: naming the tensors and the fix: a base tensor (or an original
            kept by ``modules_to_save``) requires grad; an adapter that is not active
            requires grad; an active adapter's tensor does not; or an output head tied to the
            input embedding trains through ``modules_to_save`` apart from it.
        IsolationTypeError: ``model`` is not a PEFT model.

    >>> import torch
    >>> from torch import nn
    >>> from peft import LoraConfig, get_peft_model
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"], modules_to_save=["2"]))
    >>> _ = model.base_model.model[0].base_layer.bias.requires_grad_(True)
    >>> check_flags(model)
    Traceback (most recent call last):
    ...
    isolate.errors.AdapterStateError: check_flags(): 1 base tensors require grad: ...
    """
    found = layout(model, caller=caller)
    problems = [
        *_trainable_base(found),
        *_inactive(found),
        *_cannot_train(found),
        *_untied_heads(model, found),
    ]
    if problems:
        raise AdapterStateError(f"{caller}: " + "\n".join(problems))
    return found


def _trainable_base(found: Layout) -> list[str]:
    base = [n for n in found.frozen if found.parts[n].role in ("base", "original")]
    hot = [n for n in base if found.params[n].requires_grad]
    if not hot:
        return []
    embedding = [n for n in hot if "embed" in n]
    rows = (
        " To train some rows of an embedding, give PEFT trainable_token_indices (a weight "
        "decay cannot move the other rows then; a gradient mask does not stop it)."
        if embedding
        else ""
    )
    return [
        f"{len(hot)} base tensors require grad: {_listed(hot)}; PEFT froze the base when it "
        f"wrapped the model, so something made them trainable after (code, a load, a "
        f"re-registered nn.Parameter). Fix: p.requires_grad_(False) for each, or name their "
        f"modules in the adapter config's modules_to_save, so that PEFT trains a copy and "
        f"keeps the original.{rows}"
    ]


def _inactive(found: Layout) -> list[str]:
    out = []
    by_adapter: dict[str, list[str]] = {}
    for name, part in found.parts.items():
        if part.adapter is not None and not part.active and found.params[name].requires_grad:
            by_adapter.setdefault(part.adapter, []).append(name)
    for adapter, names in sorted(by_adapter.items()):
        out.append(
            f"adapter {adapter!r} is not active (active: {list(found.active)}) but "
            f"{len(names)} of its tensors require grad: {_listed(names)}; they would train "
            f"without ever shaping the output. Fix: model.set_adapter({found.active[0]!r}) "
            f"resets the flags to the active adapter (or set_adapter({adapter!r}) if it is the "
            f"one to train); load other adapters with is_trainable=False"
            if found.active
            else f"adapter {adapter!r} is not active, and none is, but {len(names)} of its "
            f"tensors require grad: {_listed(names)}. Fix: model.set_adapter({adapter!r})"
        )
    return out


def _cannot_train(found: Layout) -> list[str]:
    cold = [n for n in found.trains if not found.params[n].requires_grad]
    if not cold:
        return []
    return [
        f"{len(cold)} tensors of the active adapter(s) {list(found.active)} do not require "
        f"grad: {_listed(cold)}; they cannot train. Fix: load the adapter with "
        f"PeftModel.from_pretrained(..., is_trainable=True) (inference_mode=False), or call "
        f"model.set_adapter(...) without inference_mode"
    ]


def _untied_heads(model: nn.Module, found: Layout) -> list[str]:
    """A ``modules_to_save`` copy whose original shares a tensor with another module (an
    output head tied to the input embedding) trains apart from that module, unless the copy
    is tied to it as well (PEFT's ``ensure_weight_tying=True``)."""
    out = []
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for name, part in found.parts.items():
        if part.role != "saved" or not part.trains:
            continue
        wrapper = part.module + "."
        local = name[len(wrapper) :].split(".", 2)[-1]  # past "modules_to_save.<adapter>."
        original = f"{wrapper}original_module.{local}"
        tied = [n for n in names_of.get(id(_get(model, original)), []) if not n.startswith(wrapper)]
        shared = [n for n in names_of[id(found.params[name])] if not n.startswith(wrapper)]
        if tied and not shared:
            out.append(
                f"{part.module} is trained through modules_to_save, but its original weight "
                f"is tied to {tied[0]!r}: the trained copy {name!r} unties them, so the output "
                f"head and the embedding part ways (and a merge or an export keeps only one). "
                f"Fix: LoraConfig(..., ensure_weight_tying=True) with the embedding in "
                f"modules_to_save too, so that both train as one tensor; or untie them "
                f"(tie_word_embeddings=False) before wrapping; or train rows with "
                f"trainable_token_indices"
            )
    return out


def _get(model: nn.Module, name: str) -> Any:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def spec_for(
    model: nn.Module,
    *,
    within: int = 2,
    mixed: Literal["error", "follow"] = "error",
    **keys: Any,
) -> IsolationSpec:
    """The :class:`~isolate.IsolationSpec` a PEFT model declares, with no selectors to write.

    Freezes every tensor PEFT keeps still: the base model, the originals ``modules_to_save``
    keeps, the adapters that are not active (and adapter tensors a variant declares frozen).
    Adds a ``trains`` contract (named ``"peft:<adapters>"``) over the tensors of the active
    adapter(s): LoRA A/B and the other tuner tensors, ``modules_to_save`` copies, trainable
    token deltas, biases the config trains. Applied (``spec.apply(model, optimizer)``) and
    checked on a schedule (``handle.check_every(n)``, or the Lightning callback), the handle
    proves while training that the base gets no gradient and does not move, that the
    originals stay still, and that every active adapter tensor is reached and moves.

    Args:
        model: a ``PeftModel`` (or a tuner model such as ``LoraModel``), flags as PEFT set
            them; for a model that holds it as a submodule, derive from the PEFT model and
            use ``spec.prefixed("name")``.
        within: the ``trains`` contract's window: each active adapter tensor must change
            within that many optimizer steps (2: a LoRA A whose B starts at zero gets its
            first gradient on the second step).
        mixed: with ``mode="eval"``, what to do with a *mixed* module: one whose own forward
            reads ``.training`` and that holds both frozen tensors and tensors the adapter
            trains (``LlamaAttention``, whose attention dropout reads its flag, with LoRA on
            ``q_proj``). ``"error"`` refuses it; ``"follow"`` lets it follow the model's mode
            (right when its mode changes nothing, as with ``attention_dropout=0.0``).
        keys: other keys of :class:`~isolate.IsolationSpec` (``thaw``, ``protect``,
            ``mode``, ...); ``freeze`` and ``contracts`` are added to the derived ones.

    Returns:
        The spec; ``spec.freeze`` lists the frozen tensors by name.

    Raises:
        AdapterStateError: the flags contradict the adapters (see :func:`check_flags`).
        IsolationTypeError: ``model`` is not a PEFT model.
        SpecError: a key is not one of the spec's, the active adapters train nothing, or
            ``mode="eval"`` cannot hold a mixed module (see ``mixed``), naming it.

    Note:
        A token row that no batch holds gets no gradient, and under Adam does not move: the
        ``trains`` contract names its delta. A tensor whose gradient is zero for ``within``
        steps is named the same way; raise ``within``, or leave it out with
        ``contracts=...`` of your own.

    Note:
        With ``mode=`` the spec also freezes, by name, each largest module all of whose
        tensors it freezes (a decoder layer's ``mlp``, a LoRA layer's ``base_layer``), so that
        its hold reaches the layers without tensors inside it: an ``nn.Dropout`` in an
        ``act_fn`` is held in eval mode through ``model.train()``. The adapter's own
        mode-dependent layers (LoRA's ``lora_dropout``, a ``ModuleDict`` by adapter; a
        ``modules_to_save`` copy) are not the base: they follow the model's mode, so the
        adapter trains with the dropout its config asks for. A module that holds both (a
        mixed module) cannot be held without holding, and freezing, the adapter inside it: a
        selector holds a module by naming it, and naming it selects every tensor it holds.

    >>> import torch
    >>> from torch import nn
    >>> from peft import LoraConfig, get_peft_model
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"], modules_to_save=["2"]))
    >>> spec = spec_for(model)
    >>> spec.freeze
    ('base_model.model.0.base_layer.weight', 'base_model.model.0.base_layer.bias', 'base_model.model.2.original_module.weight', 'base_model.model.2.original_module.bias')
    >>> spec.contracts[0].name, spec.contracts[0].select[0]
    ('peft:default', 'base_model.model.0.lora_A.default.weight')
    """  # noqa: E501
    found = check_flags(model, caller=_CALLER)
    trains = list(found.trains)
    if not trains:
        raise SpecError(
            f"{_CALLER}: the active adapters {list(found.active)} hold no tensor to train "
            f"(of the adapters {list(found.adapters)}); set one active: model.set_adapter(name)"
        )
    unknown = sorted(set(keys) - set(IsolationSpec.__dataclass_fields__))
    if unknown:
        raise SpecError(f"{_CALLER}: {unknown} are not keys of IsolationSpec")
    contract: Mapping[str, Any] = {
        "kind": "trains",
        "name": "peft:" + ",".join(found.active),
        "select": trains,
        "within": within,
    }
    if mixed not in ("error", "follow"):
        raise SpecError(f"{_CALLER}: mixed must be 'error' or 'follow', got {mixed!r}")
    whole = _whole_modules(model, found) if keys.get("mode") is not None else []
    if keys.get("mode") == "eval" and mixed == "error":
        _refuse_mixed(model, found, whole)
    freeze = [*found.frozen, *whole, *_as_list(keys.pop("freeze", ()))]
    contracts = [contract, *_as_list(keys.pop("contracts", ()))]
    return IsolationSpec(freeze=tuple(freeze), contracts=tuple(contracts), **keys)


def _whole_modules(model: nn.Module, found: Layout) -> list[str]:
    """The largest modules all of whose tensors PEFT keeps still, by name, in model order."""
    still = {id(found.params[n]) for n in found.frozen}
    out: list[str] = []
    taken: set[str] = set()
    for name, module in model.named_modules():
        if not name or _inside(name, taken):
            continue
        ids = {id(p) for p in module.parameters()}
        if ids and ids <= still:
            out.append(name)
            taken.add(name)
    return out


def _inside(name: str, names: set[str]) -> bool:
    """Whether ``name`` is one of ``names`` or lies below one."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in names for i in range(1, len(parts) + 1))


def _refuse_mixed(model: nn.Module, found: Layout, whole: list[str]) -> None:
    """Raise naming the mode-dependent modules ``mode="eval"`` cannot hold: neither inside a
    module the spec freezes whole, nor the adapter's own (inside a PEFT layer or wrapper)."""
    inserted = {p.module for p in found.parts.values() if p.role != "base" and p.module}
    held, trained = set(whole), {id(found.params[n]) for n in found.trains}
    unheld = []
    for name, module in model.named_modules():
        if not reads_training(module) or _inside(name, held):
            continue
        mine = {id(p) for p in module.parameters()}
        if _inside(name.rpartition(".")[0], inserted) or (mine and mine <= trained):
            continue  # the adapter's own: its lora_dropout, a modules_to_save copy
        unheld.append(f"{name} ({type(module).__name__})")
    if unheld:
        example = next(n for n in found.trains)
        raise SpecError(
            f"{_CALLER}: mode='eval' cannot hold {len(unheld)} mode-dependent modules in eval "
            f"mode: {_listed(unheld)}; each reads .training in its own forward, and a spec "
            f"holds a module in eval mode only by freezing it, or a module around it, whole, "
            f"but each of these holds, or lies only in modules that hold, tensors the adapter "
            f"trains (as {example!r}). Fix: if their mode changes nothing (a dropout of 0, as "
            f"attention_dropout=0.0), pass mixed='follow' to let them follow the model's mode; "
            f"else set that dropout to 0 first, or put the adapter on modules that hold no "
            f"mode-dependent layer"
        )


def _as_list(value: object) -> list[Any]:
    if isinstance(value, (str, Mapping)):
        return [value]
    return list(value)  # type: ignore[call-overload,no-any-return]
