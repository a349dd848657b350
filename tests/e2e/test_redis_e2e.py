"""Real ``jitserve serve`` processes sharing one real Redis (docs/redis.md).

Two servers, A and B, share the session's Redis for the whole module (``pair``): each
test runs programs of its own and reads counters as differences, so it sees only what
it did (a server start costs about 6 s of CPU). Tests that stop Redis start a private
one, and servers of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jaxlib
import numpy as np
import pytest
import redis
from e2e.conftest import _serve, api_loads_jax
from jax import export
from redis_server import RedisServer, delete_prefix, free_port

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


def _env(url: str, prefix: str) -> dict[str, str]:
    """A server's environment for the Redis at ``url``, under ``prefix``."""
    return {"REDIS_URL": url, "JITSERVE_REDIS_PREFIX": prefix, "JITSERVE_CACHE_SECRET": CACHE_SECRET,
            "JITSERVE_REDIS_LOCK_TTL_S": "2", "JITSERVE_REDIS_WAIT_S": "60"}


def _pair(start_server: StartServer, url: str, prefix: str) -> tuple[str, str]:
    """Two servers of this test, A and B, sharing the Redis at ``url`` under ``prefix``."""
    return start_server(_env(url, prefix), "a"), start_server(_env(url, prefix), "b")


@dataclasses.dataclass(frozen=True)
class Pair:
    """The module's servers, A and B, sharing the session's Redis under ``prefix``."""

    a: str
    b: str
    prefix: str


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Pair]:
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    with contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(contextlib.contextmanager(_serve)(
            tmp_path_factory.mktemp(name), _env(redis_url, prefix))) for name in "ab")
        yield Pair(a, b, prefix)
    delete_prefix(redis_url, prefix)


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


def test_compiled_on_a_is_a_redis_hit_on_b(pair: Pair) -> None:
    a, b = pair.a, pair.b
    assert _cache_state(a) == _cache_state(b) == "ok"
    compiles_a, compiles_b, hits_b = _compilations(a), _compilations(b), _redis_hits(b)
    written = _metric(a, 'jitserve_redis_bytes_total{direction="written"}')
    read = _metric(b, 'jitserve_redis_bytes_total{direction="read"}')
    errors = _metric(b, "jitserve_redis_errors_total")
    pid = _upload(a, _export(lambda x: x * 3 + 1))  # uploaded through A only
    np.testing.assert_array_equal(_run(a, pid), X * 3 + 1)
    np.testing.assert_array_equal(_run(b, pid), X * 3 + 1)
    assert _compilations(a) == compiles_a + 1
    assert _compilations(b) == compiles_b and _redis_hits(b) == hits_b + 1
    assert _metric(a, 'jitserve_redis_bytes_total{direction="written"}') > written
    assert _metric(b, 'jitserve_redis_bytes_total{direction="read"}') > read
    assert _metric(b, "jitserve_redis_errors_total") == errors

    page = httpx.get(f"{b}/v1/executables", timeout=10).json()
    assert page["next_cursor"] is None
    page["executables"] = [e for e in page["executables"] if e["program_id"] == pid]
    assert len(page["executables"]) == 1
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


def test_concurrent_first_calls_compile_once(pair: Pair) -> None:
    a, b = pair.a, pair.b
    compiles = _compilations(a) + _compilations(b)
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
    assert _compilations(a) + _compilations(b) == compiles + 1
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


def test_corrupt_entry_is_recompiled(pair: Pair, redis_url: str) -> None:
    a, b = pair.a, pair.b
    pid = _upload(a, _export(lambda x: x * x))
    executable_id = _compile(a, pid)["executable_id"]
    compiles, hits = _compilations(b), _redis_hits(b)
    raw = redis.Redis.from_url(redis_url)
    name = f"jitserve:v{LAYOUT_VERSION}:{pair.prefix}:exe:{executable_id}"
    good = raw.get(name)
    assert good is not None
    raw.set(name, good[: len(good) // 2])  # truncated by hand
    np.testing.assert_array_equal(_run(b, pid), X * X)  # no error reaches the caller
    assert _compilations(b) == compiles + 1 and _redis_hits(b) == hits
    assert len(raw.get(name) or b"") > len(good) // 2  # B stored a whole entry again
    raw.close()


def test_swapped_entry_is_recompiled(pair: Pair, redis_url: str) -> None:
    """X's entry written under Y's key (by a writer to Redis without the secret): B runs Y."""
    a, b = pair.a, pair.b
    px, py = _upload(a, _export(lambda x: x * x - 1)), _upload(a, _export(lambda x: x + 100))
    x_id, y_id = _compile(a, px)["executable_id"], _compile(a, py)["executable_id"]
    compiles, hits = _compilations(b), _redis_hits(b)
    raw = redis.Redis.from_url(redis_url)
    name = f"jitserve:v{LAYOUT_VERSION}:{pair.prefix}:exe:"
    x_entry = raw.get(name + x_id)
    assert x_entry is not None
    raw.set(name + y_id, x_entry)
    np.testing.assert_array_equal(_run(b, py), X + 100)  # Y's answer, not X's
    assert _compilations(b) == compiles + 1 and _redis_hits(b) == hits
    np.testing.assert_array_equal(_run(b, px), X * X - 1)  # X's own entry still hits
    assert _redis_hits(b) == hits + 1
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


def test_killed_lock_holder_lock_expires(pair: Pair, redis_url: str, tmp_path: Path) -> None:
    a = pair.a
    compiles = _compilations(a)
    data = _export(lambda x: x * 11)
    pid = _upload(a, data)
    (tmp_path / "program.bin").write_bytes(data)
    # Another process takes the compile lock, as if compiling, and keeps renewing it.
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, redis_url, pair.prefix,
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
    assert _compilations(a) == compiles + 1
