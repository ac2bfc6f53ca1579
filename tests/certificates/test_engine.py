"""The streaming pass: the tuned checkpoint is read on its own thread, every key present in
both files is judged whatever is missing, and declared ties are judged with detected ones."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from isolate.certificates import certify, engine
from isolate.certificates.checkpoint import Checkpoint
from tests.certificates._data import SPEC, base_state, pair, trained


def test_the_tuned_checkpoint_is_read_on_its_own_named_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str]] = []
    prints = engine._prints

    def recording(checkpoint: Checkpoint, keys: Sequence[str]) -> dict[str, int]:
        seen.append((checkpoint.path.name, threading.current_thread().name))
        return prints(checkpoint, keys)

    monkeypatch.setattr(engine, "_prints", recording)
    cert = certify(*pair(tmp_path, "torch", trained(base_state())), spec=SPEC)
    assert cert.clean
    threads = dict(seen)
    assert len(seen) == 2 and threads["base.pt"] == threading.current_thread().name
    assert threads["tuned.pt"].startswith("certify_"), threads


def test_a_key_missing_from_the_tuned_file_does_not_stop_the_keys_after_it(
    tmp_path: Path,
) -> None:
    tuned = trained(base_state())
    del tuned["embed.weight"]  # the first key of the base
    cert = certify(*pair(tmp_path, "torch", tuned), spec=SPEC, detect_ties=False)
    judged = {v.key: v.finding for v in cert.verdicts if v.claim != "present"}
    assert set(judged) == set(base_state()) - {"embed.weight"}
    assert judged["trunk.0.weight"] == "bitwise unchanged" and judged["head.weight"] == "moved"
    assert cert.verdict("embed.weight", "present").finding == "missing from the tuned checkpoint"


def test_declared_ties_are_judged_alongside_the_detected_ones(tmp_path: Path) -> None:
    base = base_state()
    base["copy.weight"] = base["head.weight"] + 1
    cert = certify(
        *pair(tmp_path, "torch", trained(base), base),
        ties=[["head.weight", "copy.weight"], ["embed.weight", "out.weight"]],
    )
    ties = [(v.key, v.finding, v.source) for v in cert.verdicts if v.claim == "tied"]
    assert ties == [  # the detected embed/out tie is the declared one, judged once
        ("head.weight = copy.weight", "not tied in the base", "declared"),
        ("embed.weight = out.weight", "still tied", "declared"),
    ]
