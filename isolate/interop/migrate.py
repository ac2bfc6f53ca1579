"""From finetuning-scheduler to an isolate spec: a schedule file converted, phase by phase.

A finetuning-scheduler (FTS) schedule is a mapping of phase number to ``params`` (exact
parameter names, or regular expressions matched from the start of a name), ``lr`` (phases
after 0; default ``base_max_lr``) and ``max_transition_epoch``. Phase 0 trains from the start
and everything else is frozen; each later phase thaws its parameters as a new param group
when the monitored metric stops improving (FTS's ``FTSEarlyStopping``) or at
``max_transition_epoch`` of the phase before, whichever comes first (only the latter with
``epoch_transitions_only``).

That maps onto a spec one to one: ``freeze: ["*", "!<phase 0 names>"...]`` and one
:class:`~isolate.spec.Thaw` per later phase with ``lr``, ``monitor`` / ``patience`` /
``min_delta`` / ``mode`` and ``epoch`` as the latest, ``carry_best`` (FTS's one early-stopping
callback keeps its best score across phases and resets only its wait count) and
``after_previous=1`` (FTS moves on at most one phase per epoch start).
:func:`from_finetuning_scheduler` does it; ``isolate migrate schedule.yaml`` prints
the spec as YAML (``--model module:factory`` resolves regexes on the model). The tests run
schedules through FTS itself and through the converted spec and compare what thaws when, with
which lr. Keys that rebuild the optimizer or scheduler mid-run (``new_optimizer``,
``new_lr_scheduler``) have no counterpart and are refused, naming the phase.

Without a model, a regex becomes the glob that matches exactly what it matches, or is refused
(:func:`regex_to_glob`); a string without regex syntax is read as a parameter or module name
(FTS tries an exact parameter name first, and otherwise matches it as a regex from the start
of names: ``layer.1`` there also takes ``layer.10``; pass the model for that reading).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from isolate.errors import SpecError
from isolate.interop.schedules import load_model, to_yaml

__all__ = ["DESCRIPTION", "add_arguments", "from_finetuning_scheduler", "regex_to_glob", "run"]

_CALLER = "from_finetuning_scheduler()"
_KNOWN = ("params", "lr", "max_transition_epoch")
_REFUSED = ("new_optimizer", "new_lr_scheduler")
_META = set("\\^$*+?{}[]()|")


def regex_to_glob(pattern: str) -> str | None:
    """The glob that matches exactly the names ``re.match(pattern, name)`` matches, for the
    simple regexes schedules use; ``None`` when no glob does.

    Converted: literals, ``\\.`` (a dot), ``.`` (any one character: ``?``), ``.*``, ``.+``,
    ``\\d`` and ``[0-9]`` (one digit), character classes, and a final ``$``. A glob's ``*``
    also crosses dots and ``[0-9]`` is one digit, so a repeated digit (``\\d+``, ``[0-9]*``)
    or any other repetition, alternation or group has no glob form: ``None``.

    >>> regex_to_glob(r"model\\.encoder\\.layer\\.1[01]\\..*")
    'model.encoder.layer.1[01].*'
    >>> regex_to_glob("model.classifier")
    'model?classifier*'
    >>> regex_to_glob(r"model\\.layer\\.\\d\\.attention$")
    'model.layer.[0-9].attention'
    >>> regex_to_glob(r"model\\.layer\\.\\d+\\.output") is None  # '*' would cross dots
    True
    >>> regex_to_glob("(a|b).weight") is None
    True
    """
    out, i = [], 0
    anchored = pattern.endswith("$") and not pattern.endswith("\\$")
    body = pattern[:-1] if anchored else pattern
    body = body.removeprefix("^")  # re.match anchors at the start anyway
    while i < len(body):
        rest = body[i:]
        repeated = len(rest) > 1 and rest[1] in "*+?{"
        if rest.startswith((".*", ".+")):
            out.append("*" if rest[1] == "*" else "?*")
            i += 2
        elif rest.startswith("\\") and len(rest) > 1 and rest[1] in ".-_/":
            if len(rest) > 2 and rest[2] in "*+?{":
                return None
            out.append(rest[1])
            i += 2
        elif rest.startswith("\\d"):
            if len(rest) > 2 and rest[2] in "*+?{":
                return None
            out.append("[0-9]")
            i += 2
        elif rest[0] == "[":
            end = rest.find("]")
            if end < 2 or rest[1] == "!" or any(c in _META - {"-"} for c in rest[1:end]):
                return None  # a glob reads '[!' as a negation, a regex as '!'
            if end + 1 < len(rest) and rest[end + 1] in "*+?{":
                return None
            out.append(rest[: end + 1])
            i += end + 1
        elif rest[0] in _META or repeated:
            return None
        else:
            out.append("?" if rest[0] == "." else rest[0])
            i += 1
    glob = "".join(out)
    if glob.startswith("!") or "type:" in glob:
        return None  # the selector grammar would read an exclusion or a type selector
    return glob if anchored or glob.endswith("*") else glob + "*"


def _selectors(params: object, phase: int, names: Sequence[str] | None) -> list[str]:
    if not isinstance(params, list) or not params or not all(isinstance(p, str) for p in params):
        raise SpecError(
            f"{_CALLER}: phase {phase}: params must be a non-empty list of parameter names or "
            f"regexes, got {params!r}"
        )
    out: list[str] = []
    for p in params:
        if names is not None:
            if p in names:
                out.append(p)
                continue
            regex = re.compile(p)
            found = [n for n in names if regex.match(n)]
            if not found:
                raise SpecError(
                    f"{_CALLER}: phase {phase}: {p!r} matches no parameter name of the model "
                    f"(as finetuning-scheduler would refuse it)"
                )
            out.extend(n for n in found if n not in out)
        elif not _META & set(p):
            out.append(p)
        else:
            glob = regex_to_glob(p)
            if glob is None:
                raise SpecError(
                    f"{_CALLER}: phase {phase}: the regex {p!r} has no glob equivalent; pass "
                    f"model= (isolate migrate --model module:callable) to resolve it to the "
                    f"model's parameter names as finetuning-scheduler does, or write it as a "
                    f"glob (a glob's '*' also crosses dots, so no glob says \\d+)"
                )
            out.append(glob)
    return out


def _phases(schedule: object) -> dict[int, Any]:
    """Phase number -> phase, numbered 0..N, or the error that says how the schedule is off."""
    if not isinstance(schedule, Mapping) or not schedule:
        raise SpecError(f"{_CALLER}: expected a mapping of phase number -> phase, got {schedule!r}")
    try:
        phases = {int(k): v for k, v in schedule.items()}
    except (TypeError, ValueError):
        raise SpecError(
            f"{_CALLER}: phase keys must be integers 0..N, got {list(schedule)}"
        ) from None
    if sorted(phases) != list(range(len(phases))):
        raise SpecError(f"{_CALLER}: phase keys must be 0..N without gaps, got {sorted(phases)}")
    return phases


def _phase(phase: object, depth: int) -> Mapping[str, Any]:
    """Phase ``depth``, refused if it is no mapping or holds a key isolate does not take."""
    if not isinstance(phase, Mapping):
        raise SpecError(f"{_CALLER}: phase {depth} must be a mapping, got {phase!r}")
    refused = [k for k in phase if k in _REFUSED]
    if refused:
        raise SpecError(
            f"{_CALLER}: phase {depth} uses {refused}, which rebuild the optimizer or the "
            f"LR scheduler mid-run; isolate keeps one optimizer and scheduler (a thawed group "
            f"joins them). Drop the key, or give the phase its lr and a LambdaLR shape"
        )
    unknown = [k for k in phase if k not in _KNOWN]
    if unknown:
        raise SpecError(f"{_CALLER}: phase {depth} has unknown keys {unknown}; known {_KNOWN}")
    return phase


def from_finetuning_scheduler(
    schedule: Mapping[Any, Any],
    *,
    model: nn.Module | None = None,
    epoch_transitions_only: bool = False,
    base_max_lr: float = 1e-5,
    monitor: str = "val_loss",
    patience: int = 3,
    min_delta: float = 0.0,
    mode: str = "min",
    bn: str = "train",
) -> dict[str, Any]:
    """An isolate spec (as plain data) doing what a finetuning-scheduler schedule does.

    Args:
        schedule: the FTS schedule, as loaded from its YAML (phase number -> phase).
        model: resolve regexes to the model's parameter names exactly as FTS does
            (``re.match``); without it, simple regexes become globs (:func:`regex_to_glob`).
        epoch_transitions_only: FTS's option: phases end at ``max_transition_epoch`` only.
        base_max_lr: FTS's lr for phases that set none.
        monitor: the metric of the run's ``FTSEarlyStopping``.
        patience: its ``patience``.
        min_delta: its ``min_delta``.
        mode: its ``mode``.
        bn: ``"train"`` as FTS's default ``frozen_bn_track_running_stats=True`` (frozen
            BatchNorm layers keep updating their statistics); ``"eval"`` holds them.

    Returns:
        A mapping for :meth:`isolate.IsolationSpec.from_dict`, also usable as the
        ``init_args`` of :class:`isolate.lightning.IsolationCallback`.

    Raises:
        SpecError: an unknown or unsupported key, phases that are not 0..N, a phase without
            a transition under ``epoch_transitions_only``, or a regex with no glob form.

    >>> fts = {
    ...     0: {"params": ["head.weight", "head.bias"], "max_transition_epoch": 2},
    ...     1: {"params": [r"trunk\\.1\\..*"], "lr": 1e-4},
    ... }
    >>> spec = from_finetuning_scheduler(fts)
    >>> spec["freeze"], spec["thaw"]
    (['*', '!head.weight', '!head.bias'], [{'select': ['trunk.1.*'], 'name': 'phase_1', \
'lr': 0.0001, 'monitor': 'val_loss', 'patience': 3, 'epoch': 2}])
    """
    phases = _phases(schedule)
    names = [n for n, _ in model.named_parameters()] if model is not None else None
    thaw: list[dict[str, Any]] = []
    freeze: list[str] = ["*"]
    for depth in range(len(phases)):
        phase = _phase(phases[depth], depth)
        selectors = _selectors(phase.get("params"), depth, names)
        if depth == 0:
            freeze += ["!" + s for s in selectors]  # phase 0 trains from the start
            continue
        step: dict[str, Any] = {"select": selectors, "name": f"phase_{depth}"}
        step["lr"] = float(phase.get("lr", base_max_lr))
        latest = phases[depth - 1].get("max_transition_epoch", -1)
        if not epoch_transitions_only:
            step.update(monitor=monitor, patience=patience)
            if min_delta:
                step["min_delta"] = min_delta
            if mode != "min":
                step["mode"] = mode
            if depth > 1:  # one FTSEarlyStopping for every phase: its best score carries
                step["carry_best"] = True
        elif latest is None or latest < 0:
            raise SpecError(
                f"{_CALLER}: epoch_transitions_only, but phase {depth - 1} has no "
                f"max_transition_epoch, so phase {depth} would never start; set one"
            )
        if latest is not None and latest >= 0:
            step["epoch"] = int(latest)
        if depth > 1:  # FTS moves on at most one phase per epoch start
            step["after_previous"] = 1
        thaw.append(step)
    return {"freeze": freeze, "bn": bn, "thaw": thaw}


DESCRIPTION = """\
Convert a finetuning-scheduler schedule file to an isolate spec (YAML), phase by phase:
phase 0 trains from the start, each later phase is a thaw with its lr, ending at a plateau
of --monitor or at the phase before's max_transition_epoch. Regexes that have no glob form
are resolved against the model's parameter names with --model:

    isolate migrate Model_ft_schedule.yaml > isolation.yaml
    isolate migrate Model_ft_schedule.yaml --model my_project.models:build_model
"""
"""What ``isolate migrate --help`` says, with examples (kept as written)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``isolate migrate``."""
    parser.add_argument(
        "schedule", help="the finetuning-scheduler schedule file (e.g. Model_ft_schedule.yaml)"
    )
    parser.add_argument(
        "--model",
        metavar="module:callable",
        default=None,
        help="build the model (called without arguments) and resolve the schedule's regexes "
        "against its parameter names, exactly as finetuning-scheduler does",
    )
    parser.add_argument(
        "--epoch-transitions-only",
        action="store_true",
        help="phases move only at max_transition_epoch, as FTS's epoch_transitions_only",
    )
    parser.add_argument(
        "--base-max-lr",
        type=float,
        default=1e-5,
        help="lr of phases that give none (FTS's base_max_lr; default 1e-5)",
    )
    parser.add_argument(
        "--monitor", default="val_loss", help="metric that ends a phase (default val_loss)"
    )
    parser.add_argument(
        "--patience", type=int, default=3, help="checks without improvement (default 3)"
    )


def run(args: argparse.Namespace) -> int:
    """``isolate migrate fts_schedule.yaml``: print the equivalent isolate spec as YAML."""
    import yaml  # only here: isolate itself does not need PyYAML

    with open(args.schedule, encoding="utf-8") as f:
        try:
            fts = yaml.safe_load(f)
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise SpecError(
                f"{args.schedule} is not valid YAML{at}: {getattr(error, 'problem', error)}; "
                f"fix the file (a finetuning-scheduler schedule maps phase numbers to params)"
            ) from None
    spec = from_finetuning_scheduler(
        fts,
        model=None if args.model is None else load_model(args.model),
        epoch_transitions_only=args.epoch_transitions_only,
        base_max_lr=args.base_max_lr,
        monitor=args.monitor,
        patience=args.patience,
    )
    sys.stdout.write(to_yaml(spec, f"isolate spec converted from {args.schedule}"))
    return 0
