"""Supervised runtimes, end to end: deadlines, crashes, cancels and memory limits.

Programs run in runtime processes (``service/runtimes``), never in the server's
own. These tests make programs misbehave for real (endless loops, a SIGKILL from
outside, an allocation past the runtime's memory cap) and check what callers see:
a future that fails with a code saying why, within a bound, while the server and
every other caller's work go on.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import _free_port, metric_total, wait_ready
from e2e.test_ifrt_programs import run_program
from jax import export, lax

from jitserve import wire

pytestmark = pytest.mark.timeout(180)

KEY_A, KEY_B = "runtime-key-a-0123456789", "runtime-key-b-0123456789"


def _export(fn: Callable[..., Any], *specs: Any) -> bytes:
    return bytes(export.export(jax.jit(fn))(*specs).serialize())


F32 = jax.ShapeDtypeStruct((), np.float32)
# Counts up until adding one no longer changes the float (2**24), then spins forever.
ENDLESS = _export(lambda x: lax.while_loop(lambda c: c > -1.0, lambda c: c + 1.0, x), F32)
DOUBLE = _export(lambda x: x * 2, F32)


_open: list[httpx.Client] = []


@pytest.fixture(autouse=True)
def _close_callers() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


class Caller:
    """REST calls as one API key (closed at the end of the test)."""

    def __init__(self, url: str, key: str | None = None) -> None:
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=60)
        _open.append(self.http)

    def upload(self, program: bytes) -> str:
        r = self.http.post("/v1/programs", content=program,
                           headers={"content-type": wire.OCTET_STREAM})
        assert r.status_code in (200, 201), r.text
        return r.json()["program_id"]

    def execute(self, pid: str, x: float, **extra: Any) -> str:
        r = self.http.post(f"/v1/programs/{pid}/execute",
                           content=wire.packb({"args": [np.float32(x)], **extra}),
                           headers={"content-type": wire.MSGPACK})
        assert r.status_code in (200, 202), r.text
        return r.json()["future_id"]

    def final(self, fid: str, within_s: float) -> dict[str, Any]:
        """The future's view once final; fails the test if it is not within ``within_s``."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            view = self.http.get(f"/v1/futures/{fid}", params={"wait": 1000}).json()
            if view["status"] in ("done", "failed", "cancelled"):
                return view
        pytest.fail(f"future {fid} still {view['status']} after {within_s} s")

    def value(self, fid: str) -> float:
        r = self.http.get(f"/v1/futures/{fid}/result", params={"wait": 30_000})
        assert r.status_code == 200, r.text
        return float(wire.unpackb(r.content)["outputs"][0])


def _runtimes(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/readyz", timeout=10).json()["runtimes"]


def test_endless_loops_time_out_while_another_key_goes_on(start_server) -> None:
    url = start_server({"JITSERVE_API_KEYS": f"{KEY_A},{KEY_B}", "JITSERVE_RUNTIMES": "2",
                        "JITSERVE_EXECUTION_TIMEOUT_S": "3", "JITSERVE_EXECUTOR_THREADS": "4"})
    a, b = Caller(url, KEY_A), Caller(url, KEY_B)
    b_double = b.upload(DOUBLE)
    earlier = b.execute(b_double, 21)
    assert b.value(earlier) == 42
    endless = a.upload(ENDLESS)
    started = time.monotonic()
    loops = [a.execute(endless, i) for i in range(4)]
    ok = 0
    for i in range(5):  # B's calls keep succeeding while A's loops spin
        if b.value(b.execute(b_double, i)) == 2 * i:
            ok += 1
        time.sleep(0.3)
    assert ok == 5
    for fid in loops:
        view = a.final(fid, within_s=30)
        assert view["status"] == "failed", view
        assert view["error"]["code"] == "execution_timeout", view["error"]
        assert "deadline of 3 s" in view["error"]["message"]
    # Within the deadline plus a restart (a loose bound: this machine is small and shared).
    assert time.monotonic() - started < 25
    assert b.value(earlier) == 42  # B's runtime was never touched
    assert metric_total(url, "jitserve_runtime_restarts_total") >= 1
    wait_ready(url)
    assert b.value(b.execute(b_double, 5)) == 10


def test_a_caller_may_ask_for_a_shorter_deadline(start_server) -> None:
    url = start_server({"JITSERVE_EXECUTION_TIMEOUT_S": "120"})
    c = Caller(url)
    fid = c.execute(c.upload(ENDLESS), 0, timeout_s=1.5)
    view = c.final(fid, within_s=30)
    assert view["error"]["code"] == "execution_timeout"
    assert "deadline of 1.5 s" in view["error"]["message"]
    wait_ready(url)
    assert c.value(c.execute(c.upload(DOUBLE), 4)) == 8


def test_sigkill_of_a_runtime_mid_execution(start_server) -> None:
    url = start_server({"JITSERVE_EXECUTION_TIMEOUT_S": "120"})
    c = Caller(url)
    double = c.upload(DOUBLE)
    kept = c.execute(double, 1)
    assert c.value(kept) == 2
    fid = c.execute(c.upload(ENDLESS), 0)
    deadline = time.monotonic() + 30
    while c.http.get(f"/v1/futures/{fid}").json()["status"] != "running":
        assert time.monotonic() < deadline, "the loop never started"
        time.sleep(0.05)
    (runtime,) = _runtimes(url)
    os.kill(runtime["pid"], signal.SIGKILL)
    killed = time.monotonic()
    view = c.final(fid, within_s=10)
    assert time.monotonic() - killed < 5
    assert view["error"]["code"] == "runtime_crashed"
    assert "SIGKILL" in view["error"]["message"]
    assert httpx.get(f"{url}/healthz").status_code == 200
    # The earlier future's outputs lived in that process: it says so instead of hanging.
    lost = c.final(kept, within_s=5)
    assert lost["status"] == "failed" and lost["error"]["code"] == "runtime_crashed"
    (back,) = wait_ready(url)
    assert back["pid"] != runtime["pid"] and back["restarts"] == 1
    assert "SIGKILL" in back["last_exit"]
    assert c.value(c.execute(double, 3)) == 6  # reloaded from the disk tier
    assert metric_total(url, 'jitserve_runtime_restarts_total{reason="signal"}') == 1
    assert metric_total(url, "jitserve_runtime_restart_seconds") > 0


def test_delete_beside_other_executions_says_why_it_cannot_stop(start_server) -> None:
    url = start_server({"JITSERVE_EXECUTION_TIMEOUT_S": "4", "JITSERVE_EXECUTOR_THREADS": "2"})
    c = Caller(url)
    endless = c.upload(ENDLESS)
    first, second = c.execute(endless, 0), c.execute(endless, 1)
    for fid in (first, second):
        while c.http.get(f"/v1/futures/{fid}").json()["status"] != "running":
            time.sleep(0.05)
    # Two in flight on one runtime: stopping one would take the other down too.
    refused = c.http.delete(f"/v1/futures/{first}").json()
    assert refused["status"] == "running" and "1 other running execution" in refused["detail"]
    assert c.http.get(f"/v1/futures/{first}").status_code == 404  # dropped all the same
    view = c.final(second, within_s=30)  # the deadline ends both
    assert view["error"]["code"] == "execution_timeout"
    wait_ready(url)


def test_delete_cancels_a_lone_running_execution(start_server) -> None:
    url = start_server({"JITSERVE_EXECUTION_TIMEOUT_S": "60"})
    c = Caller(url)
    fid = c.execute(c.upload(ENDLESS), 0)
    while c.http.get(f"/v1/futures/{fid}").json()["status"] != "running":
        time.sleep(0.05)
    answer = c.http.delete(f"/v1/futures/{fid}").json()
    assert answer == {"future_id": fid, "status": "cancelled"}
    assert c.http.get(f"/v1/futures/{fid}").status_code == 404
    wait_ready(url)
    assert c.value(c.execute(c.upload(DOUBLE), 2)) == 4
    assert metric_total(url, 'jitserve_runtime_restarts_total{reason="cancel"}') == 1


def test_a_program_over_the_runtime_memory_cap_fails_clearly(start_server,
                                                              tmp_path: Path) -> None:
    # Device-bytes limits set past the cap: left unset, they would be derived from it
    # and refuse the program before it runs (test_memory_e2e).
    port = _free_port()
    url = start_server({"JITSERVE_RUNTIME_MAX_MEMORY_BYTES": str(2 << 30),
                        "JITSERVE_MAX_DEVICE_BYTES": str(8 << 30),
                        "JITSERVE_MAX_EXECUTION_BYTES": str(8 << 30),
                        "JITSERVE_IFRT_PORT": str(port), "JITSERVE_MAX_BODY_BYTES": str(3 << 30),
                        "JITSERVE_IFRT_MAX_HOST_BYTES": str(3 << 30)})
    c = Caller(url)
    # 4 GiB of output: within the device-bytes limits (8 GiB), past the runtime's cap of 2.
    huge = c.upload(_export(lambda x: jnp.full((1 << 30,), x), F32))
    view = c.final(c.execute(huge, 1), within_s=60)
    assert view["status"] == "failed", view
    assert view["error"]["code"] in ("out_of_memory", "runtime_crashed"), view["error"]
    assert "memory" in view["error"]["message"]
    assert httpx.get(f"{url}/healthz").status_code == 200
    wait_ready(url)
    assert c.value(c.execute(c.upload(DOUBLE), 5)) == 10

    # The cap is left to programs: a fresh runtime took 1.7 GB of it, most of it malloc
    # arenas reserved and never used, and failed a 256 MiB device_put; with four
    # arenas it starts in about 0.9 GB.
    room = run_program({"target": f"127.0.0.1:{port}"}, """
        import jax, numpy as np
        print(float(jax.device_put(np.ones(64 << 20, np.float32)).sum()))
    """, tmp_path, key=None)
    assert room.returncode == 0 and room.stdout.strip() == str(float(64 << 20)), room.stderr[-3000:]

    # Through the IFRT proxy: a host buffer the runtime cannot even map (its address
    # space would pass the cap) fails the array made from it, naming the cap, and the
    # session goes on. (It ended the session, INTERNAL, before.)
    used = max(int(next(line.split()[1] for line in
                        Path(f"/proc/{r['pid']}/status").read_text().splitlines()
                        if line.startswith("VmSize:"))) * 1024 for r in _runtimes(url))
    size = (3 << 30) - used + (64 << 20)
    program = run_program({"target": f"127.0.0.1:{port}"}, f"""
        import jax, jax.numpy as jnp, numpy as np
        try:
            print(float(jax.device_put(np.ones({size}, np.uint8)).sum()))
        except jax.errors.JaxRuntimeError as e:
            print("refused:", e)
        print("after:", float((jnp.ones(3) * 2).sum()))
    """, tmp_path, key=None)
    assert program.returncode == 0, program.stderr[-3000:]
    assert "refused: RESOURCE_EXHAUSTED" in program.stdout, program.stdout
    assert "out of memory (this runtime's limit is 2,147,483,648 bytes, " \
        "JITSERVE_RUNTIME_MAX_MEMORY_BYTES)" in program.stdout
    assert program.stdout.splitlines()[-1] == "after: 6.0"


def test_runtimes_have_no_network_without_redis(server_url: str) -> None:
    # Each runtime is in a network namespace of its own (no interfaces up); the API
    # process, like this test, is in the host's.
    host = os.readlink("/proc/self/ns/net")
    for runtime in _runtimes(server_url):
        assert os.readlink(f"/proc/{runtime['pid']}/ns/net") != host
