"""Real ``jitserve serve`` processes sharing one real Redis (docs/redis.md).

Each test starts its own servers (about 2 s each) on its own key prefix, so the
counters it reads are its own. Tests that stop Redis start a private one.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jax
import jaxlib
import numpy as np
import pytest
import redis
from e2e.conftest import api_loads_jax
from jax import export
from redis_server import RedisServer, free_port

from jitserve import wire
from jitserve.compiler.redis import LAYOUT_VERSION

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
MP = {"content-type": wire.MSGPACK}
X = np.arange(6, dtype=np.float32).reshape(2, 3)
StartServer = Callable[..., str]
# Every server sharing a Redis signs its entries with the same secret (docs/redis.md).
CACHE_SECRET = "e2e-cache-secret-" + "7d3e" * 8


def _export(fn: Any) -> bytes:
    return bytes(export.export(jax.jit(fn))(jax.ShapeDtypeStruct((2, 3), np.float32)).serialize())


def _pair(start_server: StartServer, url: str, prefix: str, **env: str) -> tuple[str, str]:
    """Two servers, A and B, sharing the Redis at ``url`` under ``prefix``."""
    env = {"REDIS_URL": url, "JITSERVE_REDIS_PREFIX": prefix, "JITSERVE_CACHE_SECRET": CACHE_SECRET,
           "JITSERVE_REDIS_LOCK_TTL_S": "2", "JITSERVE_REDIS_WAIT_S": "60", **env}
    return start_server(env, "a"), start_server(env, "b")


def _upload(url: str, data: bytes) -> str:
    r = httpx.post(f"{url}/v1/programs", content=data, timeout=60,
                   headers={"content-type": "application/octet-stream"})
    assert r.status_code in (200, 201), r.text
    return str(r.json()["program_id"])


def _run(url: str, pid: str) -> np.ndarray:
    """Execute ``pid`` on X through ``url`` and wait for the (first) output."""
    r = httpx.post(f"{url}/v1/programs/{pid}/execute", params={"wait": 60_000},
                   content=wire.packb({"args": [X]}), headers=MP, timeout=90)
    assert r.status_code == 200, r.text
    return np.asarray(wire.unpackb(r.content)["outputs"][0])


def _compile(url: str, pid: str) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/programs/{pid}/compile", json={}, timeout=90)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _metric(url: str, sample: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _compilations(url: str) -> float:
    return _metric(url, "jitserve_compilations_total")


def _redis_hits(url: str) -> float:
    return _metric(url, 'jitserve_cache_hits_total{tier="redis"}')


def _cache_state(url: str) -> str:
    r = httpx.get(f"{url}/readyz", timeout=10)
    assert r.status_code == 200, r.text  # a degraded cache is still ready
    return str(r.json()["cache"])


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 45.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_compiled_on_a_is_a_redis_hit_on_b(start_server: StartServer, redis_url: str,
                                           redis_prefix: str) -> None:
    a, b = _pair(start_server, redis_url, redis_prefix)
    assert _cache_state(a) == _cache_state(b) == "ok"
    pid = _upload(a, _export(lambda x: x * 3 + 1))  # uploaded through A only
    np.testing.assert_array_equal(_run(a, pid), X * 3 + 1)
    np.testing.assert_array_equal(_run(b, pid), X * 3 + 1)
    assert _compilations(a) == 1
    assert _compilations(b) == 0 and _redis_hits(b) == 1
    assert _metric(a, 'jitserve_redis_bytes_total{direction="written"}') > 0
    assert _metric(b, 'jitserve_redis_bytes_total{direction="read"}') > 0
    assert _metric(b, "jitserve_redis_errors_total") == 0

    page = httpx.get(f"{b}/v1/executables", timeout=10).json()
    assert page["next_cursor"] is None and len(page["executables"]) == 1
    # A cursor past SCAN's 64 bits is the caller's mistake, not the cache's outage.
    bad = httpx.get(f"{b}/v1/executables", params={"cursor": str(1 << 64)}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request", bad.text
    record = page["executables"][0]
    assert record["source"] == "redis" and record["hits"] == 1 and record["program_id"] == pid
    assert record["compile_seconds"] > 0 and 0 < record["size"] and 0 < record["raw_size"]
    assert record["jaxlib_version"] == jaxlib.__version__ and record["device_kind"]
    one = httpx.get(f"{a}/v1/executables/{record['executable_id']}", timeout=10)
    assert one.status_code == 200 and one.json()["executable_id"] == record["executable_id"]
    missing = httpx.get(f"{a}/v1/executables/{'0' * 64}", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    # Redis's catalog, read by the API processes, left jax out of them (test_rest.py).
    assert api_loads_jax(a) == api_loads_jax(b) == []


def test_concurrent_first_calls_compile_once(start_server: StartServer, redis_url: str,
                                             redis_prefix: str) -> None:
    a, b = _pair(start_server, redis_url, redis_prefix)
    pid = _upload(a, _export(lambda x: x * 5 - 2))
    barrier = threading.Barrier(8)
    answers: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def call(url: str) -> None:
        try:
            barrier.wait()
            answers.append(_compile(url, pid))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=((a, b)[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _compilations(a) + _compilations(b) == 1
    assert [x["tier"] for x in answers].count("compiled") == 1
    assert len({x["executable_id"] for x in answers}) == 1


def test_redis_killed_mid_run_then_back(start_server: StartServer,
                                        redis_server: Callable[..., RedisServer],
                                        redis_prefix: str) -> None:
    server = redis_server()
    a, b = _pair(start_server, server.url, redis_prefix)
    first = _upload(a, _export(lambda x: x + 10))
    np.testing.assert_array_equal(_run(a, first), X + 10)
    server.kill()
    # Calls keep succeeding: A from its L1, B compiles what it never saw.
    np.testing.assert_array_equal(_run(a, first), X + 10)
    during = _upload(b, _export(lambda x: x - 10))
    np.testing.assert_array_equal(_run(b, during), X - 10)
    assert _cache_state(b) == "degraded"
    assert _metric(b, "jitserve_redis_errors_total") >= 1
    assert httpx.get(f"{b}/v1/executables", timeout=10).status_code == 503

    server.start()  # same port, empty: no persistence
    _wait_for(lambda: _cache_state(b) == "ok")
    after = _upload(a, _export(lambda x: x * 7))
    np.testing.assert_array_equal(_run(a, after), X * 7)
    hits, compiles = _redis_hits(b), _compilations(b)
    np.testing.assert_array_equal(_run(b, after), X * 7)  # uploaded through A after the restart
    assert _redis_hits(b) == hits + 1 and _compilations(b) == compiles


def test_redis_unreachable_at_start(start_server: StartServer,
                                    redis_server: Callable[..., RedisServer],
                                    redis_prefix: str) -> None:
    port = free_port()
    url = start_server({"REDIS_URL": f"redis://127.0.0.1:{port}/0",
                        "JITSERVE_REDIS_PREFIX": redis_prefix,
                        "JITSERVE_CACHE_SECRET": CACHE_SECRET})
    assert _cache_state(url) == "degraded"
    pid = _upload(url, _export(lambda x: x / 2))
    np.testing.assert_array_equal(_run(url, pid), X / 2)
    assert _metric(url, "jitserve_redis_errors_total") >= 1
    r = httpx.get(f"{url}/v1/executables", timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
    redis_server(port=port)
    _wait_for(lambda: _cache_state(url) == "ok")


def test_corrupt_entry_is_recompiled(start_server: StartServer, redis_url: str,
                                     redis_prefix: str) -> None:
    a, b = _pair(start_server, redis_url, redis_prefix)
    pid = _upload(a, _export(lambda x: x * x))
    executable_id = _compile(a, pid)["executable_id"]
    raw = redis.Redis.from_url(redis_url)
    name = f"jitserve:v{LAYOUT_VERSION}:{redis_prefix}:exe:{executable_id}"
    good = raw.get(name)
    assert good is not None
    raw.set(name, good[: len(good) // 2])  # truncated by hand
    np.testing.assert_array_equal(_run(b, pid), X * X)  # no error reaches the caller
    assert _compilations(b) == 1 and _redis_hits(b) == 0
    assert len(raw.get(name) or b"") > len(good) // 2  # B stored a whole entry again
    raw.close()


def test_swapped_entry_is_recompiled(start_server: StartServer, redis_url: str,
                                     redis_prefix: str) -> None:
    """X's entry written under Y's key (by a writer to Redis without the secret): B runs Y."""
    a, b = _pair(start_server, redis_url, redis_prefix)
    px, py = _upload(a, _export(lambda x: x * x)), _upload(a, _export(lambda x: x + 100))
    x_id, y_id = _compile(a, px)["executable_id"], _compile(a, py)["executable_id"]
    raw = redis.Redis.from_url(redis_url)
    name = f"jitserve:v{LAYOUT_VERSION}:{redis_prefix}:exe:"
    x_entry = raw.get(name + x_id)
    assert x_entry is not None
    raw.set(name + y_id, x_entry)
    np.testing.assert_array_equal(_run(b, py), X + 100)  # Y's answer, not X's
    assert _compilations(b) == 1 and _redis_hits(b) == 0
    np.testing.assert_array_equal(_run(b, px), X * X)  # X's own entry still hits
    assert _redis_hits(b) == 1
    assert raw.get(name + y_id) != x_entry  # B stored Y's own entry again
    raw.close()


_HOLDER = """
import sys, time
from jitserve.compiler import CacheSecret, Compiler, CompilerConfig
from jitserve.compiler.redis import RedisSettings, RedisTiers
url, prefix, path = sys.argv[1:4]
compiler = Compiler(CompilerConfig())
key = compiler.executable_id(compiler.decode(open(path, "rb").read()))
tiers = RedisTiers(RedisSettings.from_url(url, prefix=prefix, lock_ttl_s=3),
                   CacheSecret.per_process())  # it only locks
lock = tiers.executables.compile_lock(key)  # kept referenced: collecting it would release it
assert lock.__enter__() is True
print(key, flush=True)
time.sleep(600)
"""


def test_killed_lock_holder_lock_expires(start_server: StartServer, redis_url: str,
                                         redis_prefix: str, tmp_path: Path) -> None:
    a, _ = _pair(start_server, redis_url, redis_prefix)
    data = _export(lambda x: x * 11)
    pid = _upload(a, data)
    (tmp_path / "program.bin").write_bytes(data)
    # Another process takes the compile lock, as if compiling, and keeps renewing it.
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, redis_url, redis_prefix,
                               str(tmp_path / "program.bin")],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout is not None
        key = holder.stdout.readline().strip()
        answer: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: answer.update(_compile(a, pid)))
        start = time.monotonic()
        waiter.start()
        time.sleep(6.0)  # twice the lock's expiry: only renewal keeps it
        assert waiter.is_alive(), f"A compiled while a live process held the lock: {answer}"
        holder.send_signal(signal.SIGKILL)  # dies mid-"compile", lock and all
        waiter.join(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    assert answer["tier"] == "compiled" and answer["executable_id"] == key
    assert elapsed < 30  # the lock expired; A did not sit out its 60 s wait
    assert _compilations(a) == 1
