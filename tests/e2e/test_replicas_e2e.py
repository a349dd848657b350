"""Three ``jitserve serve`` replicas, one Redis, behind a real haproxy (docs/deploy.md).

haproxy balances every request on its own (round robin, HTTP mode), so an SDK
call's upload, execute, status and result may each land on another replica.
The module's replicas share one private ``redis-server``; the tests run in file
order and the last ones are destructive: a replica SIGTERMed (drain), a replica
SIGKILLed, then Redis stopped.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import redis
from corpus import CASES, Case, assert_outputs_match, expected
from e2e.conftest import metric_total
from e2e.test_calls_fuzz_e2e import Walk, _body, upload_programs
from e2e.test_sdk_fuzz_e2e import sdk_walk, wait_back_to
from redis_server import RedisServer, free_port

from jitserve import wire
from jitserve.client import Client

pytestmark = pytest.mark.timeout(300)
jax.config.update("jax_enable_x64", True)

HEARTBEAT_S = 0.5
# A lost replica's key expires after 3 heartbeats; the others notice at their next one.
LOST_WITHIN_S = 4 * HEARTBEAT_S + 2.0
SECRET = "replicas-e2e-cache-secret-" + "9f1c" * 8
KEYS = ("replicas-alice-0123456789", "replicas-bob-0123456789")
AUTH = {"authorization": f"Bearer {KEYS[0]}"}
MP = {"content-type": wire.MSGPACK, "accept": wire.MSGPACK, **AUTH}


class Replica:
    """One ``jitserve serve`` process of the module."""

    def __init__(self, tmp: Path, name: str, env: dict[str, str], port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        (tmp / name).mkdir()
        full = {k: v for k, v in os.environ.items()
                if not k.startswith("JITSERVE_") and k != "REDIS_URL"}
        full.update(env)
        cmd = [sys.executable, "-m", "jitserve.service", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--cache-dir", str(tmp / name / "cache")]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full)

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"replica exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        pytest.fail(f"replica not ready:\n{self.log.read_text()[-3000:]}")

    @property
    def replica_id(self) -> str:
        return str(httpx.get(f"{self.url}/readyz", timeout=5).json()["replica"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _env(redis_url: str, **more: str) -> dict[str, str]:
    return {"REDIS_URL": redis_url, "JITSERVE_REDIS_PREFIX": "replicas",
            "JITSERVE_CACHE_SECRET": SECRET, "JITSERVE_HEARTBEAT_S": str(HEARTBEAT_S),
            "JITSERVE_RUNTIMES": "1", "JITSERVE_LOG_LEVEL": "info",
            "JITSERVE_FUTURE_TTL_S": "300", "JITSERVE_DRAIN_TIMEOUT_S": "1",
            "JITSERVE_API_KEYS": ",".join(KEYS), **more}


HAPROXY_CFG = """\
global
    maxconn 512
defaults
    mode http
    timeout connect 2s
    timeout client 300s
    timeout server 300s
    option redispatch
    retries 2
frontend jitserve
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter 300ms fall 2 rise 1
{routing}{servers}
"""
# docs/deploy.md: requests that name a replica go to the server that answers as it.
ROUTING = """\
    stick-table type string len 32 size 10k expire 1h
    stick match req.hdr(x-jitserve-replica)
    stick store-response res.hdr(x-jitserve-replica)
"""


@contextlib.contextmanager
def _haproxy(tmp: Path, replicas: list[Replica], name: str,
             routing: str = "") -> Iterator[str]:
    """haproxy in front of ``replicas``, balancing each request round robin."""
    port = free_port()
    servers = "\n".join(f"    server r{i} 127.0.0.1:{r.port} check"
                        for i, r in enumerate(replicas))
    cfg = tmp / f"{name}.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=port, servers=servers, routing=routing))
    with (tmp / f"{name}.log").open("wb") as proxy_log:
        proxy = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"],
                                 stdout=proxy_log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        proxy.terminate()
        proxy.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A private Redis, three replicas and haproxy in front of them."""
    tmp = tmp_path_factory.mktemp("replicas")
    with RedisServer(tmp / "redis") as redis_server:
        env = _env(redis_server.url)
        replicas = [Replica(tmp, f"r{i}", env) for i in range(3)]
        try:
            for r in replicas:
                r.wait_ready()
            with _haproxy(tmp, replicas, "haproxy") as url:
                yield {"url": url, "replicas": replicas, "redis": redis_server, "env": env,
                       "tmp": tmp}
        finally:
            for r in replicas:
                r.stop()


def _peer_bytes(url: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("jitserve_peer_bytes_total{"):
            total += float(line.rpartition(" ")[2])
    return total


def _export(fn: Any, *specs: Any) -> bytes:
    return bytes(jax.export.export(jax.jit(fn))(*specs).serialize())


def _upload(url: str, data: bytes) -> str:
    r = httpx.post(f"{url}/v1/programs", content=data, timeout=60,
                   headers={"content-type": wire.OCTET_STREAM, **AUTH})
    assert r.status_code in (200, 201), r.text
    return str(r.json()["program_id"])


def _execute(url: str, pid: str, args: list[Any], **params: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/programs/{pid}/execute", params=params, timeout=120,
                      content=wire.packb({"args": args}), headers=MP)


def test_sdk_runs_the_corpus_through_the_balancer(cluster: dict[str, Any]) -> None:
    replicas = cluster["replicas"]
    ids = {r.replica_id for r in replicas}
    seen: set[str] = set()
    with Client(cluster["url"], api_key=KEYS[0], timeout=180, progress=False) as client:
        cases: list[Case] = list(CASES)
        for case in cases:
            out = client.jit(case.fn)(*case.args())
            leaves = jax.tree_util.tree_leaves(out)
            seen.update(leaf.future_id.partition(".")[0] for leaf in leaves)
            assert_outputs_match(case, [np.asarray(leaf) for leaf in leaves], expected(case))
    assert seen <= ids
    assert len(seen) == 3, f"every replica should have run some calls, got {seen}"


def test_a_chain_of_twenty_steps_hops_replicas(cluster: dict[str, Any]) -> None:
    replicas = cluster["replicas"]
    before = sum(_peer_bytes(r.url) for r in replicas)
    def fn(w: Any, x: Any) -> Any:
        return jnp.tanh(w @ x) + 0.5 * w, jnp.sum(w)

    step = jax.jit(fn)
    w0, x = np.eye(8) * 0.5 + 0.01, np.linspace(-1, 1, 64).reshape(8, 8)
    with Client(cluster["url"], api_key=KEYS[0], timeout=120, progress=False) as client:
        remote = client.jit(fn)
        w, local = client.device_put(w0), w0
        where = []
        for _ in range(20):
            w, s = remote(w, x)
            local, s_local = step(local, x)
            where.append(w.future_id.partition(".")[0])
        np.testing.assert_allclose(np.asarray(w), np.asarray(local), rtol=1e-12)
        np.testing.assert_allclose(float(s), float(s_local), rtol=1e-12)
    # The chain runs where its data is: every step on the replica of the first.
    assert len(set(where)) == 1, where
    moved = sum(_peer_bytes(r.url) for r in replicas) - before
    print(f"bytes moved between replicas over the chain: {moved:.0f}")
    assert moved > 0  # executes and results were forwarded to the data's replica


def test_any_replica_answers_status_long_poll_result_and_delete(cluster: dict[str, Any]) -> None:
    a, b, c = cluster["replicas"]
    pid = _upload(a.url, _export(lambda x: jnp.cumsum(x) * 2,
                                 jax.ShapeDtypeStruct((5,), np.float64)))
    x = np.arange(5.0)
    r = _execute(a.url, pid, [x])
    assert r.status_code == 202, r.text
    fid = r.json()["future_id"]
    assert fid.startswith(a.replica_id + ".")
    # Long-poll on B until done (woken through Redis), then fetch through C.
    status = httpx.get(f"{b.url}/v1/futures/{fid}", params={"wait": 30_000}, timeout=60,
                       headers=AUTH).json()
    if status["status"] != "done":
        status = httpx.get(f"{b.url}/v1/futures/{fid}", params={"wait": 30_000},
                           timeout=60, headers=AUTH).json()
    assert status["status"] == "done", status
    assert status["out_avals"] == [{"shape": [5], "dtype": "float64"}]
    got = httpx.get(f"{c.url}/v1/futures/{fid}/result", headers={"accept": wire.MSGPACK, **AUTH},
                    timeout=60)
    assert got.status_code == 200, got.text
    np.testing.assert_array_equal(wire.unpackb(got.content)["outputs"][0], np.cumsum(x) * 2)
    as_json = httpx.get(f"{c.url}/v1/futures/{fid}/result", timeout=60,
                        headers={"accept": "application/json", **AUTH})
    assert as_json.headers["content-type"].startswith("application/json")
    assert as_json.json()["outputs"][0]["data"] == (np.cumsum(x) * 2).tolist()
    # Another API key sees nothing of it, on any replica.
    bob = {"authorization": f"Bearer {KEYS[1]}"}
    for replica in (a, b, c):
        for path in (f"/v1/futures/{fid}", f"/v1/futures/{fid}/result"):
            r = httpx.get(f"{replica.url}{path}", headers=bob, timeout=30)
            assert r.status_code == 404, (replica.url, path, r.text)
    # Chained through B: runs on A, where the input is.
    r2 = _execute(b.url, pid, [{"future": fid, "output": 0}], wait=30_000)
    assert r2.status_code == 200, r2.text
    np.testing.assert_array_equal(wire.unpackb(r2.content)["outputs"][0],
                                  np.cumsum(np.cumsum(x) * 2) * 2)
    assert wire.unpackb(r2.content)["future_id"].startswith(a.replica_id + ".")
    # Deleted through C: gone everywhere.
    d = httpx.delete(f"{c.url}/v1/futures/{fid}", timeout=30, headers=AUTH)
    assert d.status_code == 200, d.text
    for replica in (a, b, c):
        gone = httpx.get(f"{replica.url}/v1/futures/{fid}", timeout=30, headers=AUTH)
        assert gone.status_code == 404, (replica.url, gone.text)
    # Unknown ids, and forged peer requests, are refused.
    unknown = httpx.get(f"{b.url}/v1/futures/{a.replica_id}.nope", timeout=30, headers=AUTH)
    assert unknown.status_code == 404, unknown.text
    forged = httpx.get(f"{a.url}/v1/futures/{fid}", timeout=30,
                       headers={"x-jitserve-peer": f"{b.replica_id}.{time.time()}.00",
                                "x-jitserve-owner": ""})
    assert forged.status_code == 401, forged.text


def test_a_waited_execute_writes_its_future_once_as_it_answers(
        cluster: dict[str, Any]) -> None:
    """An execute that answers with its outputs writes its future's metadata once, in
    its final state, before the answer (not once per change); with ``keep=false`` the
    future is deleted as it answers, and nothing of it reaches Redis."""
    import redis

    a, b, _ = cluster["replicas"]
    pid = _upload(a.url, _export(lambda x: x * 3.0, jax.ShapeDtypeStruct((4,), np.float32)))
    _execute(a.url, pid, [np.ones(4, np.float32)], wait=30_000)  # warm: compiled
    r = redis.Redis.from_url(cluster["redis"].url)
    events = r.pubsub(ignore_subscribe_messages=True)
    events.psubscribe("*:replicas:cluster:changed:*")
    try:
        kept = _execute(a.url, pid, [np.ones(4, np.float32)], wait=30_000)
        assert kept.status_code == 200, kept.text
        assert kept.headers[wire.REPLICA_HEADER] == a.replica_id  # the lane names it too
        fid = wire.unpackb(kept.content)["future_id"]
        # Written before the answer, as it is then: any replica sees it done at once.
        status = httpx.get(f"{b.url}/v1/futures/{fid}", headers=AUTH, timeout=30).json()
        assert status["status"] == "done", status
        dropped = _execute(a.url, pid, [np.ones(4, np.float32)], wait=30_000, keep="false")
        assert dropped.status_code == 200, dropped.text
        gone = wire.unpackb(dropped.content)["future_id"]
        assert httpx.delete(f"{b.url}/v1/futures/{fid}", headers=AUTH,
                            timeout=30).status_code == 200
        seen: list[str] = []
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:  # written, then deleted
            message = events.get_message(timeout=0.5)
            if message is not None:
                seen.append(message["channel"].decode())
        time.sleep(0.5)  # anything else about these futures would have come by now
        while (message := events.get_message(timeout=0.1)) is not None:
            seen.append(message["channel"].decode())
    finally:
        events.close()
    assert [m.rpartition(":")[2] for m in seen if fid in m] == [fid] * 2, seen
    assert not [m for m in seen if gone in m], seen
    assert r.keys(f"*:replicas:cluster:future:{gone}") == []
    assert r.keys(f"*:replicas:cluster:future:{fid}") == []
    assert httpx.get(f"{b.url}/v1/futures/{gone}", headers=AUTH, timeout=30).status_code == 404


def _connections_to(pid: int, port: int) -> int:
    """Established TCP connections of process ``pid`` to ``127.0.0.1:port`` (/proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if state == "01" and int(remote.partition(":")[2], 16) == port and inode in inodes:
            count += 1
    return count


def test_forwarded_calls_reuse_a_connection_to_the_holder(cluster: dict[str, Any]) -> None:
    a, b, _ = cluster["replicas"]
    pid = _upload(a.url, _export(lambda x: x + 1.0, jax.ShapeDtypeStruct((4,), np.float32)))
    fid = _execute(a.url, pid, [np.zeros(4, np.float32)]).json()["future_id"]
    for _ in range(20):  # each lands on B, which forwards it to A, where its input is
        r = _execute(b.url, pid, [{"future": fid, "output": 0}], wait=30_000, keep="false")
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], np.full(4, 2.0))
    assert _connections_to(b.proc.pid, a.port) <= 2  # not one per forwarded call


def test_a_big_result_streams_through_another_replica(cluster: dict[str, Any]) -> None:
    """An answer over 1 MiB is relayed chunk by chunk, byte for byte."""
    a, b, _ = cluster["replicas"]
    n = 1 << 20  # 4 MiB of float32
    pid = _upload(a.url, _export(lambda x: x * 2.0 - 1.0, jax.ShapeDtypeStruct((n,), np.float32)))
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    r = _execute(a.url, pid, [x], wait=60_000)
    assert r.status_code == 200, r.text
    fid = wire.unpackb(r.content)["future_id"]
    before = _peer_bytes(b.url)
    got = httpx.get(f"{b.url}/v1/futures/{fid}/result", timeout=60,
                    headers={"accept": wire.MSGPACK, **AUTH})
    assert got.status_code == 200, got.text
    assert int(got.headers["content-length"]) == len(got.content) > 4 * n
    np.testing.assert_array_equal(wire.unpackb(got.content)["outputs"][0], x * 2.0 - 1.0)
    assert _peer_bytes(b.url) - before >= 4 * n
    missing = httpx.get(f"{b.url}/v1/futures/{a.replica_id}.{'x' * 32}/result", timeout=30,
                        headers=AUTH)
    assert missing.status_code == 404, missing.text
    assert missing.json()["error"]["code"] == "not_found"


def test_a_balancer_that_routes_by_replica_forwards_nothing(
        cluster: dict[str, Any]) -> None:
    """Answers name their replica; haproxy with stick rules (docs/deploy.md) sends the
    SDK's requests about futures, which name the holder, straight to it."""
    replicas = cluster["replicas"]
    for r in replicas:
        answer = httpx.get(f"{r.url}/healthz", timeout=10)
        assert answer.headers[wire.REPLICA_HEADER] == r.replica_id
    with _haproxy(cluster["tmp"], replicas, "haproxy-routing", ROUTING) as url:
        target = replicas[1].replica_id
        for _ in range(6):  # round robin: haproxy sees each server's name once
            httpx.get(f"{url}/readyz", timeout=10)
        named = {httpx.get(f"{url}/readyz", headers={wire.REPLICA_HEADER: target},
                           timeout=10).json()["replica"] for _ in range(9)}
        assert named == {target}

        def fn(w: Any, x: Any) -> Any:
            return jnp.tanh(w @ x) + 0.5 * w

        w0, x = np.eye(8) * 0.5 + 0.01, np.linspace(-1, 1, 64).reshape(8, 8)
        before = sum(_peer_bytes(r.url) for r in replicas)
        with Client(url, api_key=KEYS[0], timeout=120, progress=False) as client:
            remote, local = client.jit(fn), jax.jit(fn)
            w, expect = client.device_put(w0), w0
            for _ in range(20):
                w, expect = remote(w, x), local(expect, x)
            np.testing.assert_allclose(np.asarray(w), np.asarray(expect), rtol=1e-12)
            del w
        assert sum(_peer_bytes(r.url) for r in replicas) == before


def test_inputs_on_two_replicas_meet_on_one(cluster: dict[str, Any]) -> None:
    a, b, _ = cluster["replicas"]
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    pid = _upload(a.url, _export(lambda x, y: x * y + 1, spec, spec))
    put_a = httpx.post(f"{a.url}/v1/arrays", content=wire.packb(
        {"arrays": [np.arange(4, dtype=np.float32)]}), headers=MP, timeout=30).json()
    put_b = httpx.post(f"{b.url}/v1/arrays", content=wire.packb(
        {"arrays": [np.full(4, 3, dtype=np.float32)]}), headers=MP, timeout=30).json()
    refs = [{"future": put_a["future_id"], "output": 0}, {"future": put_b["future_id"], "output": 0}]
    r = _execute(b.url, pid, refs, wait=30_000)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0],
                                  np.arange(4, dtype=np.float32) * 3 + 1)


@pytest.mark.parametrize("route", ["execute", "calls"])
def test_an_input_donated_from_another_replica_is_released_there(
        cluster: dict[str, Any], route: str) -> None:
    """A call that runs here on a future another replica holds reads a copy of it,
    pulled here; donated, that future's output is released on its replica once the
    call is accepted, as a donated input held here is (it stayed there until its TTL,
    and later calls could still read it)."""
    a, b, _ = cluster["replicas"]
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    pid = _upload(a.url, _export(lambda x, y: x * y + 1, spec, spec))
    _upload(b.url, _export(lambda x, y: x * y + 1, spec, spec))
    futures = [httpx.post(f"{r.url}/v1/arrays", content=wire.packb(
        {"arrays": [np.arange(4, dtype=np.float32) + i]}), headers=MP, timeout=30).json()["future_id"]
        for i, r in enumerate((a, b))]
    call = {"args": [{"future": f, "output": 0} for f in futures], "donate": [0, 1]}
    if route == "execute":  # one input on each replica: it runs on b, where it is sent
        r = httpx.post(f"{b.url}/v1/programs/{pid}/execute", params={"wait": 30_000},
                       timeout=120, content=wire.packb(call), headers=MP)
        assert r.status_code == 200, r.status_code
        out = wire.unpackb(r.content)["outputs"][0]
    else:
        r = httpx.post(f"{b.url}/v1/calls", timeout=120, headers=MP,
                       content=wire.packb({"calls": [{"program_id": pid, **call}]}))
        assert r.status_code == 200, r.text
        done = httpx.get(f"{b.url}/v1/futures/{r.json()['calls'][0]['future_id']}/result",
                         params={"wait": 30_000}, headers=MP, timeout=120)
        assert done.status_code == 200, done.status_code
        out = wire.unpackb(done.content)["outputs"][0]
    np.testing.assert_array_equal(out, np.arange(4) * (np.arange(4) + 1) + 1)
    for f in futures:  # gone for the caller wherever it asks, as jax deletes a donated array
        for r in (a, b):
            got = httpx.get(f"{r.url}/v1/futures/{f}/result", headers=MP, timeout=30)
            assert got.status_code == 404, (f, r.url, got.status_code)
    again = _execute(a.url, pid, [{"future": futures[0], "output": 0}] * 2)
    assert again.status_code in (400, 404), again.status_code


def test_two_keys_walking_at_random_through_the_balancer_lose_nothing(
        cluster: dict[str, Any]) -> None:
    """``test_calls_fuzz_e2e``'s random walk through ``/v1``, by two API keys at once,
    each request balanced to any replica: each key's values are right and its futures
    end, and the ids of the other key's futures, which each names now and then, get
    it nothing (its results and deletes are 404, its releases release nothing), so
    that the other's walk finds its own as it left them."""
    walks: list[Walk] = []
    clients = [httpx.Client(base_url=cluster["url"], timeout=120,
                            headers={"authorization": f"Bearer {key}"}) for key in KEYS]
    try:
        for seed, http in enumerate(clients):
            walks.append(Walk(http, upload_programs(http, slow=False), seed, walks))
        for _ in range(150):
            for walk in walks:
                walk.step()
        for walk in walks:
            ended = walk.settle()
            assert ended["done"] > 0, ended
    finally:
        for http in clients:
            http.close()
    for r in cluster["replicas"]:
        assert httpx.get(f"{r.url}/healthz", timeout=10).status_code == 200


def _live_futures(replicas: list[Replica]) -> float:
    return sum(metric_total(r.url, "jitserve_futures") for r in replicas)


def test_the_sdk_walking_at_random_through_the_balancer_frees_what_it_drops(
        cluster: dict[str, Any]) -> None:
    """The SDK used as a program uses jax, through the balancer (``sdk_walk``): arrays
    put, jitted calls on them running ahead (their inputs on any replica), state
    donated, values read, references dropped at random. Every value read equals
    numpy's; once the program drops what it holds, every replica holds again what it
    held before, wherever the futures were (a donated input another replica held
    stayed there)."""
    replicas = cluster["replicas"]
    before = _live_futures(replicas)
    with Client(cluster["url"], api_key=KEYS[1], run_ahead=8, timeout=120,
                progress=False) as c:
        sdk_walk(c, 5, 300)
        wait_back_to(lambda: _live_futures(replicas), before)


_RESTARTS = itertools.count(1)  # names the logs of replicas started again


class _LosingWalk(Walk):
    """``Walk`` through the balancer while replicas are SIGKILLed now and then and
    started again at the same address, as an orchestrator restarts a pod.

    A killed replica's futures leave the walk's model for ``lost``, and are probed
    (``_probe``): until the others notice the loss (its heartbeat's key expires), an
    answer about one may be what the replica last wrote (its status) or ``unavailable``;
    after, ``replica_lost``, wherever it is asked. Never another answer: in
    particular never a 404, nor what the process now at its address says of it.
    Futures of the live replicas behave as in any walk, those that read a lost one's
    outputs failing with ``replica_lost`` or naming it.
    """

    def __init__(self, http: httpx.Client, ids: dict[str, str], seed: int,
                 cluster: dict[str, Any]) -> None:
        super().__init__(http, ids, seed)
        self.cluster = cluster
        self.failures = self.failures | {"replica_lost"}
        self.lost: dict[str, dict[str, Any]] = {}  # future id -> its model entry
        self.killed: set[str] = set()  # replica ids
        self.probes: collections.Counter[str] = collections.Counter()

    def step(self) -> None:
        if self.lost and self.rng.random() < 0.15:
            self._probe()
        else:
            super().step()

    def checked(self, r: httpx.Response) -> httpx.Response:
        if r.status_code in (502, 503):  # only about a lost replica's future, naming it
            error = (_body(r) or {}).get("error") or {}
            assert error.get("code") in ("replica_lost", "unavailable"), r.text[:300]
            assert any(rid in error.get("message", "") for rid in self.killed), r.text[:300]
            return r
        return super().checked(r)

    def kill(self) -> None:
        """SIGKILL the replica holding most of the walk's futures (which one depends on
        the balancer's turns), move them to ``lost``, start another in its place."""
        replicas = self.cluster["replicas"]
        for r in replicas:
            r.wait_ready()  # the one started last time is up: one down at a time
        ids = [r.replica_id for r in replicas]
        held = collections.Counter(fid.partition(".")[0] for fid in self.futures)
        i = max(range(len(replicas)), key=lambda j: (held[ids[j]], self.rng.random()))
        victim, rid = replicas[i], ids[i]
        victim.stop()
        self.killed.add(rid)
        for fid in [f for f in self.futures if f.startswith(f"{rid}.")]:
            entry = self.futures.pop(fid)
            if not entry["deleted"] and len(entry["released"]) < len(entry["outs"]):
                self.lost[fid] = entry
        replicas[i] = Replica(self.cluster["tmp"], f"r{i}-{next(_RESTARTS)}",
                              self.cluster["env"], port=victim.port)

    def _probe(self) -> None:
        """Ask about a lost future, one way or another; check the answer."""
        fid = self.rng.choice(list(self.lost))
        k = self.rng.choice([k for k in range(len(self.lost[fid]["outs"]))
                             if k not in self.lost[fid]["released"]])
        how = self.rng.choice(["status", "result", "call", "release", "delete"])
        self.probes[how] += 1
        if how == "status":
            r = self.checked(self.http.get(f"/v1/futures/{fid}"))
            assert r.status_code in (200, 503), f"lost future {fid}: {r.text[:300]}"
            if r.status_code == 200:  # done, or failed: for its loss, or for what failed before
                doc = r.json()
                assert doc["status"] != "failed" or doc["error"]["code"] in self.failures, doc
            return
        if how == "result":
            r = self.checked(self.http.get(f"/v1/futures/{fid}/result", params={"outputs": k},
                                           headers={"accept": wire.MSGPACK}))
        elif how == "call":
            r, _ = self.post(f"/v1/programs/{self.ids['double']}/execute",
                             {"args": [{"future": fid, "output": k}]})
        elif how == "release":  # let go of what is gone: nothing released (docs/api.md)
            r, answer = self.post("/v1/futures/release", {"outputs": [{"future": fid, "output": k}]})
            if r.status_code == 200:
                assert answer == {"released": 0, "unknown": 1}, (fid, answer)
                return
        else:
            r = self.checked(self.http.delete(f"/v1/futures/{fid}"))
        assert r.status_code in (502, 503), f"{how} of lost future {fid}: {r.text[:300]}"

    def settle_lost(self) -> None:
        """Each lost future comes to say ``replica_lost`` (its status, unless it had
        failed before for another reason; its result, wherever it is asked)."""
        for fid in self.lost:
            deadline = time.monotonic() + 60
            while True:
                doc = self.checked(self.http.get(f"/v1/futures/{fid}",
                                                 params={"wait": 1000})).json()
                if doc.get("status") in ("failed", "cancelled") or time.monotonic() > deadline:
                    break
            assert doc["status"] in ("failed", "cancelled"), doc
            assert doc["status"] == "cancelled" or doc["error"]["code"] in self.failures, doc
            for r in self.cluster["replicas"]:
                got = httpx.get(f"{r.url}/v1/futures/{fid}/result", headers=AUTH, timeout=30)
                assert got.status_code == 502, got.text[:300]
                assert got.json()["error"]["code"] == "replica_lost", got.text[:300]


@pytest.mark.parametrize("seed", [7])
def test_a_walk_through_the_balancer_with_replicas_killed_under_it_loses_nothing(
        cluster: dict[str, Any], seed: int) -> None:
    """``Walk`` by one key through the balancer, a replica SIGKILLed every so often
    and started again at its address (``_LosingWalk``): every future held ends, done
    with the right values or failed saying why; a lost replica's futures say
    ``replica_lost`` everywhere, and never anything else."""
    with httpx.Client(base_url=cluster["url"], timeout=120, headers=AUTH) as http:
        walk = _LosingWalk(http, upload_programs(http, slow=False), seed, cluster)
        for i in range(300):
            if i in (60, 160):
                walk.kill()
            walk.step()
        for r in cluster["replicas"]:
            r.wait_ready()
        ended = walk.settle()
        walk.settle_lost()
    print(f"ended {dict(ended)}, lost {len(walk.lost)}, probes {dict(walk.probes)}")
    assert ended["done"] > 0 and walk.lost, (ended, walk.lost)
    for r in cluster["replicas"]:
        assert httpx.get(f"{r.url}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("seed", [11])
def test_the_sdk_walking_through_the_balancer_with_replicas_killed_under_it(
        cluster: dict[str, Any], seed: int) -> None:
    """``sdk_walk`` through the balancer, now and then a replica SIGKILLed (with the
    arrays it held) and started again at its address: every value read is right, and
    a read that is not raises ``replica_lost`` (or ``unavailable``, before the others
    know), or ``future_failed`` for a call on such an input; nothing hangs."""
    rng = np.random.default_rng(seed)
    replicas = cluster["replicas"]
    kills = 0

    def kill() -> None:
        nonlocal kills
        for r in replicas:
            r.wait_ready()  # one down at a time
        # the one holding most futures (the walk's, by the balancer's turns), else any
        live = [metric_total(r.url, "jitserve_futures") for r in replicas]
        i = max(range(len(replicas)), key=lambda j: (live[j], rng.random()))
        victim = replicas[i]
        victim.stop()
        kills += 1
        replicas[i] = Replica(cluster["tmp"], f"r{i}-{next(_RESTARTS)}", cluster["env"],
                              port=victim.port)

    with Client(cluster["url"], api_key=KEYS[1], run_ahead=8, timeout=120,
                progress=False) as c:
        lost, _ = sdk_walk(c, seed, 300, kill, lose={"replica_lost", "unavailable",
                                                      "future_failed"})
    for r in replicas:
        r.wait_ready()
    print(f"{kills} replicas killed, {lost} reads raised for it")
    assert kills and lost, (kills, lost)


def test_a_process_at_a_lost_replica_s_address_is_never_taken_for_it(
        cluster: dict[str, Any]) -> None:
    """A replica SIGKILLed and started again at its address, as an orchestrator
    restarts a container, before the others know it went (its heartbeat's key lives
    three heartbeats): what another replica forwards for the lost one's futures
    reaches the new process, which holds none of them. It serves none of it, and the
    answer says why: ``unavailable`` naming both replicas while the loss is not known,
    ``replica_lost`` after; never the new process's ``not_found`` for a future the
    caller holds."""
    a = cluster["replicas"][0]
    env = {**cluster["env"], "JITSERVE_HEARTBEAT_S": "60"}  # its key lives 3 minutes
    old = Replica(cluster["tmp"], "restarted", env)
    new = None
    try:
        old.wait_ready()
        pid = _upload(old.url, _export(lambda x: x + 1, jax.ShapeDtypeStruct((3,), np.float32)))
        done = _execute(old.url, pid, [np.zeros(3, np.float32)], wait=30_000)
        assert done.status_code == 200, done.text
        fid, rid = wire.unpackb(done.content)["future_id"], old.replica_id
        old.stop()
        new = Replica(cluster["tmp"], "restarted-again", env, port=old.port)
        new.wait_ready()
        new_rid = new.replica_id
        assert new_rid != rid
        answers = {
            "result": httpx.get(f"{a.url}/v1/futures/{fid}/result", headers=AUTH, timeout=60),
            "delete": httpx.delete(f"{a.url}/v1/futures/{fid}", headers=AUTH, timeout=60),
            "call": _execute(a.url, pid, [{"future": fid, "output": 0}]),
        }
        for how, r in answers.items():
            assert r.status_code in (502, 503), (how, r.status_code, r.text)
            error = r.json()["error"]
            if r.status_code == 503:
                assert error["code"] == "unavailable", (how, error)
                assert rid in error["message"] and new_rid in error["message"], (how, error)
            else:
                assert error["code"] == "replica_lost" and rid in error["message"], (how, error)
        released = httpx.post(f"{a.url}/v1/futures/release", headers=AUTH, timeout=60,
                              json={"outputs": [{"future": fid, "output": 0}]})
        assert released.status_code in (200, 503), released.text
        if released.status_code == 200:
            assert released.json() == {"released": 0, "unknown": 1}, released.text
    finally:
        old.stop()
        if new is not None:
            new.stop()


def test_a_future_whose_metadata_redis_dropped_is_still_answered_for(
        cluster: dict[str, Any]) -> None:
    """Redis is a bounded cache that evicts (docs/redis.md: ``allkeys-lru``), and may
    restart empty: a future's metadata can go while its replica still holds the
    future. Another replica then asks that one instead of denying the future, and the
    holder writes the metadata again; another key still learns nothing of it."""
    a, b, _ = cluster["replicas"]
    pid = _upload(a.url, _export(lambda x: x * 3, jax.ShapeDtypeStruct((3,), np.float32)))
    done = _execute(a.url, pid, [np.ones(3, np.float32)], wait=30_000)
    assert done.status_code == 200, done.text
    fid = wire.unpackb(done.content)["future_id"]
    store = redis.Redis.from_url(cluster["redis"].url)
    try:
        (key,) = store.keys(f"*cluster:future:{fid}")
        assert store.delete(key) == 1  # as an eviction would
        for params in ({}, {"wait": 1000}):
            view = httpx.get(f"{b.url}/v1/futures/{fid}", params=params, headers=AUTH, timeout=30)
            assert view.status_code == 200, (params, view.text)
            assert view.json()["status"] == "done", view.text
        other = httpx.get(f"{b.url}/v1/futures/{fid}", timeout=30,
                          headers={"authorization": f"Bearer {KEYS[1]}"})
        assert other.status_code == 404, other.text
        for ghost in (f"{'0' * 10}.{'x' * 32}", f"{fid.split('.')[0]}.{'y' * 32}"):
            r = httpx.get(f"{b.url}/v1/futures/{ghost}", headers=AUTH, timeout=30)
            assert r.status_code == 404, (ghost, r.text)
        deadline = time.monotonic() + 30
        while not store.exists(key):  # written again by its replica
            assert time.monotonic() < deadline, "the holder did not write the metadata again"
            time.sleep(0.05)
    finally:
        store.close()
    got = httpx.get(f"{b.url}/v1/futures/{fid}/result", headers={"accept": wire.MSGPACK, **AUTH},
                    timeout=30)
    np.testing.assert_array_equal(wire.unpackb(got.content)["outputs"][0], np.full(3, 3.0))
    # Redis restarted, empty (no persistence, as recommended): the same, for every future.
    cluster["redis"].kill()
    cluster["redis"].start()
    deadline = time.monotonic() + 60
    while True:  # until b has seen Redis go and come back (503 unavailable meanwhile)
        view = httpx.get(f"{b.url}/v1/futures/{fid}", headers=AUTH, timeout=30)
        if view.status_code != 503:
            break
        assert time.monotonic() < deadline, view.text
        time.sleep(0.1)
    for params in ({}, {"wait": 1000}):
        view = httpx.get(f"{b.url}/v1/futures/{fid}", params=params, headers=AUTH, timeout=30)
        assert view.status_code == 200 and view.json()["status"] == "done", (params, view.text)


def test_a_future_whose_replica_died_before_writing_it_fails_replica_lost(
        cluster: dict[str, Any]) -> None:
    """A replica answers an execute without its metadata written when Redis is away
    (or slower than a second). If it dies before writing it, its future is in no
    Redis, yet it was accepted: the others answer ``replica_lost`` for it, never 404."""
    b = cluster["replicas"][1]
    doomed = Replica(cluster["tmp"], "unwritten", cluster["env"])
    try:
        doomed.wait_ready()
        program = _export(lambda x: x - 1, jax.ShapeDtypeStruct((3,), np.float32))
        pid = _upload(doomed.url, program)
        # b must have known the replica for its loss to be known there: Redis restarts
        # empty, and an id of a replica no one saw is an id of no replica (404). b learns
        # its peers at its heartbeats, or when it fetches from one, as here; the test
        # once killed Redis between two of b's heartbeats, before b had seen it.
        seen = _execute(doomed.url, pid, [np.ones(3, np.float32)], wait=30_000)
        assert seen.status_code == 200, seen.text
        fetched = httpx.get(f"{b.url}/v1/futures/{wire.unpackb(seen.content)['future_id']}/result",
                            headers=AUTH, timeout=60)
        assert fetched.status_code == 200, fetched.text
        cluster["redis"].kill()
        deadline = time.monotonic() + 30
        while httpx.get(f"{doomed.url}/readyz", timeout=10).json().get("cluster") != "degraded":
            assert time.monotonic() < deadline, "the replica did not notice Redis go"
            time.sleep(0.1)
        done = _execute(doomed.url, pid, [np.ones(3, np.float32)], wait=30_000)
        assert done.status_code == 200, done.text
        fid = wire.unpackb(done.content)["future_id"]
        doomed.stop()  # SIGKILL, before Redis is back: its future was never written
    finally:
        doomed.stop()
        cluster["redis"].start()
    deadline = time.monotonic() + 60
    while True:  # 503 unavailable until b has seen Redis come back
        view = httpx.get(f"{b.url}/v1/futures/{fid}", headers=AUTH, timeout=30)
        if view.status_code != 503:
            break
        assert time.monotonic() < deadline, view.text
        time.sleep(0.1)
    assert view.status_code == 502 and view.json()["error"]["code"] == "replica_lost", view.text
    assert _upload(b.url, program) == pid  # programs were in the Redis that restarted empty
    for how, r in (
            ("result", httpx.get(f"{b.url}/v1/futures/{fid}/result", headers=AUTH, timeout=30)),
            ("chained", _execute(b.url, pid, [{"future": fid, "output": 0}])),
            ("other key", httpx.get(f"{b.url}/v1/futures/{fid}", timeout=30,
                                    headers={"authorization": f"Bearer {KEYS[1]}"}))):
        assert r.status_code == 502, (how, r.text)
        assert r.json()["error"]["code"] == "replica_lost" and fid.split(".")[0] in \
            r.json()["error"]["message"], (how, r.text)


def test_sigterm_drains_then_its_results_stay_fetchable(cluster: dict[str, Any]) -> None:
    a = cluster["replicas"][0]
    extra = Replica(cluster["tmp"], "drained", {**cluster["env"], "JITSERVE_DRAIN_TIMEOUT_S": "60"})
    try:
        extra.wait_ready()
        slow = _export(lambda x: jax.lax.fori_loop(0, 400, lambda i, v: jnp.sin(v @ v.T) / 64, x),
                       jax.ShapeDtypeStruct((256, 256), np.float32))
        pid = _upload(extra.url, slow)
        x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
        fids = [_execute(extra.url, pid, [x]).json()["future_id"] for _ in range(3)]
        extra.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        ready = httpx.get(f"{extra.url}/readyz", timeout=10)
        assert ready.status_code == 503 and not ready.json()["error"]["checks"]["draining"]
        refused = _execute(extra.url, pid, [x])
        assert refused.status_code == 503 and "retry-after" in refused.headers, refused.text
        # In-flight executions finish; their results come through another replica.
        want = np.asarray(jax.jit(lambda x: jax.lax.fori_loop(
            0, 400, lambda i, v: jnp.sin(v @ v.T) / 64, x))(x))
        for fid in fids:
            got = httpx.get(f"{a.url}/v1/futures/{fid}/result", params={"wait": 60_000},
                            headers={"accept": wire.MSGPACK, **AUTH}, timeout=90)
            assert got.status_code == 200, got.text
            np.testing.assert_allclose(wire.unpackb(got.content)["outputs"][0], want,
                                       rtol=1e-5, atol=1e-6)
            deleted = httpx.request("DELETE", f"{a.url}/v1/futures/{fid}", timeout=30,
                                    headers=AUTH)
            assert deleted.status_code == 200, deleted.text
        # Everything fetched and deleted: it leaves well before its 60 s drain timeout.
        try:
            extra.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the drained replica did not leave:\n{extra.log.read_text()[-4000:]}")
    finally:
        extra.stop()


def test_a_killed_replica_fails_its_futures_with_replica_lost(cluster: dict[str, Any]) -> None:
    a, b, c = cluster["replicas"]
    pid = _upload(c.url, _export(lambda x: x + 1, jax.ShapeDtypeStruct((3,), np.float32)))
    done = _execute(c.url, pid, [np.zeros(3, np.float32)], wait=30_000)
    assert done.status_code == 200, done.text
    fid = wire.unpackb(done.content)["future_id"]
    other = _execute(a.url, pid, [np.ones(3, np.float32)], wait=30_000)
    other_fid = wire.unpackb(other.content)["future_id"]
    assert httpx.get(f"{b.url}/v1/futures/{fid}", timeout=30, headers=AUTH).json()["status"] == "done"
    # A long-poll on B is woken by the loss, not left to its timeout.
    with httpx.Client(timeout=60, headers=AUTH) as http:
        c.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        c.proc.wait(10)
        def status() -> dict[str, Any]:
            r = http.get(f"{b.url}/v1/futures/{fid}", params={"wait": 1})
            if r.status_code == 503:  # docs/deploy.md: until the loss is known
                assert r.json()["error"]["code"] == "unavailable", r.text
                return {"status": "unknown yet"}
            return dict(r.json())

        view = status()
        while view["status"] in ("done", "unknown yet") and time.monotonic() - killed_at < 30:
            view = status()
        lost_after = time.monotonic() - killed_at
    print(f"replica_lost reported {lost_after:.2f}s after SIGKILL (bound {LOST_WITHIN_S}s)")
    assert view["status"] == "failed" and view["error"]["code"] == "replica_lost", view
    assert lost_after <= LOST_WITHIN_S
    for replica in (a, b):
        v = httpx.get(f"{replica.url}/v1/futures/{fid}", timeout=30, headers=AUTH).json()
        assert v["error"]["code"] == "replica_lost"
        r = httpx.get(f"{replica.url}/v1/futures/{fid}/result", timeout=30, headers=AUTH)
        assert r.status_code == 502 and r.json()["error"]["code"] == "replica_lost", r.text
        chained = _execute(replica.url, pid, [{"future": fid, "output": 0}])
        assert chained.status_code == 502, chained.text
        assert chained.json()["error"]["code"] == "replica_lost"
    # Nobody else's future is touched, and new calls through the balancer succeed.
    assert httpx.get(f"{b.url}/v1/futures/{other_fid}", timeout=30, headers=AUTH).json()["status"] == "done"
    time.sleep(1.0)  # haproxy's health check takes the dead one out
    with Client(cluster["url"], api_key=KEYS[0], timeout=60, progress=False) as client:
        f = client.jit(lambda v: v * 3)
        for k in range(6):
            np.testing.assert_array_equal(np.asarray(f(np.full(3, float(k)))), np.full(3, 3.0 * k))


def test_without_redis_replicas_serve_their_own_futures(cluster: dict[str, Any]) -> None:
    a, b, _ = cluster["replicas"]
    pid = _upload(a.url, _export(lambda x: x * 2, jax.ShapeDtypeStruct((3,), np.float32)))
    theirs = wire.unpackb(_execute(b.url, pid, [np.ones(3, np.float32)], wait=30_000).content)
    cluster["redis"].stop()
    deadline = time.monotonic() + 15
    ready = httpx.get(f"{a.url}/readyz", timeout=10).json()
    while ready.get("cluster") != "degraded" and time.monotonic() < deadline:
        time.sleep(0.2)
        ready = httpx.get(f"{a.url}/readyz", timeout=10).json()
    assert ready["status"] == "ready" and ready["cluster"] == "degraded", ready
    mine = _execute(a.url, pid, [np.arange(3, dtype=np.float32)], wait=30_000)
    assert mine.status_code == 200, mine.text
    np.testing.assert_array_equal(wire.unpackb(mine.content)["outputs"][0],
                                  np.arange(3, dtype=np.float32) * 2)
    fid = wire.unpackb(mine.content)["future_id"]
    assert httpx.get(f"{a.url}/v1/futures/{fid}", timeout=10, headers=AUTH).json()["status"] == "done"
    other = httpx.get(f"{a.url}/v1/futures/{theirs['future_id']}", timeout=30, headers=AUTH)
    assert other.status_code == 503, other.text
    assert "Redis" in other.json()["error"]["message"]
