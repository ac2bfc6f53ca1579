"""Default thaw schedules written from a model's structure, as YAML.

:func:`default_schedule` writes a starting schedule from a model's structure (one phase per
top-level block, from the head backwards); ``isolate schedule package.module:build_model``
prints it as YAML.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import pkgutil
import re
import sys
from collections.abc import Mapping
from typing import Any

from torch import nn

from isolate._text import did_you_mean
from isolate.errors import SpecError

__all__ = ["DESCRIPTION", "add_arguments", "default_schedule", "load_model", "run", "to_yaml"]


def _blocks(model: nn.Module) -> tuple[str, list[str]]:
    """The top-level blocks holding parameters, below any single-child wrappers."""
    prefix = ""
    module = model
    while True:
        children = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(children) == 1 and not any(True for _ in module.parameters(recurse=False)):
            prefix += children[0][0] + "."
            module = children[0][1]
            continue
        return prefix, [prefix + n for n, _ in children]


def default_schedule(
    model: nn.Module, *, monitor: str | None = "val_loss", patience: int = 3
) -> dict[str, Any]:
    """A starting schedule for ``model``: the last top-level block (the head) trains, every
    other block is frozen and thawed one phase at a time, from the head backwards.

    Args:
        model: the model (a LightningModule is looked through to its single child holding
            all parameters, if there is one).
        monitor: the metric whose plateau ends each phase; ``None`` thaws one block per epoch.
        patience: checks without improvement that end a phase.

    Returns:
        A mapping for :meth:`isolate.IsolationSpec.from_dict` (the same keys as the callback's
        ``init_args``).

    Raises:
        SpecError: the model has fewer than two top-level blocks holding parameters.

    >>> net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 1))
    >>> default_schedule(net, monitor=None)["thaw"]
    [{'select': '2', 'epoch': 1}, {'select': '0', 'epoch': 2}]
    """
    prefix, blocks = _blocks(model)
    if len(blocks) < 2:
        raise SpecError(
            f"default_schedule(): {type(model).__name__} has {len(blocks)} top-level block(s) "
            f"with parameters under {repr(prefix[:-1]) if prefix else 'the root'}; a phased "
            f"schedule needs a head and at least one block before it. Write the schedule by hand"
        )
    *body, _head = blocks
    thaw: list[dict[str, Any]] = []
    for i, name in enumerate(reversed(body), start=1):
        step: dict[str, Any] = {"select": name}
        if monitor is None:
            step["epoch"] = i
        else:
            step.update(monitor=monitor, patience=patience)
        thaw.append(step)
    return {"freeze": list(body), "thaw": thaw}


# A string YAML reads back as itself when written bare, also inside [...] and {...}: it starts
# with a letter (not a number, an indicator or a quote), holds no flow indicator ('[', ',',
# '?', ...), no space or '#', and is not a word YAML reads as a boolean or null. Any other
# string is written as a JSON string, which YAML reads as the same string.
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.*:/<>+=-]*")
_WORDS = {"null", "true", "false", "yes", "no", "on", "off", "y", "n"}


def to_yaml(schedule: Mapping[str, Any], header: str = "") -> str:
    """A schedule mapping as YAML, one thaw step per line (plain data only, no PyYAML needed).

    >>> print(to_yaml({"freeze": ["a"], "thaw": [{"select": "a", "epoch": 1, "lr": 1e-5}]}), end="")
    freeze: [a]
    thaw:
      - {select: a, epoch: 1, lr: 1.0e-05}
    """

    def scalar(value: object) -> str:
        if isinstance(value, str):
            plain = _PLAIN.fullmatch(value) and value[-1] != ":" and value.lower() not in _WORDS
            return value if plain else json.dumps(value, ensure_ascii=False)
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(scalar(v) for v in value) + "]"
        if isinstance(value, float):
            if not math.isfinite(value):
                return {"inf": ".inf", "-inf": "-.inf"}.get(repr(value), ".nan")
            mantissa, e, exponent = repr(value).partition("e")
            if e and "." not in mantissa:  # PyYAML reads 1e-05 as a string, 1.0e-05 as a float
                return f"{mantissa}.0e{exponent}"
        return repr(value)

    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for key, value in schedule.items():
        if key == "thaw":
            lines.append("thaw:")
            for step in value:
                items = ", ".join(f"{k}: {scalar(v)}" for k, v in step.items())
                lines.append(f"  - {{{items}}}")
        elif isinstance(value, list):
            lines.append(f"{key}: [{', '.join(scalar(v) for v in value)}]")
        else:
            lines.append(f"{key}: {scalar(value)}")
    return "\n".join(lines) + "\n"


DESCRIPTION = """\
Print a default thaw schedule (YAML) for a model: the head trains, the blocks before it
thaw one phase at a time, from the head backwards. Edit it, then use it as the init_args of
isolate.lightning.IsolationCallback, or with IsolationSpec.from_dict(yaml.safe_load(...)):

    isolate schedule torchvision.models:resnet18 > schedule.yaml
    isolate schedule my_project.models:build_model --by-epoch
"""
"""What ``isolate schedule --help`` says, with examples (kept as written)."""


def _import(spec: str, module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if not (module_name == missing or module_name.startswith(missing + ".")):
            raise SpecError(
                f"{spec}: importing {module_name} needs {missing!r}, which is not installed; "
                f"install it"
            ) from None
        parent, _, leaf = missing.rpartition(".")
        try:
            path = getattr(importlib.import_module(parent), "__path__", None) if parent else None
        except ImportError:
            path = None
        found = [m.name for m in pkgutil.iter_modules(path)] if path or not parent else []
        raise SpecError(
            f"{spec}: no module named {missing!r}{did_you_mean(leaf, found)} (run from the folder "
            f"that holds it, or put that folder on PYTHONPATH)"
        ) from None


def load_model(spec: str) -> nn.Module:
    """The model that ``spec`` (``package.module:callable``) names: the callable called
    without arguments, or a module-level ``nn.Module`` as it is.

    Args:
        spec: for example ``torchvision.models:resnet18``.

    Returns:
        The model.

    Raises:
        SpecError: ``spec`` is not ``module:callable``, the module does not import, the
            attribute does not exist (with the close names), or it gives no ``nn.Module``.

    >>> type(load_model("torch.nn:Identity")).__name__
    'Identity'
    >>> load_model("torch.nn:Identiti")
    Traceback (most recent call last):
    ...
    isolate.errors.SpecError: torch.nn:Identiti: torch.nn has no attribute 'Identiti'; did \
you mean 'Identity'? (give module:callable, a callable that returns the model)
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise SpecError(
            f"expected module:callable (e.g. torchvision.models:resnet18), got {spec!r}"
        )
    module = _import(spec, module_name)
    factory = getattr(module, attribute, None)
    if factory is None:
        names = [n for n in dir(module) if not n.startswith("_")]
        raise SpecError(
            f"{spec}: {module_name} has no attribute {attribute!r}{did_you_mean(attribute, names)} "
            f"(give module:callable, a callable that returns the model)"
        )
    if isinstance(factory, nn.Module):
        return factory
    if not callable(factory):
        raise SpecError(f"{spec}: {type(factory).__name__} is not callable; give a model factory")
    try:
        model = factory()
    except TypeError as error:
        raise SpecError(
            f"{spec}: calling it without arguments failed ({error}); give a callable that "
            f"builds the model on its own (a function of your own around it)"
        ) from None
    if not isinstance(model, nn.Module):
        raise SpecError(f"{spec}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``isolate schedule``."""
    parser.add_argument(
        "factory",
        metavar="module:callable",
        help="what builds the model, called without arguments (e.g. torchvision.models:resnet18)",
    )
    parser.add_argument(
        "--monitor", default="val_loss", help="metric whose plateau ends a phase (default val_loss)"
    )
    parser.add_argument(
        "--patience", type=int, default=3, help="checks without improvement (default 3)"
    )
    parser.add_argument(
        "--by-epoch", action="store_true", help="one phase per epoch instead of plateaus"
    )


def run(args: argparse.Namespace) -> int:
    """``isolate schedule package.module:build_model``: print a default schedule."""
    model = load_model(args.factory)
    schedule = default_schedule(
        model, monitor=None if args.by_epoch else args.monitor, patience=args.patience
    )
    header = (
        f"Default isolate schedule for {args.factory} ({type(model).__name__}).\n"
        "Phase 0 trains what is not frozen (the head); each thaw step is one more phase.\n"
        "Per step: epoch/step (a fixed time), or monitor/patience/min_delta/mode (a plateau;\n"
        "epoch/step then is the latest), lr, warmup_ratio + warmup_steps|warmup_epochs,\n"
        "warmup_shape, align. Selectors: names, globs, 'type:<Class>', '!' exclusions."
    )
    sys.stdout.write(to_yaml(schedule, header))
    return 0
