"""Leaving isolate: a checkpoint written under a spec, rewritten for a run without it.

The weights need nothing: wrappers keep ``state_dict`` keys as they were (no ``module.``
infix), so ``model.load_state_dict(checkpoint["state_dict"])`` loads into the plain model.
The optimizer state does not fit a plain optimizer as it is: frozen parameters were taken
out of their groups, and each thaw added a param group, so torch refuses it ("loaded state
dict has a different number of parameter groups"). :func:`plain_optimizer_state` rewrites it,
by parameter name, to the layout of an optimizer built without isolate: each parameter's
state (momentum, Adam moments, step) moves to where the plain optimizer holds it, each plain
group takes the settings of the group most of its parameters were in before any thaw, and
the groups thaws added disappear. :func:`plain_checkpoint` does this for every optimizer and
LR scheduler of a Lightning checkpoint and drops the callback's entry.

Note:
    A thawed group with its own ``lr`` (or a warm-up) merges into the group the parameters
    came from and takes that group's settings: the plain run cannot express a per-group
    difference its optimizer does not have. Per-group scheduler lists (``base_lrs``,
    ``lr_lambdas``, ``min_lrs``, ``max_lrs``, ``_last_lr``) are recognised by their length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from isolate._walker import Names
from isolate.errors import CheckpointMismatchError
from isolate.exposure import unwrap_optimizer

__all__ = ["CALLBACK_KEY", "plain_checkpoint", "plain_optimizer_state"]

CALLBACK_KEY = "IsolationCallback"
"""The key of IsolationCallback's state in ``checkpoint["callbacks"]``."""

_CALLER = "plain_optimizer_state()"


def plain_optimizer_state(
    state: Mapping[str, Any],
    layout: Sequence[Sequence[str]],
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    *,
    thawed: Sequence[Sequence[str]] = (),
) -> tuple[dict[str, Any], list[int]]:
    """Rewrite one optimizer's saved state to the layout of ``optimizer``, by parameter name.

    Args:
        state: the saved ``optimizer.state_dict()``.
        layout: the parameter names of each saved param group (``handle.state_dict()["layout"]``
            for this optimizer; saved in the callback's checkpoint state).
        optimizer: the optimizer of the run without isolate, built over ``model``.
        model: the model ``optimizer`` trains, to name its parameters.
        thawed: the parameter names of each group a thaw added (they are not the origin of a
            plain group's settings unless nothing else is).

    Returns:
        The rewritten state (load it with ``optimizer.load_state_dict``), and for each group of
        ``optimizer`` the index of the saved group whose settings it took.

    Raises:
        CheckpointMismatchError: ``layout`` does not match the saved groups.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> opt = torch.optim.SGD([net[1].weight, net[1].bias], lr=0.1, momentum=0.9)
    >>> opt.add_param_group({"params": [net[0].weight, net[0].bias], "lr": 0.01})  # a thaw
    >>> net(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> layout = [["1.weight", "1.bias"], ["0.weight", "0.bias"]]
    >>> plain = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    >>> state, origin = plain_optimizer_state(opt.state_dict(), layout, plain, net)
    >>> plain.load_state_dict(state)
    >>> origin, plain.param_groups[0]["lr"], len(plain.state)
    ([0], 0.1, 4)
    """
    groups = state["param_groups"]
    if len(groups) != len(layout) or any(
        len(g["params"]) != len(names) for g, names in zip(groups, layout, strict=False)
    ):
        raise CheckpointMismatchError(
            f"{_CALLER}: the saved optimizer has groups of sizes "
            f"{[len(g['params']) for g in groups]}, the layout {[len(n) for n in layout]}; "
            f"pass the layout saved with this optimizer state"
        )
    saved_id = {
        name: i
        for g, names in zip(groups, layout, strict=True)
        for i, name in zip(g["params"], names, strict=True)
    }
    group_of = {name: gi for gi, names in enumerate(layout) for name in names}
    added = [gi for gi, names in enumerate(layout) if any(set(names) == set(t) for t in thawed)]
    names = Names.of(model)
    new_groups: list[dict[str, Any]] = []
    new_state: dict[int, Any] = {}
    origins: list[int] = []
    next_id = 0
    for group in optimizer.param_groups:
        wanted = [names.name(p) for p in group["params"]]
        origin = _origin(wanted, group_of, added, len(layout))
        origins.append(origin if origin is not None else -1)
        settings = dict(groups[origin] if origin is not None else group)
        ids = []
        for name in wanted:
            old = saved_id.get(name)
            if old is not None and old in state["state"]:
                new_state[next_id] = state["state"][old]
            ids.append(next_id)
            next_id += 1
        settings["params"] = ids
        new_groups.append(settings)
    return {"state": new_state, "param_groups": new_groups}, origins


def _origin(
    wanted: Sequence[str], group_of: Mapping[str, int], added: Sequence[int], n: int
) -> int | None:
    """The saved group most of ``wanted`` were in, preferring groups no thaw added."""
    counts = [0] * n
    for name in wanted:
        if name in group_of:
            counts[group_of[name]] += 1
    for pool in ([i for i in range(n) if i not in added], list(range(n))):
        best = max(pool, key=lambda i: counts[i], default=None)
        if best is not None and counts[best]:
            return best
    return None


def _per_group(
    value: Any,
    n: int,
    origins: Sequence[int],
    groups: Sequence[Mapping[str, Any]],
    key: str = "",
) -> Any:
    """Per-group lists (length ``n``) of a scheduler state, picked by ``origins``. A plain
    group no saved group held (origin -1) keeps the learning rates of its own ``groups``
    entry (what a scheduler built over it holds); other lists have nothing of its own and
    take the first saved entry."""
    if isinstance(value, list) and len(value) == n and n:
        own = {"base_lrs": "initial_lr", "_last_lr": "lr"}.get(key)
        return [
            value[o] if o >= 0 else groups[i].get(own, groups[i]["lr"]) if own else value[0]
            for i, o in enumerate(origins)
        ]
    if isinstance(value, dict):
        return {k: _per_group(v, n, origins, groups, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_per_group(v, n, origins, groups, key) for v in value]
    return value


def _is_opt(value: object) -> bool:
    return isinstance(getattr(value, "optimizer", value), torch.optim.Optimizer)


def _optimizers_of(value: object) -> list[torch.optim.Optimizer]:
    """The optimizers in what ``configure_optimizers()`` may return, in Lightning's order."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and isinstance(value[0], list) and all(map(_is_opt, value[0])):
            value = value[0]  # ([optimizers], [schedulers])
        items = [v.get("optimizer") if isinstance(v, Mapping) else v for v in value]
    else:
        items = [value]
    return [unwrap_optimizer(item, "plain_checkpoint()") for item in items]


def plain_checkpoint(
    checkpoint: Mapping[str, Any],
    model: nn.Module,
    optimizers: object,
    *,
    key: str = CALLBACK_KEY,
) -> dict[str, Any]:
    """A Lightning checkpoint written under ``IsolationCallback``, for a run without it.

    Args:
        checkpoint: the loaded checkpoint (``torch.load(path, weights_only=True)``).
        model: the plain model (the LightningModule) the run without isolate trains.
        optimizers: the optimizers that run builds, in order: an optimizer, a list of them,
            or whatever ``model.configure_optimizers()`` returns (a dict with
            ``"optimizer"``, a list of such dicts, or a pair of lists of optimizers and
            schedulers), built once every parameter that run trains requires grad.
        key: the callback's ``state_key``.

    Returns:
        A new checkpoint: optimizer and scheduler states in the plain layout, without the
        callback's entry. Save it and pass it as ``ckpt_path`` to ``Trainer.fit``. A plain
        group that holds only parameters the saved optimizer never had keeps its own
        settings, and its own learning rates in the schedulers' ``base_lrs`` and ``_last_lr``.

    Raises:
        CheckpointMismatchError: the checkpoint holds no callback state with a layout (it was
            written without the callback, or by an isolate from before layouts were saved),
            or holds another number of optimizers.
        IsolationTypeError: ``optimizers`` holds no optimizer where one is expected.
    """
    entry = (checkpoint.get("callbacks") or {}).get(key)
    if not isinstance(entry, Mapping) or not isinstance(entry.get("layout"), list):
        raise CheckpointMismatchError(
            f"plain_checkpoint(): the checkpoint holds no {key} state with a 'layout'; it was "
            f"written without the callback (load it as it is), or by an older isolate (load "
            f"only the weights: model.load_state_dict(checkpoint['state_dict']))"
        )
    opts = _optimizers_of(optimizers)
    states = list(checkpoint.get("optimizer_states", []))
    if len(states) != len(opts) or len(entry["layout"]) != len(opts):
        raise CheckpointMismatchError(
            f"plain_checkpoint(): the checkpoint holds {len(states)} optimizer states and "
            f"{len(entry['layout'])} layouts, but {len(opts)} optimizers were given"
        )
    record = entry.get("spec", {})
    thawed_names = {t.get("name") for t in entry.get("thawed", [])}
    thawed = [t["params"] for t in record.get("thaw", []) if t.get("name") in thawed_names]
    out = dict(checkpoint)
    out["optimizer_states"] = []
    rewritten: list[tuple[int, list[int], list[dict[str, Any]]]] = []
    for saved, layout, opt in zip(states, entry["layout"], opts, strict=True):
        new, origins = plain_optimizer_state(saved, layout, opt, model, thawed=thawed)
        out["optimizer_states"].append(new)
        rewritten.append((len(saved["param_groups"]), origins, opt.param_groups))
    schedulers = []
    for sched in checkpoint.get("lr_schedulers", []):
        n = len(sched.get("base_lrs", sched.get("min_lrs", [])))
        match = [(origins, groups) for count, origins, groups in rewritten if count == n]
        schedulers.append(_per_group(sched, n, *match[0]) if match else sched)
    if "lr_schedulers" in checkpoint:
        out["lr_schedulers"] = schedulers
    out["callbacks"] = {k: v for k, v in (checkpoint.get("callbacks") or {}).items() if k != key}
    return out
