"""The streaming pass: each tensor is read once from each file, fingerprinted, judged, dropped.

The base's and the tuned file's tensor are fingerprinted on two threads at once (``xxhash``
lets go of the GIL); only fingerprints are kept, one per tensor. Values are read again only
where a verdict needs them: a claim about rows or a merge, a failed claim (to say which
rows), a tensor stored in several shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from isolate.certificates.certificate import Verdict
from isolate.certificates.checkpoint import Checkpoint
from isolate.certificates.claims import Claim
from isolate.certificates.structure import detect_ties, key_verdicts, tie_verdicts
from isolate.certificates.verdicts import Pair, judge

__all__ = ["Pass", "run"]


@dataclass
class Pass:
    """Everything the pass needs, validated before it starts."""

    base: Checkpoint
    tuned: Checkpoint
    claims: Mapping[str, Claim]
    adapter: Checkpoint | None
    ties: Sequence[tuple[str, ...]]
    detect_ties: bool
    ulps: float
    ignored: frozenset[str] = frozenset()


def run(job: Pass) -> list[Verdict]:
    """Read both checkpoints once, in the base's order, and judge every key."""
    base_keys = [k for k in job.base.metas if k not in job.ignored]
    tuned_keys = [k for k in job.tuned.metas if k not in job.ignored]
    in_tuned = set(tuned_keys)
    base_prints: dict[str, int] = {}
    tuned_prints: dict[str, int] = {}
    verdicts: list[Verdict] = []
    with ThreadPoolExecutor(2, thread_name_prefix="certify") as pool:
        for key in base_keys:
            from_base = pool.submit(job.base.print_of, key)
            from_tuned: Future[int] | None = None
            if key in in_tuned:
                from_tuned = pool.submit(job.tuned.print_of, key)
            base_prints[key] = from_base.result()
            if from_tuned is None:
                continue
            tuned_prints[key] = from_tuned.result()
            pair = Pair(
                key,
                job.claims[key],
                job.base,
                job.tuned,
                base_prints[key],
                tuned_prints[key],
                job.adapter,
                job.ulps,
            )
            verdicts.append(judge(pair))
            del pair  # its tensors, if it read them: the mapping window can be released
    unexpected = [k for k in tuned_keys if k not in base_prints]
    for key in unexpected:
        tuned_prints[key] = job.tuned.print_of(key)
    missing = [k for k in base_keys if k not in in_tuned]
    metas = (job.base.metas, job.tuned.metas)
    verdicts += key_verdicts(missing, unexpected, base_prints, tuned_prints, metas)
    groups = list(job.ties)
    if job.detect_ties:
        groups += [g for g in detect_ties(job.base, base_prints) if g not in groups]
    verdicts += tie_verdicts(groups, job.ties, base_prints, tuned_prints, job.tuned)
    return verdicts
