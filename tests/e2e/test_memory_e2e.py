"""Memory and connections of a real ``jitserve serve`` process (issue 16).

Lying ``Content-Length``s cost no memory, disconnects are no 500s, stalled bodies and
slow, idle or big request heads are cut off by the configured timeouts, and a
program whose intermediates pass the per-run device-memory limit is refused before
it runs. Timeouts are small here so that every loop is short and bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax

from jitserve import wire

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
GiB = 1 << 30
StartServer = Callable[..., str]


def _export(fn: Any, shape: tuple[int, ...]) -> bytes:
    spec = jax.ShapeDtypeStruct(shape, np.float32)
    return bytes(export.export(jax.jit(fn))(spec).serialize())


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _server_pid(url: str) -> int:
    """The pid of the ``jitserve serve`` process listening on ``url``'s port."""
    port = str(_address(url)[1]).encode()
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if b"jitserve.service" in args and b"--port" in args and port in args:
            return int(proc.name)
    raise AssertionError(f"no jitserve process on port {port.decode()}")


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _metrics(http: httpx.Client) -> dict[str, float]:
    samples = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def _no_500(samples: dict[str, float]) -> None:
    bad = {k: v for k, v in samples.items()
           if k.startswith("jitserve_requests_total") and 'status="5' in k and v}
    assert not bad, bad


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and the seconds that took."""
    t0 = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic() - t0


def _error(answer: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.lower().count(b"connection: close") == 1, head
    return json.loads(body)["error"]


def _execute_head(program_id: str, length: int) -> bytes:
    return (f"POST /v1/programs/{program_id}/execute HTTP/1.1\r\nHost: e2e\r\n"
            f"Content-Type: {wire.MSGPACK}\r\nContent-Length: {length}\r\n\r\n").encode()


def _upload(http: httpx.Client, program: bytes) -> str:
    r = http.post("/v1/programs", content=program,
                  headers={"content-type": "application/octet-stream"})
    assert r.status_code in (200, 201), r.text
    return r.json()["program_id"]


def _add_one(http: httpx.Client) -> str:
    """Upload x + 1 on float32[3] and run it once (warming the execute path)."""
    pid = _upload(http, _export(lambda x: x + 1.0, (3,)))
    r = http.post(f"/v1/programs/{pid}/execute", params={"wait": 30_000},
                  content=wire.packb({"args": [np.zeros(3, np.float32)]}),
                  headers={"content-type": wire.MSGPACK})
    assert r.status_code == 200, r.text
    return pid


def test_lying_content_lengths_cost_no_memory(start_server: StartServer, tmp_path: Path) -> None:
    url = start_server({"JITSERVE_LOG_LEVEL": "info", "JITSERVE_MAX_BODY_BYTES": str(2 * GiB)},
                       "liars")
    pid = _server_pid(url)
    with httpx.Client(base_url=url, timeout=60) as http, contextlib.ExitStack() as stack:
        program_id = _add_one(http)
        before = _rss(pid)
        for _ in range(3):  # 1 GiB declared, 10 bytes sent, and the client waits
            sock = stack.enter_context(socket.create_connection(_address(url)))
            sock.sendall(_execute_head(program_id, GiB) + b"0123456789")
        time.sleep(1.0)
        during = _rss(pid)
        stack.close()  # the clients go away
        aborted = 'jitserve_request_bodies_aborted_total{reason="disconnect"}'
        assert _wait_for(lambda: _metrics(http).get(aborted) == 3, 20)
        after = _rss(pid)
        samples = _metrics(http)
    assert during - before < 100 * MiB, (before, during)
    assert after - before < 100 * MiB, (before, after)
    _no_500(samples)
    route = 'route="/v1/programs/{program_id}/execute"'
    assert samples[f'jitserve_requests_total{{{route},status="499"}}'] == 3
    log = (tmp_path / "liars" / "server.log").read_text()
    assert log.count("disconnected before its request body ended after 10 of "
                     "1,073,741,824 bytes") == 3, log[-3000:]
    assert "Exception in ASGI application" not in log


def test_stalled_body_gets_the_timeout_error(start_server: StartServer) -> None:
    url = start_server({"JITSERVE_BODY_TIMEOUT_S": "1"}, "stall")
    with httpx.Client(base_url=url, timeout=60) as http:
        program_id = _add_one(http)
        with socket.create_connection(_address(url)) as sock:
            sock.sendall(_execute_head(program_id, 100) + b"\x81")  # then nothing
            answer, seconds = _read_until_closed(sock, timeout_s=15)
        samples = _metrics(http)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    error = _error(answer)
    assert error["code"] == "bad_request" and "JITSERVE_BODY_TIMEOUT_S" in error["message"]
    assert 0.9 <= seconds < 10
    assert samples['jitserve_request_bodies_aborted_total{reason="timeout"}'] == 1
    _no_500(samples)


def test_slow_headers_are_closed_within_the_timeout(start_server: StartServer) -> None:
    timeout_s, n = 2.0, 30
    url = start_server({"JITSERVE_HEADER_TIMEOUT_S": str(timeout_s)}, "slow")
    head = b"GET /healthz HTTP/1.1\r\nHost: e2e\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n"
    closed_at: dict[int, float] = {}
    answers: dict[int, bytes] = {}
    with httpx.Client(base_url=url, timeout=10) as http, contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.create_connection(_address(url))) for _ in range(n)]
        t0 = time.monotonic()
        for tick in range(int(timeout_s) + 6):  # one header byte per second on each
            for i, sock in enumerate(socks):
                if i not in closed_at and _drain(sock, answers, i):
                    closed_at[i] = time.monotonic() - t0
                if i not in closed_at:
                    try:
                        sock.send(head[tick:tick + 1])
                    except OSError:
                        closed_at[i] = time.monotonic() - t0
            assert http.get("/healthz").status_code == 200  # others are served meanwhile
            if len(closed_at) == n:
                break
            time.sleep(max(0.0, t0 + tick + 1 - time.monotonic()))
        samples = _metrics(http)
    assert len(closed_at) == n, f"{n - len(closed_at)} slow connections still open"
    assert timeout_s - 0.5 <= min(closed_at.values())
    assert max(closed_at.values()) <= timeout_s + 2.5, closed_at
    answered = [a for a in answers.values() if a]
    assert answered, "no connection got the timeout's answer"
    for answer in answered:
        assert answer.startswith(b"HTTP/1.1 400 ")
        assert "JITSERVE_HEADER_TIMEOUT_S" in _error(answer)["message"]
    assert samples['jitserve_connections_closed_total{reason="header_timeout"}'] >= n


def _drain(sock: socket.socket, answers: dict[int, bytes], i: int) -> bool:
    """Read what the server sent without blocking; whether it closed the connection."""
    sock.setblocking(False)
    try:
        while chunk := sock.recv(65536):
            answers[i] = answers.get(i, b"") + chunk
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_big_heads_idle_and_kept_alive_connections_are_closed(start_server: StartServer) -> None:
    url = start_server({"JITSERVE_HEADER_TIMEOUT_S": "2", "JITSERVE_MAX_HEAD_BYTES": "4096",
                        "JITSERVE_KEEPALIVE_TIMEOUT_S": "1"}, "heads")
    with socket.create_connection(_address(url)) as big:
        big.sendall(b"GET /healthz HTTP/1.1\r\nHost: e2e\r\nX-Big: " + b"a" * 8000)
        answer, _ = _read_until_closed(big, timeout_s=10)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert "JITSERVE_MAX_HEAD_BYTES" in _error(answer)["message"]
    with socket.create_connection(_address(url)) as idle:
        answer, seconds = _read_until_closed(idle, timeout_s=10)
    assert answer == b"" and 1.5 <= seconds <= 4.5
    with socket.create_connection(_address(url)) as kept:
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: e2e\r\n\r\n")
        answer, seconds = _read_until_closed(kept, timeout_s=10)
    assert answer.startswith(b"HTTP/1.1 200 ") and 0.5 <= seconds <= 3.5
    # The next head on a kept-alive connection arms the deadline at its first bytes
    # (a head that comes whole in them never needs it).
    with socket.create_connection(_address(url)) as trickled:
        trickled.sendall(b"GET /healthz HTTP/1.1\r\nHost: e2e\r\n\r\n")
        first = b""
        while not first.endswith(b"}"):  # the whole answer: head, then its JSON body
            first += trickled.recv(65536)
        trickled.sendall(b"GET /healthz HTTP/1.1\r\nHost: e2")  # then nothing
        answer, seconds = _read_until_closed(trickled, timeout_s=10)
    assert first.startswith(b"HTTP/1.1 200 ")
    assert answer.startswith(b"HTTP/1.1 400 ") and 1.5 <= seconds <= 4.5, (answer[:200], seconds)
    assert "JITSERVE_HEADER_TIMEOUT_S" in _error(answer)["message"]
    with httpx.Client(base_url=url, timeout=10) as http:
        samples = _metrics(http)
    assert samples['jitserve_connections_closed_total{reason="header_too_large"}'] == 1
    assert samples['jitserve_connections_closed_total{reason="header_timeout"}'] >= 2
    _no_500(samples)


def _carry_1gib(x: jax.Array, gib: int = 1) -> jax.Array:
    """A loop that carries ``gib`` GiB of float32 and outputs 4 bytes."""
    big = jnp.full((gib * GiB // 4,), x, jnp.float32)
    return lax.fori_loop(0, 3, lambda i, c: c * 1.5 + 1.0, big)[0]


def test_big_intermediates_are_refused_before_they_run(start_server: StartServer) -> None:
    url = start_server({"JITSERVE_MAX_EXECUTION_BYTES": str(256 * MiB)}, "temp")
    pid = _server_pid(url)
    with httpx.Client(base_url=url, timeout=120) as http:
        program_id = _upload(http, _export(_carry_1gib, ()))
        before = _rss(pid)
        r = http.post(f"/v1/programs/{program_id}/execute", params={"wait": 30_000},
                      content=wire.packb({"args": [np.float32(1)]}),
                      headers={"content-type": wire.MSGPACK})
        # Accepted before its compile; once compiled, its size fails the future.
        assert r.status_code == 202 and r.json()["status"] == "failed", r.text
        error = http.get(f"/v1/futures/{r.json()['future_id']}").json()["error"]
        assert error["code"] == "limit_exceeded"
        assert "1,073,741," in error["message"] and "268,435,456" in error["message"]
        assert "JITSERVE_MAX_EXECUTION_BYTES" in error["message"]
        assert _rss(pid) - before < 256 * MiB  # the loop never ran
        assert http.get("/healthz").status_code == 200
        _add_one(http)  # and the server still runs programs
        _no_500(_metrics(http))


def test_device_limits_left_unset_come_from_the_runtimes_memory(start_server: StartServer) -> None:
    # No JITSERVE_MAX_DEVICE_BYTES or JITSERVE_MAX_EXECUTION_BYTES: on the CPU they are
    # derived from the runtime's memory cap (half of it; on a GPU, from XLA's limit).
    url = start_server({"JITSERVE_RUNTIME_MAX_MEMORY_BYTES": str(3 * GiB)}, "derived")
    share = 3 * GiB // 2
    with httpx.Client(base_url=url, timeout=120) as http:
        devices = http.get("/v1/console/devices").json()
        assert devices["max_device_bytes"] == share
        run = {"params": {"wait": 30_000}, "content": wire.packb({"args": [np.float32(1)]}),
               "headers": {"content-type": wire.MSGPACK}}
        # 2 GiB of output: over the share, refused at the call (outputs are known then).
        program_id = _upload(http, _export(lambda x: jnp.full((GiB // 2,), x), ()))
        r = http.post(f"/v1/programs/{program_id}/execute", **run)
        assert r.status_code == 422 and r.json()["error"]["code"] == "limit_exceeded", r.text
        assert f"{share:,}" in r.json()["error"]["message"]
        # 2 GiB carried by a loop, 4 bytes out: refused once compiled, never run.
        program_id = _upload(http, _export(lambda x: _carry_1gib(x, gib=2), ()))
        r = http.post(f"/v1/programs/{program_id}/execute", **run)
        assert r.status_code == 202 and r.json()["status"] == "failed", r.text
        error = http.get(f"/v1/futures/{r.json()['future_id']}").json()["error"]
        assert error["code"] == "limit_exceeded", error
        assert "JITSERVE_MAX_EXECUTION_BYTES" in error["message"]
        assert f"{share:,}" in error["message"]
        assert http.get("/healthz").status_code == 200
        _add_one(http)
        _no_500(_metrics(http))


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started: a server's runtimes. Not their compile workers,
    which hold no program a runtime decoded, and which grow by about 70 MiB while
    they start (jax's import): seconds after the server answers, or, on a loaded
    machine, during the measurement, which they pushed past its bound (1.506)."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def _constant_program(seed: int) -> bytes:
    """``x + c`` with a random float32 ``c`` of 16 MiB: a 16 MiB jax.export artifact."""
    c = np.random.default_rng(seed).standard_normal(16 * MiB // 4).astype(np.float32)
    return _export(lambda x: x + c, c.shape)


def test_a_keys_programs_are_held_once_in_each_process(start_server: StartServer,
                                                       auth_keys: tuple[str, ...]) -> None:
    """Issue 40: six 32 MiB uploads grew the API process by 52 MiB each and the API plus
    runtimes by 122 MiB: the runtime kept what its pipe and decoder had copied (2.1 copies
    of each program, bench/uploads.py). Now each process holds a program's bytes once, so
    a key's programs cost at most its program-bytes quota in each; past it, nothing is kept."""
    programs = [_constant_program(seed) for seed in range(5)]
    size = len(programs[0])
    # One runtime: the first upload (below) must warm the process the others go to.
    # With two, uploads land on either, and the first decode in a process builds its
    # jax lowering state once (tens of MiB): measured, 3 uploads after a warm-up on
    # the other runtime grew the runtimes by 1.8-2.6 times the programs, one run in
    # four; with one runtime, 1.00-1.28 over seven runs.
    url = start_server({"JITSERVE_API_KEYS": auth_keys[0], "JITSERVE_MAX_BODY_BYTES": str(64 * MiB),
                        "JITSERVE_TENANT_MAX_PROGRAM_BYTES": str(4 * size + size // 2),
                        "JITSERVE_RUNTIMES": "1"}, "held")
    api = _server_pid(url)
    runtimes = _children(api)

    def rss() -> tuple[int, int]:
        return _rss(api), sum(_rss(p) for p in runtimes)

    with httpx.Client(base_url=url, timeout=120,
                      headers={"Authorization": f"Bearer {auth_keys[0]}"}) as http:
        _upload(http, programs[0])  # also pays for the buffers the next uploads reuse
        api_before, runtimes_before = rss()
        for program in programs[1:4]:
            _upload(http, program)
        api_after, runtimes_after = rss()
        held = 3 * size
        assert api_after - api_before < 1.5 * held, (api_after - api_before) / held
        assert runtimes_after - runtimes_before < 1.5 * held, (
            (runtimes_after - runtimes_before) / held)
        # The fifth passes the key's quota: refused before any process keeps it. The
        # runtimes never see it; the API process may keep the freed buffer its body was
        # read into, for the next request (service/memory.py), and nothing more.
        r = http.post("/v1/programs", content=programs[4],
                      headers={"content-type": "application/octet-stream"})
        assert r.status_code == 429 and r.json()["error"]["quota"] == "program_bytes", r.text
        api_refused, runtimes_refused = rss()
        assert api_refused - api_after < size + size // 2
        assert runtimes_refused - runtimes_after < size // 2
        _no_500(_metrics(http))


def test_what_the_server_made_to_start_is_left_out_of_full_collections(
        http: httpx.Client) -> None:
    """``memory.freeze_startup_objects``: a serving process's collector skips the
    objects its start made (about 160,000, which each full collection walked for about
    0.1 s of the event loop's time, finding nothing to free), and /metrics shows it."""
    samples = _metrics(http)
    assert samples["jitserve_gc_frozen_objects"] > 10_000, samples["jitserve_gc_frozen_objects"]
    assert 'python_gc_collections_total{generation="2"}' in samples


# A /dev/shm of its own for the server: a container's is 64 MiB unless it is given more.
_SMALL_SHM = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
              'mount -t tmpfs -o size=48m tmpfs /dev/shm && exec "$@"', "sh"]

_OVER_THE_SHM = """
    import jax, jax.numpy as jnp, numpy as np
    for name, make in (("put", lambda: jax.device_put(np.ones(16 << 20, np.float32)).sum()),
                       ("get", lambda: np.asarray(jnp.zeros(16 << 20, jnp.float32) + 1)[0])):
        try:
            print(name, float(make()))
        except jax.errors.JaxRuntimeError as e:
            print(name, "refused:", e)
    print("after:", float((jnp.ones(3) * 2).sum()))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a private /dev/shm needs a mount namespace (root)")
def test_arrays_past_a_small_dev_shm_are_refused_never_a_crash(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """With a /dev/shm of 48 MiB, a 64 MiB array could not cross to a runtime: the API
    process that wrote its segment died of SIGBUS. Now each way it is refused, naming
    shared memory and what to set, over REST and through the IFRT proxy, and the
    server goes on (and said at start that its shared memory is small)."""
    from e2e.conftest import _free_port, server_process
    from e2e.test_ifrt_programs import run_program

    from jitserve.client import Client
    from jitserve.client.errors import APIError, FutureError

    port = _free_port()
    where = tmp_path_factory.mktemp("small-shm")
    with server_process(where, {"JITSERVE_IFRT_PORT": str(port),
                                "JITSERVE_MAX_BODY_BYTES": str(256 << 20)},
                        wrapper=_SMALL_SHM) as (url, proc):
        assert "shared memory (/dev/shm) is 48 MiB" in (where / "server.log").read_text()
        big = np.ones(16 << 20, np.float32)  # 64 MiB
        with Client(url) as client:
            with pytest.raises(APIError) as put:
                client.device_put(big)
            assert put.value.status_code == 503 and put.value.code == "unavailable"
            assert "no room for 67,108,864 bytes of shared memory in /dev/shm" in str(put.value)
            double = client.jit(lambda a: a * 2)
            with pytest.raises(FutureError, match="no room for 67,108,864 bytes of shared memory"):
                np.asarray(double(big))
            with pytest.raises(APIError, match="shared memory") as fetch:
                np.asarray(client.jit(lambda s: jnp.full((16 << 20,), s))(np.float32(2)))
            assert fetch.value.status_code == 503
            assert np.asarray(double(np.ones(4, np.float32))).tolist() == [2.0] * 4
        program = run_program({"target": f"127.0.0.1:{port}"}, _OVER_THE_SHM, tmp_path, key=None)
        assert program.returncode == 0, program.stderr[-3000:]
        lines = program.stdout.splitlines()
        assert lines[0].startswith("put refused: RESOURCE_EXHAUSTED") and "shared memory" in lines[0]
        assert lines[1].startswith("get refused: RESOURCE_EXHAUSTED") and "shared memory" in lines[1]
        assert lines[2] == "after: 6.0", lines
        assert proc.poll() is None and httpx.get(f"{url}/healthz", timeout=10).status_code == 200
