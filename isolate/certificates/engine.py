"""The streaming pass: each tensor is read once from each file, fingerprinted, judged, dropped.

The base and the tuned checkpoint are fingerprinted on two threads at once, each through its
own files front to back (``xxhash`` and the reads let go of the GIL); only fingerprints are
kept, one per tensor, and every key is judged once both passes are done. Values are read again only
where a verdict needs them: a claim about rows or a merge, a failed claim (to say which
rows), a tensor stored in several shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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
    """Read both checkpoints once, each on its own thread in its own order, then judge every
    key in the base's order."""
    base_keys = [k for k in job.base.metas if k not in job.ignored]
    tuned_keys = [k for k in job.tuned.metas if k not in job.ignored]
    with ThreadPoolExecutor(2, thread_name_prefix="certify") as pool:
        from_tuned = pool.submit(_prints, job.tuned, tuned_keys)
        base_prints = _prints(job.base, base_keys)
        tuned_prints = from_tuned.result()
    verdicts: list[Verdict] = []
    for key in base_keys:
        if key not in tuned_prints:
            continue
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
    missing = [k for k in base_keys if k not in tuned_prints]
    metas = (job.base.metas, job.tuned.metas)
    verdicts += key_verdicts(missing, unexpected, base_prints, tuned_prints, metas)
    groups = list(job.ties)
    if job.detect_ties:
        groups += [g for g in detect_ties(job.base, base_prints) if g not in groups]
    verdicts += tie_verdicts(groups, job.ties, base_prints, tuned_prints, job.tuned)
    return verdicts


def _prints(checkpoint: Checkpoint, keys: Sequence[str]) -> dict[str, int]:
    """The fingerprint of every tensor of ``keys``: the checkpoint's files are read once, in
    file order (without waiting for the other checkpoint's thread at every tensor)."""
    return {key: checkpoint.print_of(key) for key in keys}
