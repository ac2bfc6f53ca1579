"""Contracts: what a training method promises about gradients, as plain, checkable data.

A spec's ``contracts`` key is a list of entries, each a ``kind`` and its keys. They are the
semantics everyone knows for a method and nobody writes down, said once, under the method's
name, and checked while training (:mod:`isolate.spec.contract_checks`):

=================  ===========================================================================
kind (keys)        clauses
=================  ===========================================================================
``teacher``        no loss reaches it; none of its tensors is in an optimizer; every module
(``select``)       under it whose forward depends on ``.training`` runs in eval mode; its
                   parameters and buffers stay bitwise still
``ema``            the target gets no gradient and is in no optimizer; after each optimizer
(``target``,       step it equals ``decay * target + (1 - decay) * online`` within the dtype's
``online``,        rounding, floating buffers included, and moves; integer buffers are
``decay``,         ``copy``-ed from the online network or ``keep`` their value
``integers``)
``stop_gradient``  the loss does not reach ``blocked`` (apart from the route through the module
(``loss``,         ``through``: SimSiam's predictor); ``blocked`` is still reached by some loss
``blocked``,
``through``)
``reversal``       the loss reaches the ``features`` through a gradient reversal: its gradient
(``loss``,         at the features' output is ``-scale`` times its gradient at the
``features``,      ``classifier``'s input, and the classifier gets the loss's gradient
``classifier``,    unreversed
``scale``)
``probe``          the probe's loss reaches only the probe; no other loss reaches the probe;
(``select``,       the probe moves within ``within`` optimizer steps
``loss``,
``within``)
``trains``         every selected tensor is reached by the loss backpropagated and changes
(``select``,       within ``within`` optimizer steps
``within``)
=================  ===========================================================================

Every entry may also have a ``name`` (default: the kind and its first selector or loss),
which messages and reports use. Selectors are those of ``freeze``; ``target``, ``online``,
``through``, ``features`` and ``classifier`` name one submodule each.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from isolate.errors import SpecError
from isolate.spec._fields import is_int, number, string_list, under, unknown_keys

__all__ = ["KINDS", "Contract", "contracts_of"]

# kind -> (required keys, optional keys); "name" is optional for every kind.
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "teacher": (("select",), ()),
    "ema": (("target", "online", "decay"), ("integers",)),
    "stop_gradient": (("loss", "blocked"), ("through",)),
    "reversal": (("loss", "features", "classifier", "scale"), ()),
    "probe": (("select", "loss"), ("within",)),
    "trains": (("select", "within"), ()),
}
"""Kind -> (its required keys, its optional keys)."""
_MODULES = ("target", "online", "through", "features", "classifier")  # one submodule each
_SELECTORS = ("select", "blocked")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


@dataclass(frozen=True)
class Contract:
    """One contract of a spec: its ``kind`` and that kind's keys (see the module docstring).

    Raises:
        SpecError: an unknown kind or key (with the closest known one), a missing key, or a
            value of the wrong type.

    >>> Contract("teacher", select=("trunk",)).name
    'teacher:trunk'
    >>> Contract.from_dict({"kind": "ema", "target": "ema", "online": "net", "decay": 0.99})
    Contract(kind='ema', name='ema:ema', target='ema', online='net', decay=0.99, integers='copy')
    >>> Contract.from_dict({"kind": "teachr", "select": "trunk"})
    Traceback (most recent call last):
    ...
    isolate.errors.SpecError: Contract: unknown kind 'teachr' (did you mean 'teacher'?); ...
    """

    kind: str
    name: str = ""
    select: tuple[str, ...] = ()
    target: str | None = None
    online: str | None = None
    decay: float | None = None
    integers: str = "copy"
    loss: str | None = None
    blocked: tuple[str, ...] = ()
    through: str | None = None
    features: str | None = None
    classifier: str | None = None
    scale: float | None = None
    within: int | None = None

    def __post_init__(self) -> None:
        where = "Contract" if not self.name else f"Contract {self.name!r}"
        if self.kind not in KINDS:
            close = difflib.get_close_matches(str(self.kind), list(KINDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpecError(
                f"{where}: unknown kind {self.kind!r}{hint}; the kinds are {sorted(KINDS)}"
            )
        set_ = object.__setattr__
        required, optional = KINDS[self.kind]
        for key in _SELECTORS:
            set_(self, key, string_list(getattr(self, key), key, where))
        given = {k for k in self.keys() if getattr(self, k) not in (None, ())}
        missing = [k for k in required if k not in given]
        if missing:
            raise SpecError(
                f"{where}: {_article(self.kind)} {self.kind} contract needs {missing}; its keys "
                f"are {[*required, *optional, 'name']}"
            )
        stray = sorted(given - set(required) - set(optional) - {"integers"})
        if stray or (self.integers != "copy" and "integers" not in optional):
            raise SpecError(
                f"{where}: {_article(self.kind)} {self.kind} contract has no keys "
                f"{stray or ['integers']}; its keys "
                f"are {[*required, *optional, 'name']}"
            )
        self._check_values(where)
        if not self.name:
            first = self.select or (self.loss or self.target or "",)
            set_(self, "name", f"{self.kind}:{first[0]}")

    def _check_values(self, where: str) -> None:
        for key in _MODULES:
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise SpecError(f"{where}: {key} must name one submodule, got {value!r}")
        if self.loss is not None and (not isinstance(self.loss, str) or not self.loss):
            raise SpecError(f"{where}: loss must be a loss name, got {self.loss!r}")
        if self.decay is not None and not (number(self.decay) and 0 < self.decay < 1):
            raise SpecError(f"{where}: decay must be a number in (0, 1), got {self.decay!r}")
        if self.scale is not None and not (number(self.scale) and self.scale > 0):
            raise SpecError(
                f"{where}: scale must be a number > 0 (the reversal multiplies the gradient "
                f"by -scale), got {self.scale!r}"
            )
        if self.within is not None and not (is_int(self.within) and self.within >= 1):
            raise SpecError(f"{where}: within must be an integer >= 1, got {self.within!r}")
        if self.integers not in ("copy", "keep"):
            raise SpecError(f"{where}: integers must be 'copy' or 'keep', got {self.integers!r}")
        if not isinstance(self.name, str):
            raise SpecError(f"{where}: name must be a string, got {self.name!r}")

    @staticmethod
    def keys() -> tuple[str, ...]:
        """Every key a contract can have, ``kind`` and ``name`` aside."""
        return tuple(f.name for f in fields(Contract) if f.name not in ("kind", "name"))

    @property
    def steps(self) -> int:
        """Within how many optimizer steps the contract expects a change: ``within``, or 1."""
        return int(self.within or 1)

    @classmethod
    def from_dict(cls, mapping: object, where: str = "Contract") -> Contract:
        """A contract from plain data: ``kind`` and the kind's keys.

        Raises:
            SpecError: not a mapping, no ``kind``, or an unknown key (with the closest one).
        """
        if isinstance(mapping, Contract):
            return mapping
        if not isinstance(mapping, Mapping) or "kind" not in mapping:
            raise SpecError(
                f"{where}: a contract is a mapping with a kind ({sorted(KINDS)}) and its keys, "
                f"got {mapping!r}"
            )
        kind = mapping["kind"]
        if kind in KINDS:
            required, optional = KINDS[kind]
            unknown_keys(list(mapping), ["kind", "name", *required, *optional], where)
        try:
            return cls(**dict(mapping))
        except SpecError as error:
            if where == "Contract":
                raise
            raise SpecError(f"{where}: {str(error).removeprefix('Contract: ')}") from None

    def to_dict(self) -> dict[str, Any]:
        """The contract as plain data: ``kind``, ``name`` and the kind's keys."""
        required, optional = KINDS[self.kind]
        out: dict[str, Any] = {"kind": self.kind, "name": self.name}
        for key in (*required, *optional):
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def prefixed(self, prefix: str) -> Contract:
        """The same contract for a model that holds this one's under ``prefix``."""
        data = self.to_dict()
        for key in (*_SELECTORS, *_MODULES):
            value = data.get(key)
            if isinstance(value, list):
                data[key] = under(prefix, value)
            elif isinstance(value, str):
                data[key] = f"{prefix}.{value}"
        return Contract.from_dict(data)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if v is not None)
        return f"Contract({shown})"


def contracts_of(value: object, caller: str) -> tuple[Contract, ...]:
    """A spec's ``contracts`` value as contracts, checked whole: a list of mappings (or
    :class:`Contract`), with distinct names.

    Raises:
        SpecError: not a list, an entry that is no contract, or two contracts with one name.
    """
    if value is None:
        return ()
    if isinstance(value, (str, Mapping, Contract)) or not isinstance(value, Sequence):
        raise SpecError(
            f"{caller}: contracts must be a list of contracts (mappings with a kind), got "
            f"{type(value).__name__}"
        )
    found = tuple(
        Contract.from_dict(item, where=f"{caller}: contracts[{i}]") for i, item in enumerate(value)
    )
    names = [c.name for c in found]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SpecError(
            f"{caller}: contracts share the names {repeated}; give each a distinct name="
        )
    return found
