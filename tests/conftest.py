"""Suite-wide guards: every test leaves grad mode on, no isolation handle active, no hook
behind, and no file outside ``tmp_path``; Hypothesis draws the same inputs on every run."""

from __future__ import annotations

import gc
import importlib
import subprocess
import tempfile
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from isolate import freezing
from tests._launch import REPO

# The same examples on every run and machine (a failure reproduces from the test id alone),
# and no example database: nothing is written into the repo. Run with
# ``--hypothesis-profile=explore`` to search with fresh random inputs instead.
settings.register_profile("isolate", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", database=None, print_blob=True)
settings.load_profile("isolate")
# Hypothesis also caches the constants it reads from source files in its home directory
# (./.hypothesis by default), database or not: keep that out of the repo too.
_HYPOTHESIS_HOME = tempfile.TemporaryDirectory(prefix="isolate-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME.name)


def _untracked() -> set[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--ignored"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    return {line[3:] for line in out.stdout.splitlines() if line.startswith(("??", "!!"))}


@pytest.fixture(autouse=True, scope="session")
def _no_files_left_behind() -> Iterator[None]:
    """Tests write only below tmp_path: the repo gains no file while the suite runs."""
    if not (REPO / ".git").exists():  # installed elsewhere: nothing to police
        yield
        return
    before = _untracked()
    yield
    created = {
        path
        for path in _untracked() - before
        if "__pycache__" not in path
        and not path.startswith((".venv", ".ruff_cache", ".mypy_cache"))
    }
    assert not created, f"the suite wrote files into the repo: {sorted(created)[:10]}"


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny networks gain nothing from threads, and on a busy 2-core machine intra-op threads
    contend with other processes and make tests many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["pytorch_lightning", "lightning.pytorch"])
def pl(request: pytest.FixtureRequest) -> ModuleType:
    """Each Lightning in turn: the standalone package and the unified one."""
    return importlib.import_module(request.param)


@pytest.fixture(autouse=True)
def _isolation_left_clean() -> Iterator[None]:
    active_before = set(freezing._active)
    yield
    assert torch.is_grad_enabled(), "a test left grad mode off"
    if any(h not in active_before for h in freezing._active):
        gc.collect()  # only when needed: a full collection costs a good part of a second
    leaked = [h for h in freezing._active if h not in active_before]
    for handle in sorted(leaked, key=lambda h: -h._seq):
        handle.restore()
    assert not leaked, f"a test left freeze handles active: {leaked}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing ``upstream_trap`` test says what its failure means."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call" and item.get_closest_marker("upstream_trap"):
        report.sections.append(
            (
                "upstream_trap",
                "This test pins a behaviour of torch/Lightning that isolate guards against. "
                "Its failure means the trap is gone or changed upstream, not that isolate "
                "broke: update the docs (the Note that describes the trap) and check whether "
                "the guard is still needed.",
            )
        )
