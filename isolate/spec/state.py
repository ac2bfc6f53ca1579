"""Saved isolation state: plain data by parameter name, checked against the spec on load.

A state records the resolved spec, what is frozen and which thaw groups were applied when.
It holds only builtins, so a checkpoint that carries it loads with
``torch.load(weights_only=True)``, and a state written under another spec is refused with
the differences named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from isolate._text import shown
from isolate.errors import CheckpointMismatchError, IsolationTypeError
from isolate.spec.plan import Plan

__all__ = ["FORMAT", "check_state", "plain", "saved_state"]

FORMAT = 1
"""The version of ``handle.state_dict()``'s layout, saved with it."""


def plain(value: object, caller: str) -> Any:
    """``value`` rebuilt from exact builtins, so ``torch.load(weights_only=True)`` reads it back:
    a numpy float (``Thaw(lr=np.float64(1e-3))`` passes as a float) or an enum would be pickled
    as its class, and the checkpoint could not be resumed under torch's default."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    for kind in (bool, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, Mapping):
        return {plain(k, caller): plain(v, caller) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, caller) for v in value]
    raise IsolationTypeError(
        f"{caller}: cannot save {type(value).__name__} {value!r} in the isolation state; "
        f"expected plain str, int, float, bool, None, lists and dicts"
    )


def saved_state(
    plan: Plan,
    frozen: Sequence[str],
    thawed: Mapping[str, Mapping[str, int]],
    phases: object,
    optimizers: Sequence[torch.optim.Optimizer],
    caller: str,
) -> dict[str, Any]:
    """Where an applied spec stands, by parameter name, in plain types."""
    state: dict[str, Any] = plain(
        {
            "format": FORMAT,
            "spec": plan.record(),
            "frozen": list(frozen),
            "thawed": [{"name": n, **at} for n, at in thawed.items()],
            "phases": phases,
            "layout": [  # param names by group, to rewrite optimizer states (isolate.interop.leave)
                [[plan.names.name(p) for p in g["params"]] for g in opt.param_groups]
                for opt in optimizers
            ],
        },
        caller,
    )
    return state


def check_state(
    record: Mapping[str, Any], state: object, groups: list[str], caller: str
) -> list[dict[str, Any]]:
    """Check a saved state against the resolved spec ``record``; return its thawed entries.

    Raises:
        CheckpointMismatchError: the state is malformed, was written under another spec
            (every difference is named), or thawed groups this spec does not have.
    """
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointMismatchError(
            f"{caller}: the saved isolation state has format {got!r}, expected {FORMAT}"
        )
    missing = [k for k in ("spec", "frozen", "thawed") if k not in state]
    if missing or not isinstance(state["spec"], Mapping):
        raise CheckpointMismatchError(
            f"{caller}: the saved isolation state is malformed: it lacks {missing or ['spec']}"
        )
    lines = _differences(state["spec"], record)
    if lines:
        raise CheckpointMismatchError(
            f"{caller}: the checkpoint was written under a different isolation spec:\n"
            + "\n".join(lines)
            + "\nFix: resume with the spec of the run that wrote it, or load only its weights "
            "(model.load_state_dict(torch.load(path, weights_only=True)['state_dict'])) to "
            "start a new run under the new spec"
        )
    thawed = state["thawed"]
    if not isinstance(thawed, list) or not all(_entry_ok(e) for e in thawed):
        raise CheckpointMismatchError(
            f"{caller}: the saved isolation state is malformed: 'thawed' must be a list of "
            f"{{'name': str, 'epoch': int, 'global_step': int}}, got {thawed!r}"
        )
    names = [e["name"] for e in thawed]
    unknown = [n for n in names if n not in groups]
    if unknown:
        raise CheckpointMismatchError(
            f"{caller}: the checkpoint thawed groups {unknown} that this spec does not have"
        )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise CheckpointMismatchError(
            f"{caller}: the saved isolation state thaws {repeated} more than once; it is "
            f"inconsistent"
        )
    return [dict(e) for e in thawed]


def _entry_ok(entry: object) -> bool:
    return (
        isinstance(entry, Mapping)
        and isinstance(entry.get("name"), str)
        and all(
            isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
            for k in ("epoch", "global_step")
        )
    )


def _differences(saved: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    lines = []
    for key in ours:
        if saved.get(key) == ours[key]:
            continue
        if key == "thaw" and isinstance(saved.get(key), list):
            lines.extend(_thaw_differences(saved[key], ours[key]))
            continue
        if isinstance(ours[key], list) and all(isinstance(v, str) for v in ours[key]):
            value = saved.get(key)
            was: list[Any] = value if isinstance(value, list) else []
            gone = [v for v in was if v not in ours[key]]
            new = [v for v in ours[key] if v not in was]
            detail = f"only in the checkpoint {shown(gone)}, only in this run {shown(new)}"
            if not gone and not new:
                detail = "same names in another order"
        else:
            detail = f"checkpoint {saved.get(key)!r}, this run {ours[key]!r}"
        lines.append(f"  {key}: {detail}")
    return lines


def _thaw_differences(saved: list[Any], ours: list[dict[str, Any]]) -> list[str]:
    """One line per thaw group that differs, naming the fields; groups are matched by name."""
    theirs = {str(g.get("name")): g for g in saved if isinstance(g, Mapping)}
    mine = {g["name"]: g for g in ours}
    lines = []
    gone = [n for n in theirs if n not in mine]
    new = [n for n in mine if n not in theirs]
    if gone or new:
        lines.append(
            f"  thaw: groups only in the checkpoint {shown(gone)}, only in this run {shown(new)}"
        )
    for name, group in mine.items():
        other = theirs.get(name)
        if other is None:
            continue
        changes = []
        for k, v in group.items():
            was = other.get(k)
            if was == v:
                continue
            if k == "params" and isinstance(was, list):
                gone_p = [n for n in was if n not in v]
                added = [n for n in v if n not in was]
                changes.append(
                    f"params only in the checkpoint {shown(gone_p)}, only in this run "
                    f"{shown(added)}"
                )
            else:
                changes.append(f"{k} {was!r} in the checkpoint, {v!r} in this run")
        if changes:
            lines.append(f"  thaw group {name!r}: " + "; ".join(changes))
    if not lines:
        lines.append("  thaw: the same groups in another order")
    return lines
