"""A row of the results, and the Markdown table of rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Row", "table"]


@dataclass
class Row:
    """One comparison: the candidate's median time over the baseline's."""

    name: str
    candidate: str
    baseline: str
    candidate_s: float
    baseline_s: float
    target: str
    ok: bool | None  # None: measured, no target
    extra: dict[str, Any] = field(default_factory=dict)
    paired_ratio: float | None = None
    limit: float | None = None  # the target as "metric <= limit"; None: measured, no target
    metric_name: str = "ratio"  # what the limit applies to: "ratio", or a key of extra
    unit: str = "s"  # of candidate_s / baseline_s: "s" or "bytes"

    def __post_init__(self) -> None:
        if self.limit is not None:  # the verdict is the stated limit applied to the number
            self.ok = self.metric <= self.limit

    @property
    def metric(self) -> float:
        """The number the target's limit applies to."""
        return self.ratio if self.metric_name == "ratio" else float(self.extra[self.metric_name])

    @property
    def ratio(self) -> float:
        """The geometric mean of per-pair ratios where pairs were timed back to back, else
        the ratio of medians."""
        if self.paired_ratio is not None:
            return self.paired_ratio
        return self.candidate_s / self.baseline_s


def _amount(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / 2**20:.3f} MB"
    return f"{1e3 * value:.3f} ms"


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table; ``met`` is ``-`` for a row measured without a target."""
    lines = [
        "| benchmark | candidate | baseline | candidate | baseline | ratio | target | met |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        met = "-" if r.limit is None else ("yes" if r.ok else "NO")
        lines.append(
            f"| {r.name} | {r.candidate} | {r.baseline} | {_amount(r.candidate_s, r.unit)} | "
            f"{_amount(r.baseline_s, r.unit)} | {r.ratio:.4g} | {r.target} | {met} |"
        )
    return "\n".join(lines)
