"""The cursor reads a file once, front to back: asked for a tensor it reads up to that
tensor's end and no further, fingerprinting what it passes, and a view of bytes it passed is
read again on its own without moving the cursor."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from isolate.certificates.streaming import FileCursor, Span
from isolate.errors import CheckpointReadError
from isolate.fingerprints import fingerprint

DATA = bytes(range(100))
# a: bytes 0-40; b: a view of bytes 20-80 (over a's end); c: a view inside b, past a's end;
# d: past b's end, after a gap.
SPANS = {"a": (0, 40), "b": (20, 80), "c": (48, 60), "d": (90, 100)}


def _print(key: str) -> int:
    start, end = SPANS[key]
    return fingerprint(torch.frombuffer(bytearray(DATA[start:end]), dtype=torch.uint8))


@pytest.fixture
def cursor(tmp_path: Path) -> Iterator[FileCursor]:
    path = tmp_path / "file.bin"
    path.write_bytes(DATA)
    spans = {k: Span(s, e, torch.uint8, (e - s,)) for k, (s, e) in SPANS.items()}
    opened = FileCursor(path, "xxh3", spans)
    yield opened
    opened.close()


def test_asked_for_the_first_tensor_the_cursor_reads_up_to_its_end_only(
    cursor: FileCursor,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file opened unbuffered, as binary files can be
        assert cursor.print_of("a") == _print("a")
    assert cursor.walked == 40


def test_a_view_behind_the_cursor_is_read_on_its_own_and_the_cursor_stays(
    cursor: FileCursor,
) -> None:
    cursor.print_of("a")
    assert cursor.print_of("b") == _print("b")
    assert cursor.walked == 40 + 60  # b read again on its own; c not reached yet
    assert cursor.print_of("c") == _print("c")
    assert cursor.walked == 40 + 60 + 8 + 12  # the cursor hashed on to c's end


def test_a_view_over_the_cursor_s_position_is_walked_to_and_what_it_passes_is_kept(
    cursor: FileCursor,
) -> None:
    assert cursor.print_of("b") == _print("b")
    # a hashed and fingerprinted, the gap to c, c, then on to b's end; b read on its own
    assert cursor.walked == 40 + 8 + 12 + 20 + 60
    assert [cursor.print_of(k) for k in ("c", "a")] == [_print("c"), _print("a")]
    assert cursor.walked == 140  # both fingerprinted on the way: nothing read again
    assert cursor.print_of("d") == _print("d")
    assert cursor.finish() == "xxh3_128:" + xxhash.xxh3_128(DATA).hexdigest()
    assert cursor.walked == 160


def test_a_cursor_without_a_file_hash_has_none_to_give_but_still_fingerprints(
    tmp_path: Path,
) -> None:
    path = tmp_path / "file.bin"
    path.write_bytes(DATA)
    cursor = FileCursor(path, "none", {"c": Span(48, 60, torch.uint8, (12,))})
    try:
        assert cursor.print_of("c") == _print("c")
        assert cursor.walked == 12  # the tensor alone: nothing hashed on the way
        with pytest.raises(ValueError) as error:
            cursor.finish()
        assert str(error.value) == "file.bin: a cursor without a file hash has none to give"
    finally:
        cursor.close()


@pytest.mark.parametrize(("left", "now"), [(55, 55), (48, 48)])
def test_a_file_cut_short_after_it_was_measured_names_where_it_now_ends(
    tmp_path: Path, left: int, now: int
) -> None:
    path = tmp_path / "file.bin"
    path.write_bytes(DATA)
    cursor = FileCursor(path, "none", {"c": Span(48, 60, torch.uint8, (12,))})
    path.write_bytes(DATA[:left])  # within c, or exactly where c starts
    try:
        with pytest.raises(CheckpointReadError) as error:
            cursor.print_of("c")
    finally:
        cursor.close()
    assert str(error.value) == (
        f"file.bin: truncated while being read (bytes up to 60 needed, the file now ends at "
        f"{now}); re-copy the file"
    )


def test_an_empty_tensor_reads_nothing_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "file.bin"
    path.write_bytes(DATA)
    cursor = FileCursor(path, "none", {"e": Span(100, 100, torch.uint8, (0,))})
    path.unlink()  # nothing left to open: an empty tensor must not need to
    assert cursor.print_of("e") == fingerprint(torch.zeros(0, dtype=torch.uint8))
    assert cursor.walked == 0
    cursor.close()


def test_a_closed_cursor_opens_the_file_again_when_asked_and_can_be_closed_twice(
    cursor: FileCursor,
) -> None:
    cursor.close()  # never opened yet
    assert cursor.print_of("b") == _print("b")
    cursor.close()
    assert cursor.print_of("a") == _print("a")  # passed on the way: no read
    assert cursor.print_of("b") == _print("b")  # behind the cursor: read again, reopened
    cursor.close()
    cursor.close()
