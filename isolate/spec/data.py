"""An isolation spec's data: what to freeze, detach, clone and thaw, checked when built.

:class:`SpecData` holds the declaration and validates it; :class:`isolate.spec.IsolationSpec`
adds the verbs that make it real on a model. Nothing here imports the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

from isolate.errors import SpecError
from isolate.spec._fields import check_plain, string_list, under, unknown_keys
from isolate.spec.contracts import Contract, contracts_of
from isolate.spec.thaw import BN, Thaw

__all__ = ["SpecData"]

_CALLER = "IsolationSpec"
Self = TypeVar("Self", bound="SpecData")


@dataclass(frozen=True)
class SpecData:
    """The fields of :class:`isolate.spec.IsolationSpec`, validated when built (see there)."""

    freeze: tuple[str, ...] = ()
    detach: tuple[str, ...] = ()
    clone: tuple[str, ...] = ()
    bn: BN = "eval"
    thaw: tuple[Thaw, ...] = ()
    protect: Mapping[str, tuple[str, ...]] | None = None
    frozen_in_optimizer: Literal["remove", "error"] = "remove"
    mode: Literal["eval", "train"] | None = None
    contracts: tuple[Contract, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for key in ("freeze", "detach", "clone"):
            set_(self, key, string_list(getattr(self, key), key))
        if self.bn not in ("eval", "train"):
            raise SpecError(f"{_CALLER}: bn must be 'eval' or 'train', got {self.bn!r}")
        if self.mode not in (None, "eval", "train"):
            raise SpecError(f"{_CALLER}: mode must be 'eval', 'train' or null, got {self.mode!r}")
        if self.mode == "eval" and self.bn == "train":
            raise SpecError(
                f"{_CALLER}: mode='eval' holds every mode-dependent layer of the frozen part in "
                f"eval mode, BatchNorm included, but bn='train' lets BatchNorm train; drop one"
            )
        set_(self, "contracts", contracts_of(self.contracts, _CALLER))
        thaw: object = self.thaw
        if thaw is not None and (
            isinstance(thaw, (str, Mapping, Thaw)) or not isinstance(thaw, Sequence)
        ):
            raise SpecError(
                f"{_CALLER}: thaw must be a list of Thaw steps (or mappings), got "
                f"{type(thaw).__name__}"
            )
        steps = tuple(
            Thaw.from_dict(item, where=f"{_CALLER}: thaw[{i}]") for i, item in enumerate(thaw or ())
        )
        set_(self, "thaw", steps)
        names = [str(t.name) for t in steps]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise SpecError(
                f"{_CALLER}: thaw steps share the names {repeated}; give each a distinct name="
            )
        both = sorted(set(self.detach) & set(self.clone))
        if both:
            raise SpecError(
                f"{_CALLER}: {both} are both in detach and clone; a branch either gets "
                f"gradient back (clone) or not (detach): pick one"
            )
        for kind in ("detach", "clone"):
            names = list(getattr(self, kind))
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise SpecError(f"{_CALLER}: {kind} lists {twice} twice; list each branch once")
        _check_chain(steps)
        set_(self, "protect", self._checked_protect(self.protect))
        if self.frozen_in_optimizer not in ("remove", "error"):
            raise SpecError(
                f"{_CALLER}: frozen_in_optimizer must be 'remove' or 'error', got "
                f"{self.frozen_in_optimizer!r}"
            )

    @staticmethod
    def _checked_protect(protect: object) -> dict[str, tuple[str, ...]] | None:
        if protect is None:
            return None
        if not isinstance(protect, Mapping):
            raise SpecError(
                f"{_CALLER}: protect must map loss names to selectors, got {type(protect).__name__}"
            )
        checked = {str(k): string_list(v, f"protect[{k!r}]") for k, v in protect.items()}
        empty = [k for k, v in checked.items() if not v]
        if empty:
            raise SpecError(f"{_CALLER}: protect{empty} select nothing; name what to protect")
        return checked

    @property
    def policy(self) -> BN:
        """The mode the frozen part's held layers take: ``mode``, or else ``bn``'s."""
        return self.mode or self.bn

    @classmethod
    def from_dict(cls: type[Self], mapping: Mapping[str, Any]) -> Self:
        """A spec from plain data, as read from YAML or JSON: the keys of the constructor.

        Raises:
            SpecError: ``mapping`` is not a mapping, holds an unknown key (with the closest
                known one), or holds anything but plain data.
        """
        where = f"{_CALLER}.from_dict()"
        if not isinstance(mapping, Mapping):
            raise SpecError(f"{where}: expected a mapping of spec keys, got {type(mapping)}")
        known = [f.name for f in fields(cls) if f.init]
        unknown_keys(list(mapping), known, where)
        check_plain(dict(mapping), where)
        return cls(**mapping)

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data; ``IsolationSpec.from_dict(spec.to_dict()) == spec``."""
        thaw = [{f.name: getattr(t, f.name) for f in fields(Thaw)} for t in self.thaw]
        for step in thaw:
            step["select"] = list(string_list(step["select"], "select"))
        return {
            "freeze": list(self.freeze),
            "detach": list(self.detach),
            "clone": list(self.clone),
            "bn": self.bn,
            "thaw": thaw,
            "protect": None
            if self.protect is None
            else {k: list(v) for k, v in self.protect.items()},
            "frozen_in_optimizer": self.frozen_in_optimizer,
            "mode": self.mode,
            "contracts": [c.to_dict() for c in self.contracts],
        }

    def prefixed(self: Self, prefix: str) -> Self:
        """The same spec for a model that holds this one's model under ``prefix`` (for
        example a LightningModule's ``self.net``): every selector and branch name gets
        ``prefix + "."`` in front; thaw group names stay.

        A ``type:`` selector looks only under ``prefix`` (``"net/type:_BatchNorm"``), an
        exclusion excludes under it, and selectors that are all exclusions (which start from
        the whole model) start from ``prefix`` instead.

        >>> from isolate.spec import IsolationSpec
        >>> IsolationSpec(freeze=["trunk"], thaw=[Thaw("trunk.3", epoch=1)]).prefixed("net")
        IsolationSpec(freeze=['net.trunk'], thaw=[trunk.3 at epoch 1])
        >>> IsolationSpec(freeze=["trunk", "!type:_BatchNorm"]).prefixed("net").freeze
        ('net.trunk', '!net/type:_BatchNorm')
        >>> IsolationSpec(freeze=["!head"]).prefixed("net").freeze
        ('net', '!net.head')
        """
        if not isinstance(prefix, str) or not prefix or prefix.endswith("."):
            raise SpecError(f"{_CALLER}.prefixed(): prefix must be a module name, got {prefix!r}")
        data = self.to_dict()
        for key in ("detach", "clone"):
            data[key] = [f"{prefix}.{s}" for s in data[key]]
        data["freeze"] = under(prefix, data["freeze"])
        for step in data["thaw"]:
            step["select"] = under(prefix, step["select"])
        if data["protect"] is not None:
            data["protect"] = {k: under(prefix, v) for k, v in data["protect"].items()}
        data["contracts"] = [c.prefixed(prefix).to_dict() for c in self.contracts]
        return type(self).from_dict(data)

    def __repr__(self) -> str:
        parts = [f"{k}={list(getattr(self, k))!r}" for k in ("freeze", "detach", "clone")]
        parts = [p for p in parts if not p.endswith("=[]")]
        if self.bn != "eval":
            parts.append(f"bn={self.bn!r}")
        if self.thaw:
            steps = [
                f"{t.name} at {t.when}" + (f", lr={t.lr}" if t.lr is not None else "")
                for t in self.thaw
            ]
            parts.append(f"thaw=[{'; '.join(steps)}]")
        if self.protect is not None:
            parts.append(f"protect={ {k: list(v) for k, v in self.protect.items()} }")
        if self.frozen_in_optimizer != "remove":
            parts.append(f"frozen_in_optimizer={self.frozen_in_optimizer!r}")
        if self.mode is not None:
            parts.append(f"mode={self.mode!r}")
        if self.contracts:
            parts.append(f"contracts={[c.name for c in self.contracts]}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _check_chain(steps: Sequence[Thaw]) -> None:
    """``carry_best`` needs a monitor thaw before it to carry from."""
    for i, step in enumerate(steps):
        if step.carry_best and not any(
            t.monitor == step.monitor and t.mode == step.mode for t in steps[:i]
        ):
            raise SpecError(
                f"{_CALLER}: thaw[{i}] ({step.name!r}) has carry_best=True, but no thaw before "
                f"it monitors {step.monitor!r} in mode {step.mode!r}, so there is no best to "
                f"carry; drop carry_best"
            )
