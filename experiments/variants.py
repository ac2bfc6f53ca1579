"""The suite's variants: every ``configs/*.yaml``, with the declaration it carries.

A variant is one config file. Its ``variant:`` block (which a run ignores, see
:class:`experiments.cli.ExperimentCLI`) says what the run shows, which run it is compared with,
what it claims and how the report shows it::

    variant:
      role: linear probes behind isolate.Detached        # one line in the report
      compare_with: baseline                             # per-step trunk gradient, final trunk
      claims:                                            # see experiments.claims
        - {check: gradient_equal}
        - {check: reaches, loss: probe, expect: none}
      report:                                            # see experiments.sections
        - {section: drift}

Adding a variant is adding one such file: the suite runs it, checks its claims and reports
it, and no code names it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["CONFIGS", "KEY", "Variant", "discover", "load", "select"]

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
KEY = "variant"
_FIELDS = {"role", "compare_with", "reference", "certify", "claims", "report"}


@dataclass(frozen=True)
class Variant:
    """One run of the suite, as its config file declares it.

    Attributes:
        name: the config file's stem, also the run's name.
        config: the config file.
        role: what the run shows, one line for the report.
        reference: other runs compare their trunk gradient with this run's, step by step
            (it saves them).
        compare_with: the run whose per-step trunk gradient and final trunk this one is
            compared with.
        certify: certify the run from its first and last weights (:mod:`experiments.certifying`).
        claims: the checks of :mod:`experiments.claims`, each ``{"check": kind, ...}``.
        report: the sections of :mod:`experiments.sections`, each ``{"section": kind, ...}``.
    """

    name: str
    config: Path
    role: str = ""
    reference: bool = False
    certify: bool = False
    compare_with: str | None = None
    claims: tuple[Mapping[str, Any], ...] = field(default=())
    report: tuple[Mapping[str, Any], ...] = field(default=())

    @property
    def expect_error(self) -> str | None:
        """The exception type that must stop the run, from a ``stops_with`` claim."""
        for claim in self.claims:
            if claim.get("check") == "stops_with":
                return str(claim["error"])
        return None

    @property
    def needs(self) -> set[str]:
        """The runs this one's comparisons and claims read."""
        wanted = {self.compare_with} if self.compare_with else set()
        return wanted | {str(c["versus"]) for c in self.claims if "versus" in c}

    def declaration(self) -> dict[str, Any]:
        """The declaration as plain data, for ``results.json``."""
        return {
            "role": self.role,
            "reference": self.reference,
            "compare_with": self.compare_with,
            "expect_error": self.expect_error,
            "claims": [dict(c) for c in self.claims],
            "report": [dict(s) for s in self.report],
        }


def load(config: Path) -> Variant:
    """The variant of one config file.

    Raises:
        ValueError: the ``variant:`` block is missing or holds an unknown field, or a claim or
            section has no kind.
    """
    loaded = yaml.safe_load(config.read_text()) or {}
    block = loaded.get(KEY)
    if not isinstance(block, dict):
        raise ValueError(f"{config.name}: no '{KEY}:' block; every variant declares its role")
    unknown = sorted(set(block) - _FIELDS)
    if unknown:
        raise ValueError(
            f"{config.name}: '{KEY}:' has unknown fields {unknown}; known: {sorted(_FIELDS)}"
        )
    claims = tuple(block.get("claims") or ())
    report = tuple(block.get("report") or ())
    for what, items, kind in (("claim", claims, "check"), ("section", report, "section")):
        for item in items:
            if not isinstance(item, dict) or kind not in item:
                raise ValueError(
                    f"{config.name}: every {what} is a mapping with '{kind}:'; got {item!r}"
                )
    return Variant(
        name=config.stem,
        config=config,
        role=str(block.get("role", "")),
        reference=bool(block.get("reference", False)),
        certify=bool(block.get("certify", False)),
        compare_with=block.get("compare_with"),
        claims=claims,
        report=report,
    )


def discover(folder: Path = CONFIGS) -> list[Variant]:
    """Every variant in ``folder``, in the order the suite runs them: the runs that others are
    compared with first, then the rest, each group by name."""
    variants = [load(path) for path in sorted(folder.glob("*.yaml"))]
    return _ordered(variants)


def select(variants: Sequence[Variant], only: Iterable[str] | None) -> list[Variant]:
    """``variants`` restricted to ``only`` and the runs they need; all of them for ``None``.

    Raises:
        ValueError: a name in ``only`` is no variant.
    """
    if not only:
        return list(variants)
    by_name = {v.name: v for v in variants}
    wanted = set(only)
    unknown = sorted(wanted - set(by_name))
    if unknown:
        close = [m for u in unknown for m in difflib.get_close_matches(u, list(by_name), n=1)]
        hint = f"; did you mean {close}?" if close else ""
        raise ValueError(f"unknown variants {unknown}{hint}; choose from {sorted(by_name)}")
    pending = list(wanted)
    while pending:
        for need in by_name[pending.pop()].needs:
            if need in by_name and need not in wanted:
                wanted.add(need)
                pending.append(need)
    return [v for v in variants if v.name in wanted]


def _ordered(variants: Sequence[Variant]) -> list[Variant]:
    compared_with = {v.compare_with for v in variants} | {v.name for v in variants if v.reference}
    first = [v for v in variants if v.name in compared_with]
    return first + [v for v in variants if v.name not in compared_with]
