"""The certificate as read: its report word for word, its summary by module, each verdict's
line, and the versions it records."""

from __future__ import annotations

from importlib.metadata import version

from isolate.certificates import Certificate, FileRecord, Verdict
from isolate.certificates.certificate import versions


def _certificate() -> Certificate:
    verdicts = (
        Verdict("trunk.0.weight", "frozen", True, "bitwise unchanged"),
        Verdict("trunk.0.bias", "frozen", False, "changed", "row 0 by 1"),
        Verdict("embed.weight = out.weight", "tied", True, "tied"),
        Verdict("extra", "present", False, "not in the base checkpoint"),
        Verdict("head.bias", "free", None, "moved"),
        Verdict("head.weight", "trainable", True, "moved"),
        Verdict("trunk.1.weight", "held", True, "bitwise unchanged"),
    )
    return Certificate(
        base=FileRecord("a.pt", "torch", {}),
        tuned=FileRecord("b.pt", "torch", {}),
        claims={},
        tolerances={},
        verdicts=verdicts,
        versions={},
        notes=("a file beside the checkpoint",),
    )


def test_the_report_counts_the_claims_lists_the_failures_and_sums_up_each_module() -> None:
    assert str(_certificate()) == (
        "certificate: a.pt -> b.pt: NOT CLEAN: 2 failed\n"
        "  claims: 2 frozen, 1 tied, 1 present, 1 free, 1 trainable, 1 held\n"
        "  FAIL frozen    trunk.0.bias: changed (row 0 by 1)\n"
        "  FAIL present   extra: not in the base checkpoint\n"
        "  trunk: 1 frozen, bitwise unchanged; 1 frozen, FAILED; 1 held, bitwise unchanged\n"
        "  head: 1 trainable, moved; 1 free, moved\n"
        "  note: a file beside the checkpoint"
    )


def test_the_summary_groups_by_the_first_parts_of_the_keys_in_the_order_of_the_claims() -> None:
    assert _certificate().summary(depth=2) == [
        "trunk.0: 1 frozen, bitwise unchanged; 1 frozen, FAILED",
        "head.bias: 1 free, moved",
        "head.weight: 1 trainable, moved",
        "trunk.1: 1 held, bitwise unchanged",
    ]


def test_each_verdict_s_line_marks_it_ok_fail_or_info() -> None:
    lines = [v.line() for v in _certificate().verdicts]
    assert lines == [
        "ok   frozen    trunk.0.weight: bitwise unchanged",
        "FAIL frozen    trunk.0.bias: changed (row 0 by 1)",
        "ok   tied      embed.weight = out.weight: tied",
        "FAIL present   extra: not in the base checkpoint",
        "info free      head.bias: moved",
        "ok   trainable head.weight: moved",
        "ok   held      trunk.1.weight: bitwise unchanged",
    ]


def test_the_versions_include_the_safetensors_that_could_read_the_files() -> None:
    assert versions()["safetensors"] == version("safetensors")
