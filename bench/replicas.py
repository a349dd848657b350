"""Many replicas behind a load balancer (docs/deploy.md, "Many replicas").

    python bench/replicas.py [--quick]

Starts a private redis-server, three ``jitserve serve`` replicas sharing it, and
haproxy (Debian's package) balancing each request round robin, then measures,
in one run:

  P2     calls per second with 64 calls in flight through ``AsyncClient``, through
         haproxy over 1, 2 and 3 replicas, and straight to one replica (no balancer).
  chain  a chained call (its input a future on replica A) sent to A, against the
         same call sent to B, which forwards it to A: the extra cost of landing on
         the wrong replica (median of many; target <= 1 ms). Baseline: the same call
         through a bare relay in front of A (bench/_bare_relay.py: uvicorn and the
         replicas' peer client, nothing else), the floor of a relay of these parts.
  routed a chained call through haproxy over 3 replicas, round robin (two in three
         land on the wrong replica) against haproxy routing by ``X-Jitserve-Replica``
         (docs/deploy.md, "Balancing"), which sends each to the holder.
  lost   seconds from SIGKILL of a replica to its future reading ``replica_lost``
         on another (heartbeat 0.5 s: key expiry after 1.5 s, noticed at the next
         heartbeat).

Writes bench/results/replicas.json. On 2 cores the replicas share the machine,
so more replicas cannot scale linearly; the figures say what the extra hops cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
from _servers import free_port, process, write_results

from jitserve import wire
from jitserve.client import AsyncClient

HEARTBEAT_S = 0.5
SECRET = "bench-replicas-cache-secret-" + "5e2a" * 8
MP = {"content-type": wire.MSGPACK, "accept": wire.MSGPACK}


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        import redis

        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if redis.Redis.from_url(url).ping():
                    break
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def replica(redis_url: str, tmp: Path, name: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"REDIS_URL": redis_url, "JITSERVE_REDIS_PREFIX": "bench",
           "JITSERVE_CACHE_SECRET": SECRET, "JITSERVE_HEARTBEAT_S": str(HEARTBEAT_S),
           "JITSERVE_RUNTIMES": "1", "JITSERVE_DRAIN_TIMEOUT_S": "0"}
    argv = [sys.executable, "-m", "jitserve.service", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--cache-dir", str(tmp / name), "--log-level", "warning"]
    with process(argv, url, env) as proc:
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/readyz", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {name} not ready")
            time.sleep(0.1)
        yield url, proc


@contextlib.contextmanager
def haproxy(tmp: Path, urls: list[str], routing: bool = False) -> Iterator[str]:
    port = free_port()
    servers = "\n".join(f"    server r{i} {u.removeprefix('http://')} check"
                        for i, u in enumerate(urls))
    if routing:  # docs/deploy.md, "Balancing"
        servers = ("    stick-table type string len 32 size 10k expire 1h\n"
                   "    stick match req.hdr(x-jitserve-replica)\n"
                   "    stick store-response res.hdr(x-jitserve-replica)\n" + servers)
    cfg = tmp / f"haproxy-{len(urls)}{'-routing' if routing else ''}.cfg"
    cfg.write_text(f"""\
global
    maxconn 1024
defaults
    mode http
    timeout connect 2s
    timeout client 120s
    timeout server 120s
frontend jitserve
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /readyz
{servers}
""")
    url = f"http://127.0.0.1:{port}"
    with process(["haproxy", "-f", str(cfg), "-db"], url):
        yield url


def export(fn: Any, *specs: Any) -> bytes:
    return bytes(jax.export.export(jax.jit(fn))(*specs).serialize())


async def p2(url: str, pid: str, total: int, in_flight: int = 64) -> float:
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    async with AsyncClient(url, timeout=120) as ac:
        sem = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with sem:
                outs = await ac.execute(pid, [x], wait=30)
                await outs[0].result()

        await asyncio.gather(*(one() for _ in range(in_flight)))  # warm-up
        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(total)))
        return total / (time.perf_counter() - t)


def chained(h: httpx.Client, url: str) -> tuple[str, str, bytes]:
    """A program, an array put through ``url``, and the body of a call on that array:
    ``(program id, the array's future id, body)``."""
    spec = jax.ShapeDtypeStruct((1024,), np.float32)
    pid = h.post(f"{url}/v1/programs", content=export(lambda v: v * 2.0 + 1.0, spec),
                 headers={"content-type": wire.OCTET_STREAM}).json()["program_id"]
    put = h.post(f"{url}/v1/arrays", headers=MP, content=wire.packb(
        {"arrays": [np.ones(1024, np.float32)]})).json()["future_id"]
    return pid, put, wire.packb({"args": [{"future": put, "output": 0}]})


def chain_cost(a: str, b: str, bare: str, n: int) -> dict[str, float]:
    """Median ms of a chained execute (?wait) on the data's replica ``a``, on another
    replica ``b`` (which forwards it to ``a``), and through ``bare``, a bare relay in
    front of ``a`` (bench/_bare_relay.py: the floor of any relay built from these parts)."""
    with httpx.Client(timeout=60) as h:
        pid, _, body = chained(h, a)

        def call(url: str) -> float:
            t = time.perf_counter()
            r = h.post(f"{url}/v1/programs/{pid}/execute", params={"wait": 10_000},
                       content=body, headers=MP)
            elapsed = time.perf_counter() - t
            assert r.status_code == 200, r.text
            fid = wire.unpackb(r.content)["future_id"]
            h.delete(f"{url}/v1/futures/{fid}")
            return elapsed

        times: dict[str, list[float]] = {a: [], b: [], bare: []}
        for k in range(n + 20):  # interleaved, so drift hits all alike
            for url, seen in times.items():
                elapsed = call(url)
                if k >= 20:
                    seen.append(elapsed)
    d, w, r = (statistics.median(times[u]) * 1e3 for u in (a, b, bare))
    return {"direct_ms": d, "wrong_replica_ms": w, "extra_ms": w - d,
            "bare_relay_ms": r, "bare_relay_extra_ms": r - d, "extra_over_bare_relay_ms": w - r}


def routed_chain(lb: str, n: int) -> float:
    """Median ms of a chained execute (?wait) through balancer ``lb``, naming the
    holder of its input in ``X-Jitserve-Replica`` as the SDK does."""
    with httpx.Client(timeout=60) as h:
        pid, put, body = chained(h, lb)
        named = {**MP, wire.REPLICA_HEADER: wire.replica_of(put) or ""}
        for _ in range(6):  # a balancer that learns sees each replica's answers
            h.get(f"{lb}/readyz")
        times = []
        for k in range(n + 20):
            t = time.perf_counter()
            r = h.post(f"{lb}/v1/programs/{pid}/execute", params={"wait": 10_000, "keep": "false"},
                       content=body, headers=named)
            if k >= 20:
                times.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
    return statistics.median(times) * 1e3


def time_to_lost(redis_url: str, tmp: Path, watcher: str, runs: int) -> list[float]:
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    out = []
    for k in range(runs):
        with replica(redis_url, tmp, f"victim{k}") as (url, proc):
            with httpx.Client(timeout=60) as h:
                pid = h.post(f"{url}/v1/programs", content=export(lambda v: v + 1, spec),
                             headers={"content-type": wire.OCTET_STREAM}).json()["program_id"]
                r = h.post(f"{url}/v1/programs/{pid}/execute", params={"wait": 10_000},
                           headers=MP, content=wire.packb({"args": [np.zeros(4, np.float32)]}))
                fid = wire.unpackb(r.content)["future_id"]
                proc.send_signal(signal.SIGKILL)
                t = time.monotonic()
                proc.wait(10)
                while h.get(f"{watcher}/v1/futures/{fid}").json()["status"] != "failed":
                    time.sleep(0.01)
                out.append(time.monotonic() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer calls")
    args = parser.parse_args()
    if shutil.which("haproxy") is None:
        sys.exit("needs haproxy (apt-get install haproxy)")
    total, n, runs = (256, 100, 1) if args.quick else (2048, 500, 3)
    results: dict[str, Any] = {"machine": {"cpus": len(os.sched_getaffinity(0))},
                               "heartbeat_s": HEARTBEAT_S}
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as stack:
        tmp = Path(d)
        redis_url = stack.enter_context(redis_server(tmp))
        urls = [stack.enter_context(replica(redis_url, tmp, f"r{i}"))[0] for i in range(3)]
        x = np.zeros(1024, np.float32)
        spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
        program = export(lambda v: jnp.sin(v) * 2.0 + 1.0, spec)
        pid = httpx.post(f"{urls[0]}/v1/programs", content=program, timeout=60,
                         headers={"content-type": wire.OCTET_STREAM}).json()["program_id"]
        p2s = {"direct_1_replica": asyncio.run(p2(urls[0], pid, total))}
        for k in (1, 2, 3):
            with haproxy(tmp, urls[:k]) as lb:
                p2s[f"haproxy_{k}_replicas"] = asyncio.run(p2(lb, pid, total))
        base = p2s["haproxy_1_replicas"]
        results["P2_calls_per_s_64_in_flight"] = {
            **p2s, **{f"ratio_{k}_vs_1": p2s[f"haproxy_{k}_replicas"] / base for k in (2, 3)}}
        print("P2", json.dumps(results["P2_calls_per_s_64_in_flight"], indent=1))
        bare = f"http://127.0.0.1:{free_port()}"
        relay = [sys.executable, str(Path(__file__).with_name("_bare_relay.py")),
                 bare.rsplit(":", 1)[1], urls[0]]
        with process(relay, bare):
            results["chained_call_wrong_replica"] = chain_cost(urls[0], urls[1], bare, n)
        print("chain", json.dumps(results["chained_call_wrong_replica"], indent=1))
        routed = {}
        for routing in (False, True, False, True):  # alternating: drift hits both alike
            with haproxy(tmp, urls, routing=routing) as lb:
                key = "routed_ms" if routing else "round_robin_ms"
                routed.setdefault(key, []).append(routed_chain(lb, n))
        results["chained_call_through_haproxy"] = {
            **{k: statistics.median(v) for k, v in routed.items()},
            "saved_ms": statistics.median(routed["round_robin_ms"])
            - statistics.median(routed["routed_ms"])}
        print("routed", json.dumps(results["chained_call_through_haproxy"], indent=1))
        lost = time_to_lost(redis_url, tmp, urls[1], runs)
        results["replica_lost_detect_s"] = {"runs": lost, "max": max(lost),
                                            "bound_s": 4 * HEARTBEAT_S}
        print("lost", json.dumps(results["replica_lost_detect_s"], indent=1))
    write_results("replicas", results)


if __name__ == "__main__":
    main()
