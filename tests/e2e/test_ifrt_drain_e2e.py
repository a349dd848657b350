"""A server SIGTERMed under open IFRT sessions (a rolling update): no session ends unexplained.

A session's arrays and executables live in this server's runtime and cannot move, so
on SIGTERM (``service.calls.drain``) the server refuses new sessions, lets the open
ones go on until their programs close them, for at most ``JITSERVE_DRAIN_TIMEOUT_S``,
then ends those still open with UNAVAILABLE and a message that says the server shut
down; a second signal (or a SIGINT) ends them at once, with the same kind of message.
The programs are unmodified JAX programs (``ifrt_walk_program.py``, driven a step at a
time), each step checking the values it reads. Before this, a SIGTERM cut every open
session within a fraction of a second, and the program read only
``UNAVAILABLE: Connection to IFRT proxy server was terminated: CANCELLED: CANCELLED``.

Each test SIGTERMs its own server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from e2e.conftest import _free_port, server_process
from e2e.test_ifrt_programs import KEYS, run_program
from e2e.test_ifrt_walk_e2e import ENDED, _Program

pytestmark = pytest.mark.timeout(300)

DRAIN_ENDED = re.compile(r"jitserve is shutting down \(SIGTERM\): this session was still open "
                         r"when the server's drain of 2 s \(JITSERVE_DRAIN_TIMEOUT_S\) ended")
STOPPED = re.compile(r"jitserve is shutting down: this session's arrays and executables are gone")
# The longest a test waits for what it expects: a step, the server's exit.
WITHIN_S = 120


@dataclasses.dataclass
class _Server:
    url: str
    target: str  # its IFRT proxy's
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def ifrt(self) -> dict[str, str]:
        return {"url": self.url, "target": self.target}


Serve = Callable[[float], _Server]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """``serve(drain_s)``: a server with the IFRT proxy on and that drain timeout."""
    with contextlib.ExitStack() as stack:

        def start(drain_s: float) -> _Server:
            port = _free_port()
            env = {"JITSERVE_IFRT_PORT": str(port), "JITSERVE_API_KEYS": ",".join(KEYS),
                   "JITSERVE_DRAIN_TIMEOUT_S": str(drain_s), "JITSERVE_LOG_LEVEL": "info",
                   "JITSERVE_MAX_BODY_BYTES": str(64 << 20)}  # the walk's big arrays
            tmp = tmp_path / f"server-{port}"
            tmp.mkdir()
            url, proc = stack.enter_context(server_process(tmp, env))
            return _Server(url, f"127.0.0.1:{port}", proc, tmp / "server.log")

        yield start


def _draining(url: str) -> None:
    """Wait until ``/readyz`` says the server drains."""
    deadline = time.monotonic() + WITHIN_S
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/readyz", timeout=10)
        if r.status_code == 503 and "draining" in r.text:
            return
        time.sleep(0.05)
    pytest.fail(f"the server never said it drains: {r.status_code} {r.text[:300]}")


def _exited(server: _Server) -> bool:
    """Whether the server exited as a SIGTERMed one does: uvicorn, once it has shut
    down, raises the signal it caught again, and ends by it."""
    try:
        return server.proc.wait(WITHIN_S) == -signal.SIGTERM
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit:\n{server.log.read_text()[-3000:]}")


def _steps_right(program: _Program, steps: int) -> None:
    """``steps`` steps of ``program``, each without an error, each value it read right."""
    for _ in range(steps):
        step = program.say("go")
        assert "error" not in step and step.get("read", True) is True, step


def test_a_drain_keeps_open_sessions_working_refuses_new_ones_and_ends_when_they_close(
        serve: Serve, tmp_path: Path) -> None:
    server = serve(300)
    program = _Program(server.ifrt, 11)
    try:
        _steps_right(program, 4)
        server.proc.send_signal(signal.SIGTERM)
        _draining(server.url)
        _steps_right(program, 4)  # the open session goes on, and reads right values
        # jaxlib's client tries again until its connection timeout, then says why.
        late = run_program(server.ifrt, "import jax.numpy as jnp\nprint(jnp.ones(3).sum())\n",
                           tmp_path, env={"JITSERVE_IFRT_CONNECT_TIMEOUT_S": "2"})
        assert late.returncode != 0, late.stdout
        assert ("jitserve is shutting down (draining) and opens no new IFRT session"
                in late.stderr), late.stderr[-2000:]
        end = program.say("end")
        rc, err = program.finish()
    finally:
        program.kill()
    assert end["wrong"] == [] and end["errors"] == [], end
    assert rc == 0 and not ENDED.search(err) and "Check failed" not in err, err
    # Its last session closed, the server leaves without waiting out its 300 s.
    assert _exited(server)
    log = server.log.read_text()
    assert re.search(r"IFRT session \w+ closed \(closed\)", log), log[-3000:]
    assert "still open" not in log, log[-3000:]


@pytest.mark.parametrize("drain_s, signals, reason", [(2, 1, DRAIN_ENDED), (300, 2, STOPPED)],
                         ids=["at-the-drain-s-end", "at-once"])
def test_a_session_still_open_at_shutdown_ends_saying_so(
        serve: Serve, drain_s: float, signals: int, reason: re.Pattern[str]) -> None:
    """The drain ends with the session open (or a second SIGTERM stops the server at
    once): the program's first error says the server shut down; it exits cleanly."""
    server = serve(drain_s)
    program = _Program(server.ifrt, 12)
    errors: list[str] = []
    try:
        _steps_right(program, 3)
        server.proc.send_signal(signal.SIGTERM)
        _draining(server.url)
        if signals == 2:
            server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WITHIN_S
        while not errors:
            assert time.monotonic() < deadline, "no step failed after the shutdown"
            step = program.say("go")
            assert step.get("read", True) is True, step  # a value read is right
            if "error" in step:
                errors.append(step["error"])
        end = program.say("end")
        rc, err = program.finish()
    finally:
        program.kill()
    assert reason.search(errors[0]), errors[0]
    assert end["wrong"] == [], end
    for message in end["errors"]:  # later ones may be jaxlib's client, its session ended
        assert reason.search(message) or ENDED.search(message), message
    assert rc == 0, err
    assert "Check failed" not in err and "Fatal Python error" not in err, err
    assert _exited(server)
    assert re.search(r"IFRT session \w+ closed \(shutdown: ", server.log.read_text())
