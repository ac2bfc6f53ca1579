"""The ``ema`` contract: a target network that is the exponential moving average of another.

Checking "the target equals the EMA of the online network after each optimizer step" needs
the target's values from before the update: :class:`Ema` copies the target and the online
network at the start of a check step (:meth:`Ema.open`) and compares at the start of the next
one (:meth:`Ema.close`), after the step and its EMA update, wherever the training code does
the update (after ``optimizer.step()`` like timm, or at the start of the next forward like
MoCo). The copies live on the tensors' device for one step only: two copies of each network,
every check step; that memory and one pass over both networks are the check's cost.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from isolate._text import shown
from isolate._walker import Names
from isolate.errors import SpecError
from isolate.spec.contract_clauses import (
    Clauses,
    Context,
    Outcome,
    module_of,
    no_loss_reaches,
    no_optimizer_holds,
)
from isolate.spec.contracts import Contract

__all__ = ["Ema"]

_COMPILED = "_orig_mod."  # torch.compile's wrapper prefixes every key of the module it holds


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    names = Names.of(module)
    return {k.replace(_COMPILED, ""): t for k, t in {**names.params, **names.buffers}.items()}


class Ema(Clauses):
    """``{kind: ema, target, online, decay, integers}``."""

    def __init__(self, contract: Contract, model: nn.Module, names: Names, caller: str) -> None:
        super().__init__(contract, model, names, caller)
        self.target = module_of(model, str(contract.target), self.where)
        self.online = module_of(model, str(contract.online), self.where)
        target, online = _tensors(self.target), _tensors(self.online)
        if set(target) != set(online):
            only_t, only_o = sorted(set(target) - set(online)), sorted(set(online) - set(target))
            raise SpecError(
                f"{self.where}: the target {contract.target!r} and the online network "
                f"{contract.online!r} hold different tensors: only the target has "
                f"{shown(only_t)}, only the online network {shown(only_o)}; an EMA pairs them "
                f"by name"
            )
        bad = [k for k in target if target[k].shape != online[k].shape]
        if bad:
            raise SpecError(f"{self.where}: {shown(bad)} differ in shape between the networks")
        self.params = {names.name(p): p for p in self.target.parameters()}
        self.moving = frozenset(
            names.of_id[id(t)]
            for t in [*self.target.parameters(), *self.target.buffers()]
            if id(t) in names.of_id
        )
        kept = "copied from the online network" if contract.integers == "copy" else "kept"
        self.CLAUSES = (
            "gets no gradient",
            "in no optimizer",
            "equals the EMA of the online network",
            "moves",
            f"integer buffers are {kept}",
        )
        self._start: int | None = None
        self._copies: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None

    def graph(self, ctx: Context) -> list[Outcome]:
        return no_loss_reaches(ctx, self.contract, "gets no gradient", self.params)

    def state(self, ctx: Context) -> list[Outcome]:
        return no_optimizer_holds(ctx, self.contract, "in no optimizer", self.params)

    def open(self, step: int, model: nn.Module) -> None:
        if self._start is None:
            self._start = step
            with torch.no_grad():
                self._copies = (
                    {k: t.detach().clone() for k, t in _tensors(self.target).items()},
                    {k: t.detach().clone() for k, t in _tensors(self.online).items()},
                )

    def due(self, step: int) -> bool:
        return self._start is not None and step > self._start

    def release(self) -> None:
        self._start, self._copies = None, None

    def close(self, ctx: Context) -> list[Outcome]:
        assert self._copies is not None  # due() was true
        (target_a, online_a), start = self._copies, self._start
        self._copies, self._start = None, None
        target_b, online_b = _tensors(self.target), _tensors(self.online)
        decay = float(self.contract.decay or 0.0)
        floats = [k for k, t in target_a.items() if t.is_floating_point() or t.is_complex()]
        ints = [k for k in target_a if k not in floats]
        off: dict[str, dict[str, float]] = {}
        for rule, online in (("after", online_b), ("before", online_a)):
            off[rule] = dict(_deviations(target_a, target_b, online, floats, decay))
            if not off[rule]:
                return [
                    (self.CLAUSES[2], None),
                    (self.CLAUSES[3], None),
                    *self._ints(ctx, target_a, target_b, online, ints),
                ]
        # Neither the online values after the step nor those before it explain the target.
        worst = off["after"]
        still = [k for k in worst if torch.equal(target_a[k], target_b[k])]
        moved = {k: d for k, d in worst.items() if k not in still}
        span = f"over optimizer step {start} (decay {decay:g})"
        out: list[Outcome] = []
        if moved:
            listed = [
                f"{k} ({_kind(self.target, k)}, off by {d:.2g} x tolerance)"
                for k, d in moved.items()
            ]
            detail = f"{shown(listed)} moved by another rule {span}"
            out.append((self.CLAUSES[2], ctx.fail(self.contract, self.CLAUSES[2], detail)))
        else:
            out.append((self.CLAUSES[2], None))
        if still:
            listed = [f"{k} ({_kind(self.target, k)})" for k in still]
            detail = f"{shown(listed)} did not move {span}, while the EMA moves them"
            out.append((self.CLAUSES[3], ctx.fail(self.contract, self.CLAUSES[3], detail)))
        else:
            out.append((self.CLAUSES[3], None))
        return [*out, *self._ints(ctx, target_a, target_b, online_b, ints)]

    def _ints(
        self,
        ctx: Context,
        target_a: dict[str, torch.Tensor],
        target_b: dict[str, torch.Tensor],
        online: dict[str, torch.Tensor],
        ints: list[str],
    ) -> list[Outcome]:
        clause = self.CLAUSES[4]
        if not ints:
            return []
        source = online if self.contract.integers == "copy" else target_a
        wrong = [k for k in ints if not torch.equal(target_b[k], source[k].to(target_b[k].device))]
        if not wrong:
            return [(clause, None)]
        listed = [f"{k} = {_value(target_b[k])}, expected {_value(source[k])}" for k in wrong]
        return [(clause, ctx.fail(self.contract, clause, shown(listed)))]


def _deviations(
    target_a: dict[str, torch.Tensor],
    target_b: dict[str, torch.Tensor],
    online: dict[str, torch.Tensor],
    floats: list[str],
    decay: float,
) -> Iterator[tuple[str, float]]:
    """Each float tensor whose value is not ``decay * target_a + (1 - decay) * online`` within
    the dtype's rounding, and by how many tolerances it is off at worst."""
    with torch.no_grad():
        for k in floats:
            new = target_b[k].detach()
            dtype = torch.promote_types(new.dtype, torch.float32)  # half precision: in float32
            old = target_a[k].to(new.device, dtype)
            source = online[k].detach().to(new.device, dtype)
            expected = torch.lerp(old, source, 1 - decay)
            finfo = torch.finfo(new.dtype)
            # An EMA step rounds a few times (a multiply and an add, or a lerp) at the scale of
            # its operands, and so does the expected value computed here: 4 roundings of the
            # sum of their sizes bound both.
            tol = (old.abs() + source.abs() + new.abs()).mul_(4 * finfo.eps).add_(finfo.tiny)
            ratio = float((new.to(dtype) - expected).abs_().div_(tol).max()) if new.numel() else 0.0
            if not ratio <= 1.0:
                yield k, ratio


def _kind(module: nn.Module, key: str) -> str:
    return "buffer" if key in dict(module.named_buffers()) else "parameter"


def _value(t: torch.Tensor) -> str:
    return str(t.item()) if t.numel() == 1 else f"tensor of shape {tuple(t.shape)}"
