"""Verdicts across keys: keys in one file only (missing, unexpected, renamed), and ties.

Both work from the fingerprints the streaming pass kept (one per tensor); a broken tie's
members are read again, from the tuned file only, to say which rows differ.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

from isolate.certificates.certificate import Verdict
from isolate.certificates.checkpoint import Checkpoint, TensorMeta
from isolate.certificates.compare import diff_rows, is_constant

__all__ = ["detect_ties", "key_verdicts", "tie_verdicts"]


def _renamed(
    missing: Sequence[str],
    unexpected: Sequence[str],
    base_prints: Mapping[str, int],
    tuned_prints: Mapping[str, int],
    metas: tuple[Mapping[str, TensorMeta], Mapping[str, TensorMeta]],
) -> dict[str, tuple[str, bool]]:
    """missing key -> (unexpected key, whether bitwise the same values): first by equal
    values, then by the closest name among the unexpected keys of the same dtype and shape."""
    found: dict[str, tuple[str, bool]] = {}
    taken: set[str] = set()
    for exact in (True, False):
        for key in missing:
            if key in found:
                continue
            candidates = [
                u
                for u in unexpected
                if u not in taken
                and (base_prints[key] == tuned_prints[u] if exact else metas[0][key] == metas[1][u])
            ]
            close = difflib.get_close_matches(key, candidates, n=1, cutoff=0 if exact else 0.5)
            if close:
                found[key] = (close[0], exact)
                taken.add(close[0])
    return found


def key_verdicts(
    missing: Sequence[str],
    unexpected: Sequence[str],
    base_prints: Mapping[str, int],
    tuned_prints: Mapping[str, int],
    metas: tuple[Mapping[str, TensorMeta], Mapping[str, TensorMeta]],
) -> list[Verdict]:
    """A failed ``present`` verdict per key in one file only; a missing key that reappears
    under another name is reported once, as renamed (with ``?`` when its values differ)."""
    renamed = _renamed(missing, unexpected, base_prints, tuned_prints, metas)
    out = []
    for key in missing:
        if key in renamed:
            new, exact = renamed[key]
            detail = "bitwise the same values" if exact else "same dtype and shape; values differ"
            out.append(
                Verdict(key, "present", False, f"renamed to {new!r}{'' if exact else '?'}", detail)
            )
            continue
        close = difflib.get_close_matches(key, unexpected, n=3, cutoff=0.6)
        hint = f"closest unexpected keys: {close}" if close else ""
        out.append(Verdict(key, "present", False, "missing from the tuned checkpoint", hint))
    new_names = {new for new, _ in renamed.values()}
    for key in unexpected:
        if key in new_names:
            continue
        close = difflib.get_close_matches(key, missing, n=3, cutoff=0.6)
        hint = f"closest missing keys: {close}" if close else ""
        out.append(Verdict(key, "present", False, "not in the base checkpoint", hint))
    return out


def detect_ties(base: Checkpoint, prints: Mapping[str, int]) -> list[tuple[str, ...]]:
    """Groups of base keys with bitwise equal values (so tied, or copies of one tensor),
    leaving out tensors that hold one value throughout (zero biases, unit norms)."""
    groups: dict[int, list[str]] = {}
    for key, value in prints.items():
        groups.setdefault(value, []).append(key)
    found = []
    for keys in groups.values():
        if len(keys) > 1 and not is_constant(base.read(keys[0])):
            found.append(tuple(keys))
    return found


def tie_verdicts(
    groups: Sequence[tuple[str, ...]],
    declared: Sequence[tuple[str, ...]],
    base_prints: Mapping[str, int],
    tuned_prints: Mapping[str, int],
    tuned: Checkpoint,
) -> list[Verdict]:
    """A ``tied`` verdict per group: every member present in the tuned file still equal."""
    out = []
    for keys in groups:
        source = "declared" if keys in declared else "equal in the base"
        name = " = ".join(keys)
        if len({base_prints[k] for k in keys}) > 1:
            out.append(Verdict(name, "tied", False, "not tied in the base", "", source))
            continue
        present = [k for k in keys if k in tuned_prints]
        if len(present) < 2:
            out.append(
                Verdict(name, "tied", None, "fewer than two members in the tuned file", "", source)
            )
            continue
        first = present[0]
        broken = [k for k in present[1:] if tuned_prints[k] != tuned_prints[first]]
        if not broken:
            out.append(Verdict(name, "tied", True, "still tied", "", source))
            continue
        diff = diff_rows(tuned.read(first), tuned.read(broken[0]))
        detail = f"{broken} no longer equal {first!r}: {diff.describe()}"
        out.append(Verdict(name, "tied", False, "tie broken", detail, source))
    return out
