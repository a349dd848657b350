"""Why a runtime did not start, as its supervisor words it (``pool._start_failure``):
real processes, one that dies as it starts and one whose pipe fails while it lives."""

from __future__ import annotations

import subprocess
import sys

from jitserve.service.runtimes.pool import _start_failure


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
