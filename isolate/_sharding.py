"""Seeing through sharded models: which graph leaves stand for which parameters.

Under ``torch.distributed.fsdp.fully_shard`` (FSDP2) a module's registered parameters are
sharded ``DTensor`` objects, but its forward runs on temporary *unsharded* parameters that
FSDP all-gathers and registers in their place; those temporaries are the ``AccumulateGrad``
leaves of the autograd graph. A walk that looks for the registered objects finds nothing and
proves isolation vacuously. This module maps every FSDP2 temporary back to its parameter (by
the ``FSDPParam`` that owns both), so the audits give the answer the unsharded model gives;
and it refuses, with :class:`~isolate.errors.ShardedGraphError`, wherever the leaves stand for
parameters it cannot map (FSDP1 flat parameters, unknown wrappers).

It imports nothing from ``torch.distributed`` unless the program already did: a model cannot
be sharded before FSDP is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import nn

from isolate._text import shown
from isolate.errors import ShardedGraphError, UnsupportedStrategyError

__all__ = [
    "ShardedView",
    "canonical_parameters",
    "check_leaves",
    "check_wrappers",
    "is_flat_parameter",
    "roots_of",
    "settle",
    "sharded_view",
]

T = TypeVar("T", bound=torch.Tensor)
_FSDP2 = "torch.distributed.fsdp"
# The attributes of an FSDP2 ``FSDPParam`` that can hold the object registered on the module:
# the sharded DTensor (between steps), the all-gathered parameter (forward / backward), and
# the smaller post-forward shard (``reshard_after_forward=int``).
_FAMILY = ("sharded_param", "_unsharded_param", "_sharded_post_forward_param")


class _Found(Protocol):
    """What a graph walk found (``isolate._autograd.Walk``), as far as this module needs."""

    leaves: dict[int, torch.Tensor]
    consumers: dict[int, list[Any]]


@dataclass
class ShardedView:
    """Every FSDP2-managed parameter of some modules, and the objects that stand for it.

    Attributes:
        family: id(any object FSDP registers for a parameter) -> all those objects, the
            sharded parameter first.
        units: the FSDP2 modules found (each ``fully_shard``-ed module once).
    """

    family: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    units: list[nn.Module] = field(default_factory=list)

    def canonical(self, tensor: T) -> T:
        """The sharded parameter ``tensor`` stands for, or ``tensor`` itself."""
        members = self.family.get(id(tensor))
        return cast(T, members[0]) if members else tensor

    def aliases(self, of_id: Mapping[int, str]) -> dict[int, str]:
        """id(every object standing for a named sharded parameter) -> that name."""
        return {
            id(m): of_id[id(members[0])]
            for members in self.family.values()
            if id(members[0]) in of_id
            for m in members
        }

    def leaf(self, tensor: T) -> T:
        """The tensor a graph differentiates for ``tensor``: its unsharded temporary when FSDP
        has made one, else ``tensor`` itself."""
        members = self.family.get(id(tensor))
        if not members:
            return tensor
        unsharded = [m for m in members[1:] if m.dim() == members[0].dim() and _full(m, members)]
        return cast(T, unsharded[0]) if unsharded else tensor


def _full(candidate: torch.Tensor, members: list[torch.Tensor]) -> bool:
    return tuple(candidate.shape) == tuple(members[0].shape)  # a DTensor's shape is global


def _fsdp_units(modules: Iterable[nn.Module]) -> Iterator[nn.Module]:
    if _FSDP2 not in sys.modules:
        return
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule) and id(module) not in seen:
                seen.add(id(module))
                yield module


def _fsdp_params(unit: nn.Module, caller: str) -> list[Any]:
    try:
        state = unit._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.8 kept one group per state
            group = state._fsdp_param_group
            groups = [] if group is None else [group]
        return [fp for group in groups for fp in group.fsdp_params]
    except AttributeError as error:
        raise ShardedGraphError(
            f"{caller}: {type(unit).__name__} is sharded with fully_shard, but this torch "
            f"version ({torch.__version__}) keeps FSDP's parameter state where isolate cannot "
            f"find it ({error}); its graph leaves cannot be mapped to parameters, so the audit "
            f"refuses. Audit the unsharded model (before fully_shard), or pin torch to a "
            f"version isolate supports"
        ) from None


def sharded_view(modules: Iterable[nn.Module], caller: str) -> ShardedView:
    """The FSDP2 parameters under ``modules``, with every object that stands for each.

    Empty, and nearly free, when FSDP was never imported or nothing is sharded.

    Raises:
        ShardedGraphError: FSDP2 is in use, but its state is not where this torch version
            was expected to keep it.
    """
    view = ShardedView()
    for unit in _fsdp_units(modules):
        view.units.append(unit)
        for fp in _fsdp_params(unit, caller):
            members: list[torch.Tensor] = []
            for attr in _FAMILY:
                t = getattr(fp, attr, None)
                if isinstance(t, torch.Tensor) and all(t is not m for m in members):
                    members.append(t)
            if not members or getattr(fp, "sharded_param", None) is not members[0]:
                raise ShardedGraphError(
                    f"{caller}: an FSDP2 parameter of {type(unit).__name__} has no sharded "
                    f"parameter isolate can find; the audit refuses rather than guess"
                )
            for m in members:
                view.family[id(m)] = members
    return view


def settle(model: nn.Module) -> int:
    """Reshard every FSDP2 unit of ``model`` so that its registered parameters are the sharded
    ``DTensor`` objects; returns how many units there are (0: nothing sharded, a no-op).

    A unit can stay unsharded after a step (after a forward without backward, such as
    validation, or when it got no gradient). Its registered parameters are then temporaries:
    a flag flipped on them is overwritten from the sharded parameters at the next all-gather,
    or kept while FSDP considers the unit unsharded already, and an optimizer given them
    never sees an update. Flip flags and build optimizer groups only after this call. It
    frees memory and communicates nothing, so it may run on one rank alone.

    >>> settle(nn.Linear(2, 2))
    0
    """
    if not isinstance(model, nn.Module):
        return 0  # the caller's own type check speaks
    units = list(_fsdp_units([model]))
    for unit in units:
        unit.reshard()  # type: ignore[operator]
    return len(units)


def is_flat_parameter(t: object) -> bool:
    """Whether ``t`` is an FSDP1 ``FlatParameter`` (many parameters in one flat tensor)."""
    return isinstance(t, torch.Tensor) and (
        bool(getattr(t, "_is_flat_param", False)) or type(t).__name__ == "FlatParameter"
    )


def canonical_parameters(
    model: nn.Module, named: Mapping[str, T], caller: str = "isolate"
) -> dict[str, T]:
    """``named`` with every FSDP2 temporary replaced by the sharded parameter it stands for.

    Between forward and backward some FSDP2 units register unsharded temporaries instead of
    their sharded parameters; comparing a tensor across steps (drift, ranks) must always read
    the same object, the sharded one, whose shard this rank owns.

    >>> model = nn.Linear(2, 1)
    >>> list(canonical_parameters(model, dict(model.named_parameters())))
    ['weight', 'bias']
    """
    view = sharded_view([model], caller)
    if not view.family:
        return dict(named)
    return {name: view.canonical(t) for name, t in named.items()}


def _storage(t: torch.Tensor) -> int:
    try:
        local = t.to_local() if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def _registered_ids(roots: Sequence[nn.Module]) -> set[int]:
    return {id(p) for r in roots for m in r.modules() for p in m._parameters.values()}


def _registered(roots: Sequence[nn.Module]) -> dict[int, tuple[str, torch.Tensor]]:
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for root in roots:
        for name, p in root.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), (name, p))
    return out


def check_leaves(
    found: _Found,
    roots: Sequence[nn.Module],
    caller: str,
    *,
    view: ShardedView | None = None,
    tensors: Sequence[torch.Tensor] = (),
) -> ShardedView:
    """Map the FSDP2 temporaries among ``found.leaves`` to their parameters, in place, and
    refuse leaves that stand for parameters of ``roots`` but cannot be mapped.

    After the call, a parameter of ``roots`` is in ``found.leaves`` (with the consumers of its
    temporary) exactly when the loss reaches it, sharded or not. Foreign leaves that do not
    stand for a parameter of ``roots`` (inputs that require grad, another model's
    parameters) are left alone: they are normal.

    A foreign leaf *stands for* a parameter of ``roots`` when it is an FSDP1
    ``FlatParameter``; when it shares storage with a registered parameter (which is then a
    view of it); or when it has the full shape of a sharded (``DTensor``) or empty registered
    parameter that is not itself a leaf. Any of these is refused: the walk cannot tell which
    parameters the loss reaches.

    Args:
        found: the walk's result; its ``leaves`` and ``consumers`` gain the mapped parameters.
        roots: the modules whose parameters are audited.
        caller: the public function, for messages.
        view: a :func:`sharded_view` of ``roots`` already built.
        tensors: parameters audited that may lie outside ``roots`` (an ``assert_isolated``
            without ``model=``); a sharded one that no FSDP2 unit of ``roots`` owns is
            refused.

    Returns:
        The :class:`ShardedView` used.

    Raises:
        ShardedGraphError: leaves stand for parameters that cannot be mapped back.
    """
    view = sharded_view(roots, caller) if view is None else view
    for leaf_id in list(found.leaves):
        members = view.family.get(leaf_id)
        if not members:
            continue
        for m in members:
            if id(m) not in found.leaves:
                found.leaves[id(m)] = m
                found.consumers.setdefault(id(m), list(found.consumers.get(leaf_id, [])))
    registered = _registered_ids(roots)  # ids only: names are built only to refuse
    foreign = [t for i, t in found.leaves.items() if i not in registered and i not in view.family]
    flat = [t for t in found.leaves.values() if is_flat_parameter(t)]
    if flat:
        fqns = [n for t in flat for n in getattr(t, "_fqns", ())]
        raise ShardedGraphError(
            f"{caller}: the graph's leaves include {len(flat)} FSDP1 FlatParameter(s), each "
            f"holding many parameters in one flat tensor ({shown(fqns, limit=6)}); the walk cannot "
            f"tell which of them the loss reaches, so it refuses rather than answer for the "
            f"whole unit. Audit the model before wrapping it in FullyShardedDataParallel "
            f"(same forward, one process), or shard it with torch.distributed.fsdp."
            f"fully_shard (FSDP2), whose leaves isolate maps back to parameters"
        )
    loose = [t for t in tensors if type(t).__name__ == "DTensor" and id(t) not in view.family]
    if loose and any(id(t) not in registered for t in loose):
        raise ShardedGraphError(
            f"{caller}: {len(loose)} of the parameters audited are sharded (DTensor), and no "
            f"fully_shard unit passed owns them, so their graph leaves (FSDP's unsharded "
            f"temporaries) cannot be found; pass the whole model with model=..."
        )
    if not foreign:
        return view
    named = _registered(roots)
    unreached = [(n, p) for i, (n, p) in named.items() if i not in found.leaves]
    standing = _stand_ins(foreign, unreached, view)
    if standing:
        raise ShardedGraphError(
            f"{caller}: the graph's leaves are not the model's parameters: some stand for "
            f"parameters of {', '.join(type(r).__name__ for r in roots)} "
            f"({shown(standing, limit=6)}) - a "
            f"wrapper runs the forward on copies or views of them (sharding, flat buffers, "
            f"offloading) - and the walk cannot map them back, so it refuses rather than "
            f"prove isolation vacuously. Audit the model without the wrapper, or shard it "
            f"with fully_shard (FSDP2), which isolate sees through"
        )
    return view


def _stand_ins(
    foreign: list[torch.Tensor], unreached: list[tuple[str, torch.Tensor]], view: ShardedView
) -> list[str]:
    """Names of unreached registered parameters that a foreign leaf evidently stands for."""
    storages: dict[int, list[str]] = {}
    shapes: dict[tuple[int, ...], list[str]] = {}
    for name, p in unreached:
        ptr = _storage(p)
        if ptr:
            storages.setdefault(ptr, []).append(name)
        hollow = type(p).__name__ == "DTensor" or (p.numel() and not ptr)
        if hollow and id(p) not in view.family:
            shapes.setdefault(tuple(p.shape), []).append(name)
    out: list[str] = []
    for t in foreign:
        ptr = _storage(t)
        for name in storages.get(ptr, []) if ptr else []:
            out.append(name)
        if isinstance(t, nn.Parameter):
            out += shapes.get(tuple(t.shape), [])
    return list(dict.fromkeys(out))


def roots_of(protected: object, model: nn.Module | None) -> list[nn.Module]:
    """The modules whose FSDP2 units an audit of ``protected`` must look into."""
    if model is not None:
        return [model]
    if isinstance(protected, nn.Module):
        return [protected]
    if isinstance(protected, (list, tuple)):
        return [m for m in protected if isinstance(m, nn.Module)]
    return []


def _fsdp1_handles(model: nn.Module) -> Iterator[tuple[nn.Module, Any]]:
    if _FSDP2 not in sys.modules:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            handle = getattr(module, "_handle", None)
            if handle is not None and getattr(handle, "flat_param", None) is not None:
                yield module, handle


def check_wrappers(
    model: nn.Module,
    frozen: Mapping[str, torch.Tensor],
    caller: str,
    warn: Callable[[str], None],
) -> None:
    """Refuse FSDP1 units a spec cannot work with, and warn where freezing saves no memory.

    Raises:
        UnsupportedStrategyError: ``model`` holds ``FullyShardedDataParallel`` units built
            with ``use_orig_params=False``: each registers one ``FlatParameter`` with one
            ``requires_grad``, so part of a unit cannot be frozen (FSDP itself refuses units
            with mixed flags, pytorch/pytorch#104690).
    """
    if not isinstance(model, nn.Module):
        return  # the caller's own type check speaks
    mixed: list[str] = []
    ids = {id(p) for p in frozen.values()}
    for unit, handle in _fsdp1_handles(model):
        flat = handle.flat_param
        originals = getattr(flat, "_params", None)
        if not getattr(handle, "_use_orig_params", False) or originals is None:
            raise UnsupportedStrategyError(
                f"{caller}: the model holds FullyShardedDataParallel units built with "
                f"use_orig_params=False ({type(unit).__name__} over "
                f"{shown(list(getattr(flat, '_fqns', ())), limit=6)}): each unit is one "
                f"FlatParameter with a single requires_grad, so the spec cannot freeze part "
                f"of it, and FSDP refuses units that mix frozen and trainable parameters "
                f"(pytorch/pytorch#104690). Wrap with FullyShardedDataParallel(..., "
                f"use_orig_params=True), or shard with torch.distributed.fsdp.fully_shard"
            )
        states = {id(p) in ids for p in originals}
        if len(states) == 2:
            mixed.extend(getattr(flat, "_fqns", ()))
    if mixed:
        warn(
            f"{caller}: FSDP1 units mix frozen and trainable parameters "
            f"({shown(mixed, limit=6)}); FSDP1 keeps one flat gradient per unit, so the frozen "
            f"parameters' gradients are still computed and their memory is not saved. Wrap "
            f"frozen modules in units of their own (auto_wrap_policy, or nested "
            f"FullyShardedDataParallel), or shard with fully_shard (FSDP2), which keeps "
            f"gradients per parameter"
        )
