"""Why a runtime did not start, as its supervisor words it (``pool._start_failure``):
real processes, one that dies as it starts and one whose pipe fails while it lives;
and a pool closed while its runtime starts again, which is no failed start."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitserve.service.app import start_pool
from jitserve.service.runtimes.pool import _start_failure
from jitserve.service.settings import Settings


def test_a_process_that_exits_as_it_starts_is_named_by_its_exit() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    why = _start_failure(proc, EOFError())  # its pipe closed as it died: it is waited for
    assert why == "exited with status 3 while starting", why


def test_a_living_process_whose_pipe_failed_is_killed_and_says_so() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    why = _start_failure(proc, BrokenPipeError(32, "Broken pipe"))
    assert why.startswith("its pipe failed while starting (BrokenPipeError:"), why
    assert why.endswith("; killed")
    assert proc.poll() is not None  # not left behind


@pytest.mark.parametrize("when", ["gone", "starting"])
def test_a_pool_closed_while_a_runtime_restarts_is_no_failed_start(
        when: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Closing stops a runtime that is starting again, and that is the close, not a
    failed start (it was logged as an error that blamed the OOM killer, and retried).
    ``gone``: closed once the killed process has exited, before the next one began,
    which the close used to miss: it waited 10 s for the supervisor, and left that
    next process running. ``starting``: closed while the next process imports jax."""
    pool = asyncio.run(start_pool(Settings(env="test", cache_dir=tmp_path, runtimes=1)))
    runtime = pool.runtimes[0]
    first = runtime.pid
    try:
        runtime.kill("cancel")
        deadline = time.monotonic() + 60
        while runtime.pid == first if when == "gone" else runtime.pid in (first, None):
            assert time.monotonic() < deadline, "the runtime did not start again"
            time.sleep(0.0005)
        assert runtime.state != "up", "it started too soon for this test: a fast machine?"
    finally:
        closing = time.monotonic()
        pool.close()
    assert time.monotonic() - closing < 9, "the close waited for its supervisor's thread"
    assert runtime._process is not None and runtime._process.poll() is not None
    assert pool.counters["start_failures"] == 0
    assert not [r for r in caplog.records if "failed to start" in r.getMessage()]
    assert runtime.state == "stopped"
