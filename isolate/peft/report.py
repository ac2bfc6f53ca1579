"""Which tensors of a PEFT model actually train: the answer to read before
``print_trainable_parameters()``, which counts ``requires_grad`` flags.

A tensor trains when its flag is set, the loss's graph reaches it, and an optimizer holds it;
:func:`what_trains` reads the three from :func:`isolate.ledger.ledger` (a walk of the loss's
graph, the optimizer's groups) and sets them beside what PEFT says of the tensor
(:func:`~isolate.peft.layout.layout`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from isolate.errors import IsolationTypeError
from isolate.ledger import Ledger, ledger
from isolate.peft.layout import Layout, Part, layout

__all__ = ["Training", "what_trains"]


class _Expects:
    """What PEFT expects of each tensor, in the ledger's words (its ``spec=``)."""

    def __init__(self, found: Layout) -> None:
        self.found = found

    def expectations(self, model: nn.Module) -> dict[str, str]:
        return {n: "moves" if p.trains else "still" for n, p in self.found.parts.items()}


@dataclass(frozen=True)
class Training:
    """What :func:`what_trains` found.

    Attributes:
        layout: what PEFT says of each tensor.
        ledger: the :class:`~isolate.ledger.Ledger` of the model, loss and optimizer.
        flagged: the names with ``requires_grad`` (what ``print_trainable_parameters``
            counts).
        training: the flagged names the loss reaches and an optimizer holds.
        idle: flagged name -> why it does not train (not reached, in no optimizer).
        wrong: name -> why PEFT would not train it this way (a base tensor or an inactive
            adapter that trains, an active adapter tensor that does not).
    """

    layout: Layout
    ledger: Ledger
    flagged: tuple[str, ...]
    training: tuple[str, ...]
    idle: Mapping[str, str]
    wrong: Mapping[str, str]

    def numel(self, names: Sequence[str]) -> int:
        return sum(self.layout.params[n].numel() for n in names)

    def summary_line(self) -> str:
        total = self.numel(list(self.layout.params))
        flagged, training = self.numel(self.flagged), self.numel(self.training)
        return (
            f"flagged trainable {flagged:,} of {total:,} parameters in {len(self.flagged)} "
            f"tensors (print_trainable_parameters counts these); really training {training:,} "
            f"in {len(self.training)} tensors; idle {len(self.idle)}; against PEFT's intent "
            f"{len(self.wrong)}"
        )

    def __str__(self) -> str:
        lines = []
        for name in self.training:
            lines.append(f"  trains  {name}: {self.layout.parts[name].describe()}")
        for name, why in self.idle.items():
            lines.append(f"  idle    {name}: {self.layout.parts[name].describe()}; {why}")
        for name, why in self.wrong.items():
            lines.append(f"  WRONG   {name}: {why}")
        return "\n".join([*lines, self.summary_line()])


def what_trains(
    model: nn.Module,
    loss: torch.Tensor | Mapping[str, torch.Tensor],
    optimizer: object = None,
) -> Training:
    """Which tensors of a PEFT model really train: flag set, reached by ``loss``, held by
    ``optimizer``; beside what PEFT means of each. Changes nothing; no backward pass.

    Args:
        model: the PEFT model.
        loss: the loss (or losses by name) of one step, graph alive.
        optimizer: the optimizer (or a list of them); ``None``: not checked.

    Returns:
        A :class:`Training`; ``str()`` of it lists each flagged tensor and ends in the
        summary line.

    Raises:
        IsolationTypeError: ``loss`` is neither a tensor nor a mapping (``None`` included).

    >>> import torch
    >>> from torch import nn
    >>> from peft import LoraConfig, get_peft_model
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"], modules_to_save=["2"]))
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad][:2])
    >>> found = what_trains(model, model(torch.randn(3, 4)).sum(), opt)
    >>> print(found.summary_line())
    flagged trainable 26 of 56 parameters in 4 tensors (print_trainable_parameters counts these); really training 16 in 2 tensors; idle 2; against PEFT's intent 0
    >>> found.idle["base_model.model.2.modules_to_save.default.weight"]
    'in no optimizer'
    """  # noqa: E501
    if not (torch.is_tensor(loss) or isinstance(loss, Mapping)):
        raise IsolationTypeError(
            f"what_trains(): loss must be the loss tensor of one step (graph alive) or a "
            f"mapping of names to loss tensors, got {type(loss).__name__}; pass e.g. "
            f"what_trains(model, model(**batch).loss, optimizer)"
        )
    found = layout(model, caller="what_trains()")
    book = ledger(
        model,
        loss if isinstance(loss, Mapping) else {"loss": loss},
        optimizer,
        spec=_Expects(found),
        caller="what_trains()",
    )
    rows = {r.name: r for r in book.rows}
    flagged = tuple(n for n in found.parts if found.params[n].requires_grad)
    idle: dict[str, str] = {}
    for name in flagged:
        row = rows[name]
        why = []
        if not row.reached_by:
            why.append("no loss reaches it")
        if optimizer is not None and row.optimizer is None:
            why.append("in no optimizer")
        if why:
            idle[name] = " and ".join(why)
    training = tuple(n for n in flagged if n not in idle)
    wrong = {n: _wrong(found.parts[n], found.params[n].requires_grad) for n in found.parts}
    return Training(
        layout=found,
        ledger=book,
        flagged=flagged,
        training=training,
        idle=idle,
        wrong={n: w for n, w in wrong.items() if w},
    )


def _wrong(part: Part, flag: bool) -> str:
    if flag and not part.trains:
        return f"requires grad, but it is the {part.describe()}"
    if part.trains and not flag:
        return f"does not require grad, but it is the {part.describe()}"
    return ""
