"""An unmodified JAX program at random through the IFRT proxy, with its runtime lost under it.

``ifrt_walk_program.py`` runs as a user's program (``JAX_PLATFORMS=jitserve``): it
puts arrays, runs jitted and eager computations, donates, reads and drops arrays,
one step at a time as this driver says, while the driver SIGKILLs the server's
runtimes between some steps, or has it run a call that never ends. A session
lives on one runtime: when that one is lost (or stopped: a call past the
execution deadline), the session ends (docs/ifrt.md), and what the program does
next must fail saying why. The rules, for every step and every seed:

- a value the program reads is the right one (numpy's), before a loss and after;
- nothing raises before the first loss; after it, the first error names the lost
  runtime (or the deadline), and later ones name it too or say that the client
  ended the session;
- no step waits forever: each answers within a bound;
- the program exits 0 at the end, and jaxlib's client aborts nothing;
- the server then holds nothing of it: no session, no device bytes, and it is
  healthy and ready.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e.conftest import metric_total, wait_ready
from e2e.test_ifrt_programs import KEYS, program_env, serve_ifrt

pytestmark = pytest.mark.timeout(600)

PROGRAM = Path(__file__).with_name("ifrt_walk_program.py")
STEPS = 40
STEP_S = 120  # the longest a step may take: a kill's restart, a first compile
# What the first error after a kill must say: the runtime that was lost (and so the
# session). Later ones may be jaxlib's own, once its client has ended the session.
LOST = re.compile(r"jitserve's runtime \d+ was lost|passed its deadline of [\d.]+ s "
                  r"\(JITSERVE_EXECUTION_TIMEOUT_S\)")
ENDED = re.compile(r"Connection to IFRT proxy server was terminated")


@pytest.fixture(scope="module")
def ifrt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from serve_ifrt(tmp_path_factory)


class _Program:
    """The walk program, driven a line at a time (each answer waited for up to ``STEP_S``)."""

    def __init__(self, ifrt: dict[str, str], seed: int, key: str = KEYS[0]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PROGRAM), str(seed)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=program_env(ifrt, key))
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def say(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        try:
            line = self.lines.get(timeout=STEP_S)
        except queue.Empty:
            pytest.fail(f"no answer to {command!r} within {STEP_S} s")
        assert line, f"the program ended before answering {command!r}: {self.stderr()}"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-3000:]

    def finish(self) -> tuple[int, str]:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=STEP_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the program did not exit once its input ended")
        return self.proc.returncode, self.stderr()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()


def _kill(runtime: dict[str, Any]) -> None:
    """SIGKILL a runtime ``/readyz`` listed as up: one killed a moment ago may still be
    listed (its supervisor has not seen it exit yet), and is gone by now."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(runtime["pid"], signal.SIGKILL)


def _held(url: str) -> tuple[float, float]:
    return (metric_total(url, "jitserve_ifrt_sessions"),
            metric_total(url, "jitserve_device_bytes_in_use"))


def _back_to(url: str, before: tuple[float, float], within_s: float = 60) -> tuple[float, float]:
    deadline = time.monotonic() + within_s
    while (now := _held(url)) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


def _judge(message: str, errors: list[str], context: object) -> None:
    """An error after a kill: the first names the lost runtime; later ones may instead
    be jaxlib's client saying it ended the session."""
    assert LOST.search(message) or (errors and ENDED.search(message)), context
    errors.append(message)


@pytest.mark.parametrize("seed, events", [
    (0, {}), (1, {12: "kill-all"}), (2, {5: "kill-one", 25: "kill-one"}),
    (3, {20: "kill-all", 30: "kill-one"}), (4, {15: "spin"})],
    ids=["nothing", "every-runtime", "one-runtime-twice", "late", "past-its-deadline"])
def test_a_program_at_random_reads_right_values_and_fails_only_naming_its_runtime_s_loss(
        ifrt: dict[str, str], seed: int, events: dict[int, str]) -> None:
    """``events``: by step, what happens before it: every runtime killed (the session's
    among them), one at random (perhaps another's), or a call the deadline stops."""
    url = ifrt["url"]
    wait_ready(url)
    before = _held(url)
    rng = random.Random(seed)
    program = _Program(ifrt, seed)
    lost = False
    errors: list[str] = []
    try:
        for i in range(STEPS):
            event = events.get(i)
            if event in ("kill-all", "kill-one"):
                runtimes = wait_ready(url)
                for runtime in runtimes if event == "kill-all" else [rng.choice(runtimes)]:
                    _kill(runtime)
            lost = lost or event is not None
            step = program.say("spin" if event == "spin" else "go")
            assert step.get("read", True) is True, (i, step)  # a value read is right
            if "error" in step:
                assert lost, (i, step)  # nothing fails before a runtime is lost
                _judge(step["error"], errors, (i, step))
        end = program.say("end")
        rc, err = program.finish()
    finally:
        program.kill()
    assert end["wrong"] == [], end
    for message in end["errors"]:
        assert lost, end
        _judge(message, errors, end)
    assert rc == 0, err
    assert "Check failed" not in err and "Fatal Python error" not in err, err
    if {"kill-all", "spin"} & set(events.values()):  # the session ended: the program heard it
        assert errors, end
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    wait_ready(url)
    assert _back_to(url, before) == before


def test_a_lost_runtime_ends_only_the_sessions_on_it(ifrt: dict[str, str]) -> None:
    """Two programs (two keys: two runtimes) walk side by side; one's runtime is killed.
    That one fails naming it; the other reads right values and never raises."""
    url = ifrt["url"]
    wait_ready(url)
    before = _held(url)
    hit, spared = _Program(ifrt, 5, KEYS[0]), _Program(ifrt, 6, KEYS[1])
    errors: dict[_Program, list[str]] = {hit: [], spared: []}
    try:
        for i in range(STEPS):
            if i == 10:
                sessions = httpx.get(f"{url}/v1/console/sessions", timeout=10,
                                     headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
                where = {s["runtime"] for s in sessions["sessions"]}
                others = httpx.get(f"{url}/v1/console/sessions", timeout=10,
                                   headers={"Authorization": f"Bearer {KEYS[1]}"}).json()
                assert len(where) == 1 and where.isdisjoint(
                    s["runtime"] for s in others["sessions"]), (sessions, others)
                _kill(next(r for r in wait_ready(url) if r["index"] in where))
            for program in (hit, spared):
                step = program.say("go")
                assert step.get("read", True) is True, (i, step)
                if "error" in step:
                    assert program is hit and i >= 10, (i, step)
                    _judge(step["error"], errors[program], (i, step))
        ends = [program.say("end") for program in (hit, spared)]
        codes = [program.finish() for program in (hit, spared)]
    finally:
        hit.kill()
        spared.kill()
    assert ends[1]["errors"] == [] and ends[1]["wrong"] == [] and ends[1]["live"], ends[1]
    assert ends[0]["wrong"] == [], ends[0]
    for message in ends[0]["errors"]:
        _judge(message, errors[hit], ends[0])
    assert errors[hit], ends[0]  # its session ended, and it heard why
    assert [rc for rc, _ in codes] == [0, 0], codes
    wait_ready(url)
    assert _back_to(url, before) == before
