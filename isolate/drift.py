"""Catching parameters and buffers that move when they should not.

:func:`snapshot` records a model's parameters and buffers (a copy, or only a
:func:`fingerprint` of each); the returned :class:`Snapshot` tells by name what changed since.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from isolate._delta import max_abs_diff, moved_elements
from isolate._sharding import canonical_parameters
from isolate._walker import Names
from isolate.errors import DriftError, IsolationTypeError, SelectorError
from isolate.fingerprints import Print, fingerprint, fingerprints, fingerprints_as, local_tensor

__all__ = [
    "Snapshot",
    "canonical_parameters",
    "fingerprint",
    "max_abs_diff",
    "snapshot",
]

ParameterFilter = Literal["all", "frozen", "trainable", "none"]
_FILTERS = ("all", "frozen", "trainable", "none")
Drift = Literal["copy", "fingerprint"]
_DRIFT = ("copy", "fingerprint")


def check_atol(atol: object, caller: str) -> None:
    """Refuse a tolerance that is not a finite number >= 0: a negative or NaN one fails
    everything, an infinite one passes everything (a tensor gone or reshaped reports inf)."""
    if not isinstance(atol, (int, float)) or not 0 <= atol < math.inf:
        raise IsolationTypeError(f"{caller}: atol must be a number >= 0, got {atol!r}")


@dataclass(frozen=True)
class _Entry:
    name: str
    kind: Literal["parameter", "buffer"]
    saved: torch.Tensor | None  # the copy, or None for a fingerprint
    print: Print | None  # the fingerprint and its scheme; None with a copy
    shape: tuple[int, ...]
    dtype: torch.dtype  # checked first: an fp32 weight cast to bf16 can keep every value
    # The object snapshotted, to notice when a name points elsewhere later: its id for
    # modules (a weak reference would make torch refuse to swap the tensor in
    # load_state_dict or module.to() under swap_module_params_on_conversion, and a strong
    # one would keep a replaced tensor alive), the tensor itself for mappings (it is what
    # gets checked).
    ident: int
    held: torch.Tensor | None

    def same_kind(self, now: torch.Tensor) -> bool:
        """Whether ``now`` has the recorded shape and dtype (else its values cannot compare)."""
        local = local_tensor(now)
        return tuple(local.shape) == self.shape and local.dtype == self.dtype


class Snapshot:
    """A record of named parameters and buffers, and the means to compare against it.

    Made by :func:`snapshot`. For a module, tensors are looked up again by name at every
    check, so a tensor replaced after the snapshot (a new ``Parameter``, a buffer that SWA or
    a checkpoint load assigns anew) is checked by its new value, and reported as replaced.

    Attributes:
        names: every name recorded, parameters first, in model order.
        drift: ``"copy"``: the snapshot holds copies (``changed()`` gives the size of a
            change); ``"fingerprint"``: only fingerprints (``changed()`` gives ``nan``:
            changed, size unknown).
    """

    def __init__(
        self,
        entries: list[_Entry],
        module: nn.Module | None,
        description: str,
        drift: Drift,
        device: torch.device | str | None = "cpu",
    ) -> None:
        self._entries = entries
        self._module = module
        self._description = description
        self._device = device
        self.drift = drift
        self.names: tuple[str, ...] = tuple(e.name for e in entries)

    def __repr__(self) -> str:
        kinds = [e.kind for e in self._entries]
        mode = "" if self.drift == "copy" else ", fingerprints"
        return (
            f"Snapshot({self._description}: {kinds.count('parameter')} parameters, "
            f"{kinds.count('buffer')} buffers{mode})"
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    @property
    def kinds(self) -> dict[str, Literal["parameter", "buffer"]]:
        """Name -> ``"parameter"`` or ``"buffer"``, for every name recorded."""
        return {e.name: e.kind for e in self._entries}

    def renewed(self) -> Snapshot:
        """A snapshot of the same names, kept the same way, from their values now.

        >>> model = nn.Linear(2, 1)
        >>> snap = snapshot(model, drift="fingerprint")
        >>> with torch.no_grad():
        ...     _ = model.bias.add_(1.0)
        >>> list(snap.changed()), snap.renewed().changed()
        (['bias'], {})
        """
        if self._module is not None:
            return snapshot(self._module, names=self.names, drift=self.drift, device=self._device)
        held = {e.name: e.held for e in self._entries if e.held is not None}
        return snapshot(held, drift=self.drift, device=self._device)

    def _current(self) -> dict[str, torch.Tensor]:
        if self._module is None:
            return {e.name: e.held for e in self._entries if e.held is not None}
        names = Names.of(self._module, aliases=True)  # FSDP2: the shards, not temporaries
        return {**names.params, **names.buffers}

    def _compare(self, atol: float, caller: str) -> list[tuple[_Entry, torch.Tensor | None, float]]:
        current = self._current()
        for entry in self._entries:
            now = current.get(entry.name)
            if now is not None and local_tensor(now).device.type == "meta":
                raise IsolationTypeError(
                    f"{caller}: {entry.name!r} is now a meta tensor, with no values to compare "
                    f"with the snapshot; check it before the model leaves its weights"
                )
        prints = fingerprints_as(  # tied tensors are read once
            (now, e.print)
            for e in self._entries
            if e.print is not None and (now := current.get(e.name)) is not None and e.same_kind(now)
        )
        out = []
        for entry in self._entries:
            now = current.get(entry.name)
            if now is None or not entry.same_kind(now):
                delta = math.inf
            elif entry.saved is not None:
                delta = max_abs_diff(entry.saved, now)
            else:
                delta = 0.0 if prints[id(now)] == entry.print else math.nan
            if not delta <= atol or id(now) != entry.ident:
                out.append((entry, now, delta))
        return out

    def changed(self, *, atol: float = 0.0) -> dict[str, float]:
        """Name -> max |Δ| of every tensor whose values moved by more than ``atol``.

        A tensor that is gone, or whose shape or dtype changed, reports ``inf``; NaN where
        there was a number (or the other way round) reports ``nan``. A fingerprint snapshot
        (``drift="fingerprint"``) knows that a tensor changed, not by how much: every changed
        tensor reports ``nan`` (test with ``math.isnan``; ``nan > 0`` is False), except
        ``inf`` for one that is gone or changed shape or dtype.

        Args:
            atol: the largest |Δ| per element that still counts as unchanged; only ``0``
                with a fingerprint snapshot.

        Raises:
            IsolationTypeError: ``atol`` is negative or infinite, or nonzero with a
                fingerprint snapshot, or a tensor recorded is now on the meta device (no
                values to compare).

        >>> model = nn.Linear(2, 1)
        >>> _ = nn.init.zeros_(model.bias)
        >>> snap, prints = snapshot(model), snapshot(model, drift="fingerprint")
        >>> with torch.no_grad():
        ...     _ = model.bias.add_(0.5)
        >>> snap.changed(), prints.changed()
        ({'bias': 0.5}, {'bias': nan})
        """
        self._check_atol("changed()", atol)
        return {e.name: d for e, _, d in self._compare(atol, "changed()") if not d <= atol}

    def replaced(self) -> tuple[str, ...]:
        """Names that point to a different tensor object than at the snapshot.

        An optimizer or a checkpoint still holds the old object, so a replaced parameter
        quietly stops training (or stops being saved). Empty for mapping snapshots.

        Note:
            Objects are told apart by ``id()``: the snapshot keeps no reference, weak or
            strong, to a module's tensors (a weak one would make torch refuse to swap them
            in ``load_state_dict`` under ``swap_module_params_on_conversion``). A new object
            that reuses the memory of a freed one is therefore not reported here; its
            values are still compared.
        """
        compared = self._compare(math.inf, "replaced()")
        return tuple(e.name for e, now, _ in compared if id(now) != e.ident)

    def require_tensors(self, caller: str) -> None:
        """Refuse a snapshot that recorded nothing: asserting on it could never fail."""
        if self._entries:
            return
        raise SelectorError(
            f"{caller}: the snapshot of {self._description} recorded no tensor, so this "
            f"assertion could never fail. Snapshot what the test protects: freeze it before "
            f"taking the snapshot (parameters='frozen' records what requires_grad=False then), "
            f"or pass the module, filter or names= that hold its parameters and buffers"
        )

    def _check_atol(self, caller: str, atol: float) -> None:
        check_atol(atol, caller)
        if atol and self.drift != "copy":
            raise IsolationTypeError(
                f"{caller}: atol={atol} needs the size of a change, which a fingerprint "
                "snapshot does not know; take snapshot(..., drift='copy') to allow a tolerance"
            )

    def assert_unchanged(self, *, atol: float = 0.0) -> None:
        """Raise :class:`~isolate.errors.DriftError` if any tensor moved by more than ``atol``.

        Args:
            atol: the largest |Δ| per element that still counts as unchanged; only ``0``
                with a fingerprint snapshot.

        Raises:
            DriftError: naming every tensor that moved, whether it is a parameter or a
                buffer, its ``requires_grad``, its max |Δ| and how many elements moved (with
                a copy), and the likely cause.
            IsolationTypeError: ``atol`` is negative or infinite, or nonzero with a
                fingerprint snapshot, or a tensor recorded is now on the meta device (no
                values to compare).
            SelectorError: the snapshot recorded no tensor, so the assertion could never
                fail (``parameters="frozen"`` before anything was frozen, say).

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> snap = snapshot(model, drift="fingerprint")
        >>> _ = model(torch.randn(4, 2))  # train mode: BatchNorm updates its statistics
        >>> snap.assert_unchanged()
        Traceback (most recent call last):
        ...
        isolate.errors.DriftError: assert_unchanged(): 3 of 7 tensors changed since the ...
        """
        caller = "assert_unchanged()"
        self._check_atol(caller, atol)
        self.require_tensors(caller)
        moved = [(e, now, d) for e, now, d in self._compare(atol, caller) if not d <= atol]
        if not moved:
            return
        width = max(len(e.name) for e, _, _ in moved)
        lines = []
        for entry, now, delta in moved:
            if now is None:
                detail = "is gone (no tensor of that name any more)"
            elif tuple(local_tensor(now).shape) != entry.shape:
                detail = f"changed shape {entry.shape} -> {tuple(local_tensor(now).shape)}"
            elif local_tensor(now).dtype != entry.dtype:
                detail = f"changed dtype {entry.dtype} -> {local_tensor(now).dtype}"
            elif entry.saved is None:
                detail = (
                    "changed (fingerprint differs; snapshot(..., drift='copy') tells by how much)"
                )
            else:
                diff = moved_elements(entry.saved, now, atol)
                detail = f"max|Δ|={delta:.3e} in {diff} of {entry.saved.numel()} elements"
            flag = ""
            if entry.kind == "parameter" and now is not None:
                flag = f", requires_grad={now.requires_grad}"
            replaced = (
                ", replaced by a new object" if now is not None and id(now) != entry.ident else ""
            )
            lines.append(f"  {entry.name:<{width}}  ({entry.kind}{flag}{replaced}) {detail}")
        hints = []
        if any(e.kind == "parameter" for e, _, _ in moved):
            hints.append(
                "a parameter with requires_grad=False still moves when its .grad is a zero "
                "tensor and the optimizer has weight decay or momentum: call "
                "optimizer.zero_grad(set_to_none=True) or drop it from the optimizer "
                "(isolate.exposure.optimizer_exposure lists such parameters)"
            )
        if any(e.kind == "buffer" for e, _, _ in moved):
            hints.append(
                "BatchNorm running statistics update in train mode whatever requires_grad "
                "says: put those layers in eval mode (isolate.freeze(..., bn='eval'))"
            )
        raise DriftError(
            f"{caller}: {len(moved)} of {len(self._entries)} tensors changed since the "
            f"snapshot of {self._description} (atol={atol}):\n"
            + "\n".join(lines)
            + "\nFix: "
            + "; ".join(hints)
        )


def snapshot(
    target: nn.Module | Mapping[str, torch.Tensor],
    *,
    parameters: ParameterFilter = "all",
    buffers: bool = True,
    names: Iterable[str] | None = None,
    drift: Drift = "copy",
    device: torch.device | str | None = "cpu",
) -> Snapshot:
    """Record parameters and buffers now, to tell later by name what changed.

    Args:
        target: a module (its parameters and buffers, every alias of a tied tensor, with
            BatchNorm ``running_mean`` / ``running_var`` / ``num_batches_tracked``), or a
            mapping of names to tensors.
        parameters: which parameters of a module to record: ``"all"``, ``"frozen"``
            (``requires_grad=False`` now), ``"trainable"`` or ``"none"``.
        buffers: whether to record the module's buffers.
        names: instead of the two filters above, exactly these parameter and buffer names
            of the module. Each is looked up by name at every check.
        drift: how a change is recorded: ``"copy"`` keeps a copy of every tensor, so
            ``changed()`` tells by how much it moved (memory: the size of what is recorded);
            ``"fingerprint"`` keeps a 128-bit :func:`fingerprint` of each instead: any change
            of any bit is still caught, for O(number of tensors) memory and about one read of
            the weights per check, but ``changed()`` reports ``nan`` for the size. The same
            choice as ``IsolationSpec.apply(..., drift=)``.
        device: where copies live; ``None`` keeps each on its tensor's device (faster, but
            costs accelerator memory). Unused with ``drift="fingerprint"``.

    Returns:
        A :class:`Snapshot`; call ``.changed()`` or ``.assert_unchanged()`` on it later.

    Raises:
        IsolationTypeError: ``target`` is neither a module nor a mapping of tensors,
            ``names`` is given with a mapping, or a tensor has no values to record (a meta
            tensor, an uninitialised lazy parameter).
        SelectorError: ``parameters`` is not one of the filters above, ``names`` names no
            parameter or buffer of the module, or comes with a filter, or ``drift`` is
            neither ``"copy"`` nor ``"fingerprint"``.

    Note:
        ``requires_grad=False`` is not enough to keep a parameter still: an optimizer moves a
        parameter whose ``.grad`` is a zero tensor (left by ``zero_grad(set_to_none=False)``
        or an earlier step) through weight decay and momentum, and BatchNorm updates its
        running statistics in train mode regardless. A snapshot catches both.

    Note:
        A mapping snapshot checks the very tensor objects it was given. If their owner later
        replaces them (SWA and ``load_state_dict(assign=True)`` assign new buffers), the new
        values are never checked: snapshot the module with ``names=`` instead, which looks
        every name up again at each check.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> model[0].requires_grad_(False)  # doctest: +ELLIPSIS
    Linear(...)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    >>> snap = snapshot(model, parameters="frozen")
    >>> for p in model[0].parameters():
    ...     p.grad = torch.zeros_like(p)  # a zero grad is not None: AdamW decays p
    >>> opt.step()
    >>> sorted(snap.changed())
    ['0.bias', '0.weight']
    """
    caller = "snapshot()"
    if parameters not in _FILTERS:
        raise SelectorError(
            f"{caller}: parameters={parameters!r} is not a filter; expected one of {list(_FILTERS)}"
        )
    if drift not in _DRIFT:
        raise SelectorError(
            f"{caller}: drift={drift!r} is not a way to record; expected one of {list(_DRIFT)}"
        )
    if isinstance(target, nn.Module):
        chosen = _module_tensors(target, parameters, buffers, names, caller)
        return _record(chosen, type(target).__name__, target, drift, device)
    if isinstance(target, Mapping):
        chosen = _mapping_tensors(target, names, caller)
        return _record(chosen, f"{len(chosen)} named tensors", None, drift, device)
    raise IsolationTypeError(
        f"{caller}: target must be a torch.nn.Module or a mapping of names to tensors, got "
        f"{type(target).__name__}; e.g. snapshot(model) or snapshot(dict(model.named_buffers()))"
    )


# What a snapshot records: name, kind, the tensor, and whether to hold it (a mapping's tensors
# are held: they cannot be looked up again by name).
_Chosen = tuple[str, Literal["parameter", "buffer"], torch.Tensor, bool]


def _module_tensors(
    target: nn.Module,
    parameters: ParameterFilter,
    buffers: bool,
    names: Iterable[str] | None,
    caller: str,
) -> list[_Chosen]:
    """The tensors of ``target`` that :func:`snapshot` records, by ``state_dict`` key."""
    walked = Names.of(target, aliases=True)  # by state_dict key; FSDP2: this rank's shards
    params, bufs = walked.params, walked.buffers
    if names is None:
        chosen: list[_Chosen] = [
            (name, "parameter", p, False)
            for name, p in params.items()
            if parameters == "all"
            or (parameters != "none" and p.requires_grad == (parameters == "trainable"))
        ]
        return chosen + [(name, "buffer", b, False) for name, b in bufs.items() if buffers]
    if parameters != "all" or not buffers:
        raise SelectorError(
            f"{caller}: names= picks tensors itself; drop parameters={parameters!r} / "
            f"buffers={buffers!r}"
        )
    wanted = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in wanted if n not in params and n not in bufs]
    if unknown:
        raise SelectorError(
            f"{caller}: {unknown} name no parameter or buffer of "
            f"{type(target).__name__}; its names start {list(params)[:5]} "
            f"(buffers: {list(bufs)[:5]})"
        )
    return [
        (name, "parameter", params[name], False)
        if name in params
        else (name, "buffer", bufs[name], False)
        for name in dict.fromkeys(wanted)
    ]


def _mapping_tensors(
    target: Mapping[str, torch.Tensor], names: Iterable[str] | None, caller: str
) -> list[_Chosen]:
    """The tensors of a mapping that :func:`snapshot` records (held: a mapping is not looked
    up again)."""
    if names is not None:
        raise IsolationTypeError(
            f"{caller}: names= selects from a module; a mapping already names its tensors"
        )
    chosen: list[_Chosen] = []
    for name, t in target.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise IsolationTypeError(
                f"{caller}: a mapping target must map names to tensors; got "
                f"{type(name).__name__} -> {type(t).__name__}"
            )
        chosen.append((name, "parameter" if isinstance(t, nn.Parameter) else "buffer", t, True))
    return chosen


def _record(
    chosen: list[_Chosen],
    description: str,
    module: nn.Module | None,
    drift: Drift,
    device: torch.device | str | None,
) -> Snapshot:
    """A :class:`Snapshot` of ``chosen``: a copy or a fingerprint of each tensor, one per
    tensor object (aliases, tied weights and shared buffers, share it)."""
    for name, _, t, _ in chosen:
        if isinstance(t, nn.parameter.UninitializedParameter | nn.parameter.UninitializedBuffer):
            raise IsolationTypeError(
                f"snapshot(): {name!r} is an uninitialised lazy parameter, with no values yet; "
                f"run one forward pass to materialise it before the snapshot"
            )
        if local_tensor(t).device.type == "meta":
            raise IsolationTypeError(
                f"snapshot(): {name!r} is a meta tensor, with no values to record; load the "
                f"weights (to_empty() then load_state_dict()) before the snapshot"
            )
        if t.is_quantized:  # its bytes are its int_repr(): a change of scale would not show
            raise IsolationTypeError(
                f"snapshot(): {name!r} is a quantised {t.dtype} tensor, which cannot be "
                f"compared; record its int_repr(), q_scale() and q_zero_point() (or its "
                f"dequantize()) instead"
            )
    saved: dict[int, tuple[torch.Tensor | None, Print | None]] = {}
    if drift == "fingerprint":
        prints = fingerprints(t for _, _, t, _ in chosen)
        saved.update((i, (None, fp)) for i, fp in prints.items())
    entries = []
    for name, kind, t, strong in chosen:
        local = local_tensor(t)
        if id(t) not in saved:
            saved[id(t)] = (local.clone() if device is None else local.to(device, copy=True), None)
        kept, print_ = saved[id(t)]
        shape, held = tuple(local.shape), t if strong else None
        entries.append(_Entry(name, kind, kept, print_, shape, local.dtype, id(t), held))
    return Snapshot(entries, module, description, drift, device)
