"""One truthful ledger of a model's parameters: what is true of each, from every audit at once.

:func:`ledger` gives one row per parameter tensor: its size and ``requires_grad``, which losses
reach it (from a walk of their graphs, not from flags), the optimizer group that holds it (lr,
weight decay, whether momentum state is there), the mode of its module, and what a spec expects
of it. A row that contradicts itself (trainable but in no optimizer, frozen but reached, frozen
in a group whose weight decay still moves it, trainable but cut off, trainable where the spec
says still) is flagged irregular, with the reasons. ``str(ledger)`` is a table that ends in the
summary line; ``ledger.to_dict()`` is plain data for loggers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from isolate._autograd import check_losses, refuse_raising, walk
from isolate._holding import held_policy
from isolate._selectors import check_module, select
from isolate._sharding import check_leaves, sharded_view
from isolate._walker import Names, Tree
from isolate.errors import IsolationTypeError, SelectorError
from isolate.exposure import MOMENTUM_STATE, unwrap_optimizer, zero_grad_risks

__all__ = ["EXPECTATIONS", "Ledger", "Row", "ledger"]

EXPECTATIONS = ("still", "moves", "ema", "rows")
"""What a plain mapping given as ``spec=`` may expect of the parameters a selector picks:
to stay still, to move, to follow an EMA rule (not gradients), or to move in some rows only."""

_STILL = ("still", "ema")  # expectations a trainable parameter contradicts

Slot = tuple[int, int, Mapping[str, Any], Mapping[str, Any], torch.optim.Optimizer, torch.Tensor]
"""Where an optimizer holds a parameter: optimizer, group index, group, state, the optimizer
and the parameter."""


@dataclass(frozen=True)
class Row:
    """One parameter tensor in the :class:`Ledger` (a tied tensor once, by its first name).

    Attributes:
        name: its ``state_dict`` key.
        numel: its number of elements.
        requires_grad: its flag.
        reached_by: the losses whose graph reaches it; ``None`` when no loss was given.
        optimizer: the index of the optimizer that holds it (``None``: none does, or none was
            given); ``group`` the param group's index, ``lr`` and ``weight_decay`` its settings.
        momentum: whether its optimizer state holds a momentum buffer or Adam's first moment.
        mode: ``"train"`` or ``"eval"``, the flag of the module that holds it; ``"eval (held)"``
            when a freeze holds that module in eval mode whatever the flag says.
        expects: what the spec expects of it (``None`` without a spec).
        reasons: why the row contradicts itself; empty for a regular row.
    """

    name: str
    numel: int
    requires_grad: bool
    reached_by: tuple[str, ...] | None = None
    optimizer: int | None = None
    group: int | None = None
    lr: float | None = None
    weight_decay: float | None = None
    momentum: bool | None = None
    mode: str = "train"
    expects: str | None = None
    reasons: tuple[str, ...] = ()

    @property
    def irregular(self) -> bool:
        return bool(self.reasons)

    @property
    def status(self) -> str:
        """``"irregular"``, else ``"trains"`` or ``"frozen"``."""
        if self.reasons:
            return "irregular"
        return "trains" if self.requires_grad else "frozen"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["reached_by"] = None if self.reached_by is None else list(self.reached_by)
        out["reasons"] = list(self.reasons)
        out["status"] = self.status
        return out


@dataclass(frozen=True)
class Ledger:
    """Every parameter tensor of a model and what is true of it; see :func:`ledger`.

    Attributes:
        rows: one :class:`Row` per parameter tensor, in model order.
        losses: the loss names walked, or ``None`` when none was given.
        optimizers: how many optimizers were searched (``None``: none was given).
    """

    rows: tuple[Row, ...]
    losses: tuple[str, ...] | None = None
    optimizers: int | None = None

    @property
    def irregular(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.irregular)

    def summary(self) -> dict[str, Any]:
        """The counts of the summary line, as numbers."""
        trainable = [r for r in self.rows if r.requires_grad]
        reached = [r for r in trainable if r.reached_by]
        total = sum(r.numel for r in self.rows)
        numel = sum(r.numel for r in trainable)
        return {
            "parameters": total,
            "trainable": numel,
            "trainable_fraction": numel / total if total else 0.0,
            "tensors": len(self.rows),
            "trainable_tensors": len(trainable),
            "reached_tensors": None if self.losses is None else len(reached),
            "irregular": len(self.irregular),
        }

    def summary_line(self) -> str:
        """``trainable 2,048 of 117,056 parameters (1.75%) in 8 tensors; reached 8 of 8;
        irregular 0``."""
        s = self.summary()
        reached = "n/a (no losses)" if s["reached_tensors"] is None else s["reached_tensors"]
        return (
            f"trainable {s['trainable']:,} of {s['parameters']:,} parameters "
            f"({100 * s['trainable_fraction']:.2f}%) in {s['trainable_tensors']} tensors; "
            f"reached {reached} of {s['trainable_tensors']}; irregular {s['irregular']}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the rows, the losses and the summary."""
        return {
            "rows": [r.to_dict() for r in self.rows],
            "losses": None if self.losses is None else list(self.losses),
            "summary": self.summary(),
        }

    def format(self, *, limit: int | None = None) -> str:
        """The table; with ``limit``, that many rows at most, or every irregular row (first)
        if there are more."""
        rows = list(self.rows)
        if limit is not None and len(rows) > limit:
            regular = [r for r in rows if not r.irregular]
            rows = [*self.irregular, *regular][: max(limit, len(self.irregular))]
        header = ["name", "numel", "grad", "reached by", "optimizer", "lr", "wd", "momentum"]
        header += ["mode", "expects", "status"]
        cells = [header, *(_cells(r) for r in rows)]
        widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)).rstrip()
            for cell in cells
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if len(rows) < len(self.rows):
            lines.append(f"... and {len(self.rows) - len(rows)} more rows")
        for r in self.irregular:
            lines.append(f"irregular {r.name}: {'; '.join(r.reasons)}")
        return "\n".join([*lines, self.summary_line()])

    def __str__(self) -> str:
        return self.format()


def _cells(r: Row) -> list[str]:
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    held = "-" if r.optimizer is None else f"{r.optimizer}/{r.group}"
    reached = "n/a" if r.reached_by is None else ",".join(r.reached_by) or "none"
    momentum = "-" if r.momentum is None else "yes" if r.momentum else "no"
    return [
        r.name,
        f"{r.numel:,}",
        "yes" if r.requires_grad else "no",
        reached,
        held,
        num(r.lr),
        num(r.weight_decay),
        momentum,
        r.mode,
        r.expects or "-",
        r.status,
    ]


def _named_losses(losses: object, caller: str) -> dict[str, torch.Tensor]:
    if isinstance(losses, Mapping):
        bad = [k for k, v in losses.items() if not isinstance(k, str) or not torch.is_tensor(v)]
        if bad:
            raise IsolationTypeError(f"{caller}: losses must map names to tensors; got {bad[0]!r}")
        return dict(losses)
    tensors = check_losses(losses, caller)
    return (
        {"loss": tensors[0]}
        if len(tensors) == 1
        else {f"loss[{i}]": t for i, t in enumerate(tensors)}
    )


def _optimizers(optimizer: object, caller: str) -> list[torch.optim.Optimizer]:
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return [unwrap_optimizer(o, caller) for o in items]


def _expectations(model: nn.Module, spec: object, names: Names, caller: str) -> dict[str, str]:
    """Parameter key -> what ``spec`` expects: from its ``expectations(model)``, or from a
    mapping of selectors to one of :data:`EXPECTATIONS`."""
    method = getattr(spec, "expectations", None)
    if callable(method):
        found = method(model)
        return {str(k): str(v) for k, v in dict(found).items()}
    if not isinstance(spec, Mapping):
        raise IsolationTypeError(
            f"{caller}: spec must be an isolate spec or handle (with .expectations(model)) or a "
            f"mapping of selectors to {list(EXPECTATIONS)}, got {type(spec).__name__}"
        )
    out: dict[str, str] = {}
    for selector, expected in spec.items():
        if expected not in EXPECTATIONS:
            raise SelectorError(
                f"{caller}: spec[{selector!r}] = {expected!r} is not an expectation; use one of "
                f"{list(EXPECTATIONS)}"
            )
        for p in select(model, (selector,), f"{caller}(spec[{selector!r}])").params.values():
            out[names.of_id[id(p)]] = str(expected)
    return out


def ledger(
    model: nn.Module,
    losses: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None = None,
    optimizer: object = None,
    spec: object = None,
    *,
    caller: str = "ledger()",
) -> Ledger:
    """One row per parameter tensor of ``model``: what is true of it, and what contradicts.

    Args:
        model: the module.
        losses: a loss, several, or a mapping of names to losses, graphs alive: which of them
            reach each parameter comes from a walk of their graphs (no backward pass).
        optimizer: an optimizer (or a wrapper with ``.optimizer``), or a list of them.
        spec: what is expected of each parameter: an :class:`~isolate.IsolationSpec` or an
            applied handle (anything with ``expectations(model)``, parameter key -> text), or
            a mapping of selectors to one of :data:`EXPECTATIONS`.
        caller: how messages name the call (a function built on this one passes its own).

    Returns:
        A :class:`Ledger`; ``str()`` of it is the table with the summary line at the end.

    Raises:
        IsolationTypeError: an argument has the wrong type.
        SelectorError: a selector of a mapping ``spec`` matches nothing, or maps to no
            expectation.
        ShardedGraphError: the graph's leaves stand for parameters it cannot map back.

    Note:
        A row is irregular when it is trainable but in no optimizer given, trainable but no
        loss given reaches it, frozen but reached (its flag changed after the forward), frozen
        in a group whose weight decay or momentum moves it even with a zero gradient, held by
        several optimizer groups, trainable where the spec expects it still (or to follow an
        EMA), frozen where the spec expects it to move, or trainable where a mapping spec
        says nothing.

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    >>> _ = model[0].requires_grad_(False)
    >>> opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    >>> book = ledger(model, model(torch.randn(3, 4)).sum(), opt)
    >>> print(book.summary_line())
    trainable 10 of 30 parameters (33.33%) in 2 tensors; reached 2 of 2; irregular 0
    >>> [r.status for r in book.rows]
    ['frozen', 'frozen', 'trains', 'trains']
    """
    check_module(model, caller)
    names = Names.of(model)
    named = None if losses is None else _named_losses(losses, caller)
    opts = None if optimizer is None else _optimizers(optimizer, caller)
    expects = None if spec is None else _expectations(model, spec, names, caller)
    reached: dict[int, list[str]] = {}
    for loss_name, loss in (named or {}).items():
        found = walk([loss], caller)
        refuse_raising(found, caller, walk_only=True)
        check_leaves(found, [model], caller)
        for key in found.leaves:
            reached.setdefault(key, []).append(loss_name)
    held: dict[int, list[Slot]] = {}
    for oi, opt in enumerate(opts or ()):
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                held.setdefault(id(p), []).append((oi, gi, group, opt.state.get(p, {}), opt, p))
    view = sharded_view([model], caller)  # an FSDP2 unit may hold its unsharded temporaries
    owners = {
        id(view.canonical(p)): m
        for _, m in Tree.of(model).modules
        for p in m._parameters.values()
        if p is not None
    }
    rows = [
        _row(key, p, named, opts, held.get(id(p), []), reached.get(id(p)), owners[id(p)], expects)
        for key, p in names.params.items()
    ]
    return Ledger(
        tuple(rows), None if named is None else tuple(named), None if opts is None else len(opts)
    )


def _row(
    key: str,
    p: nn.Parameter,
    named: Mapping[str, torch.Tensor] | None,
    opts: Sequence[torch.optim.Optimizer] | None,
    slots: list[Slot],
    reached: list[str] | None,
    owner: nn.Module,
    expects: Mapping[str, str] | None,
) -> Row:
    reasons: list[str] = []
    trainable = p.requires_grad
    by = None if named is None else tuple(reached or ())
    if opts is not None:
        if trainable and not slots:
            reasons.append("trainable but in no optimizer")
        if len(slots) > 1:
            reasons.append(f"held by {len(slots)} optimizer groups")
        for oi, gi, group, _, opt, param in slots:
            risks = () if trainable else zero_grad_risks(opt, group, param)
            if risks:
                reasons.append(f"frozen but in optimizer {oi} group {gi}, where {'; '.join(risks)}")
    if by is not None:
        if trainable and not by:
            reasons.append("trainable but cut off: no loss reaches it")
        if not trainable and by:
            reasons.append(f"frozen but reached by {', '.join(by)}")
    expected = None if expects is None else expects.get(key)
    if expects is not None:
        kind = (expected or "").split(" ")[0].lower()
        if trainable and expected is None:
            reasons.append("trainable but not in the spec")
        elif trainable and kind in _STILL:
            reasons.append(f"trainable but the spec expects it {expected}")
        elif not trainable and kind in ("moves", "rows"):
            reasons.append(f"frozen but the spec expects it to move ({expected})")
    first = slots[0] if slots else None
    kept = first[3] if first else None
    mode = "eval (held)" if held_policy(owner) == "eval" else "train" if owner.training else "eval"
    return Row(
        name=key,
        numel=p.numel(),
        requires_grad=trainable,
        reached_by=by,
        optimizer=first[0] if first else None,
        group=first[1] if first else None,
        lr=float(first[2]["lr"]) if first and "lr" in first[2] else None,
        weight_decay=float(first[2].get("weight_decay", 0.0)) if first else None,
        momentum=None if kept is None else any(k in kept for k in MOMENTUM_STATE),
        mode=mode,
        expects=expected,
        reasons=tuple(reasons),
    )
