"""The certificate: one verdict per claim, and what anyone needs to check it again.

It records the files' own hashes, the claims it was asked to check (the spec, the adapter
config, rows, ties), the tolerances, and the versions that produced it, and it says what a
certificate cannot say.
"""

from __future__ import annotations

import json
import platform
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CLAIMS", "LIMITS", "Certificate", "FileRecord", "Verdict", "versions"]

CLAIMS = ("frozen", "held", "rows", "merged", "saved", "trainable", "free", "tied", "present")
"""Every kind of claim, in the order a report lists them."""

LIMITS = (
    "A certificate shows which tensors changed between two files; it cannot show which loss, "
    "step or optimizer changed them, nor that a run followed the spec while it trained.",
    "detach, clone and protect are claims about gradients: checkpoints cannot show them.",
    "Which keys are buffers is declared (buffers=), not read from the files.",
)
"""What no certificate can say, printed with every one."""


@dataclass(frozen=True)
class Verdict:
    """One claim about one key (or a tie group, or a key present in one file only).

    Attributes:
        key: the checkpoint key (a tie: the keys joined by ``" = "``).
        claim: what was claimed: ``frozen``, ``held``, ``trainable``, ``free``, ``rows``,
            ``merged``, ``saved``, ``tied``, or ``present`` (for keys in one file only).
        ok: whether the claim holds; ``None`` for ``free`` keys, which are only reported.
        finding: what was found, in a few words (``"bitwise unchanged"``, ``"moved"``).
        detail: one line: which rows, by how much, in which file.
        source: why the claim was made (``"frozen by the spec"``).
    """

    key: str
    claim: str
    ok: bool | None
    finding: str
    detail: str = ""
    source: str = ""
    meta: str = ""
    base: str | None = None  # the fingerprint in the base file, hex
    tuned: str | None = None

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "info"}[self.ok]
        text = f"{mark} {self.claim:<9} {self.key}: {self.finding}"
        return text + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class FileRecord:
    """A checkpoint as certified: where, which format, and each file's own hash."""

    path: str
    format: str
    hashes: Mapping[str, str]
    group: str | None = None
    skipped: Sequence[str] = ()


def versions() -> dict[str, str]:
    """The versions of what computed the certificate."""
    import torch

    from isolate._version import __version__

    found = {
        "isolate": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        from importlib.metadata import version

        found["safetensors"] = version("safetensors")
    except Exception:  # not installed: safetensors files could not have been read
        pass
    return found


@dataclass(frozen=True)
class Certificate:
    """What two checkpoints show about a run: one :class:`Verdict` per claim.

    ``clean`` is true when no claim fails. ``str(certificate)`` is a readable report;
    :meth:`to_json` the record to keep next to the checkpoints.
    """

    base: FileRecord
    tuned: FileRecord
    claims: Mapping[str, Any]
    tolerances: Mapping[str, Any]
    verdicts: tuple[Verdict, ...]
    versions: Mapping[str, str]
    adapter: FileRecord | None = None
    notes: tuple[str, ...] = ()
    limits: tuple[str, ...] = field(default=LIMITS)

    @property
    def clean(self) -> bool:
        """Whether every claim holds."""
        return not self.failures

    @property
    def failures(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.ok is False]

    def verdict(self, key: str, claim: str | None = None) -> Verdict:
        """The verdict on ``key`` (of kind ``claim`` if given)."""
        for v in self.verdicts:
            if v.key == key and claim in (None, v.claim):
                return v
        raise KeyError(f"no verdict on {key!r}" + (f" of claim {claim!r}" if claim else ""))

    def summary(self, depth: int = 1) -> list[str]:
        """One line per top-level module (the first ``depth`` parts of the keys), counting
        its tensors by claim and finding: ``"trunk: 6 frozen, bitwise unchanged"``."""
        groups: dict[str, Counter[str]] = {}
        for v in self.verdicts:
            if v.claim in ("tied", "present"):
                continue
            group = ".".join(v.key.split(".")[:depth])
            finding = v.finding if v.ok is not False else "FAILED"
            groups.setdefault(group, Counter())[f"{v.claim}, {finding}"] += 1
        order = {c: i for i, c in enumerate(CLAIMS)}
        return [
            f"{group}: "
            + "; ".join(
                f"{n} {what}"
                for what, n in sorted(counts.items(), key=lambda w: order[w[0].split(",")[0]])
            )
            for group, counts in groups.items()
        ]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["clean"] = self.clean
        return out

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        status = "CLEAN" if self.clean else f"NOT CLEAN: {len(self.failures)} failed"
        tally = Counter(v.claim for v in self.verdicts)
        lines = [
            f"certificate: {self.base.path} -> {self.tuned.path}: {status}",
            "  claims: " + ", ".join(f"{n} {c}" for c, n in tally.items()),
        ]
        lines += [f"  {v.line()}" for v in self.failures]
        lines += [f"  {line}" for line in self.summary()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
