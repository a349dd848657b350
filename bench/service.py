"""Service benchmarks (issue 3): round trip, throughput, transfer, chaining.

Every figure is printed as a ratio against a baseline measured in the same run,
on the same function and machine, and written to bench/results/service.json:

  P1  median round trip of a cached call with ``wait`` vs a minimal hand-written
      FastAPI endpoint (bench/_baseline_app.py) and vs in-process ``jax.jit``; and
      vs the supervised baseline, the same endpoint with the work in a child
      process (the floor of running no program in the API process). Twice: the
      calls taking turns one by one (``P1_round_trip``), then 50 at a time
      (``P1_round_trip_in_stretches``), as a server with one client sees them.
      Both baselines also run as plain ASGI under uvicorn, without FastAPI
      (``asgi_*``): the plain supervised one is the floor of a server on
      uvicorn that runs no program in its API process, as jitserve is.
  P2  throughput with 64 calls in flight from the AsyncClient vs the same baselines.
  P4  upload / download GB/s at 1, 16 and 256 MiB through the SDK, and the peak RSS
      growth of the server and of the client during the round trip over the payload.
  P5  a 10-step chain on a 64 MiB array through futures vs shipping the data each step.

Run: ``.venv/bin/python bench/service.py [--quick] [--only P1 ...] [--runs N]
[--stretch N]`` (``--runs``: P1 that many times on fresh servers, with the spread
of its ratios; ``--stretch``: the calls in a row of P1's second pass, 0 for none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file

from _servers import baseline, cpu_seconds, jitserve, rss_bytes, write_results  # noqa: E402

from jitserve.client import AsyncClient, Client, Timeout  # noqa: E402
from jitserve.client._transport import async_transport  # noqa: E402

jax.config.update("jax_enable_x64", True)
MiB = 1 << 20


def f(x):  # noqa: ANN001, ANN201 - identical to the baseline app's function
    return jnp.sin(x) * 2.0 + 1.0


def export(fn: Any, x: np.ndarray) -> bytes:
    exp = jax.export.export(jax.jit(fn))(jax.ShapeDtypeStruct(x.shape, x.dtype))
    return bytes(exp.serialize())


def median_ms(fn: Any, n: int) -> float:
    return interleaved_ms({"": fn}, n)[""]


def interleaved_ms(calls: dict[str, Any], n: int, warmup: int = 10,
                   block: int = 1) -> dict[str, float]:
    """Median ms of each of ``calls``, each called ``n`` times (after ``warmup``
    rounds), in turn, ``block`` calls at a time, so that the machine's drift during
    the run hits them all alike. Every other round goes in the other order: a call
    runs faster right after one of the same server (the CPU's caches hold its
    code), so a fixed order favours some. With ``block`` 1, every call follows
    another server's, whose code has taken the caches; with a bigger ``block``,
    most calls follow one of their own, as they do for a server that serves one
    client."""
    for _ in range(min(warmup, n)):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    for i in range(-(-n // block)):
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            seen = times[name]
            for _ in range(min(block, n - len(seen))):
                t = time.perf_counter()
                fn()
                seen.append(time.perf_counter() - t)
    return {name: statistics.median(seen) * 1e3 for name, seen in times.items()}


def baseline_body(x: np.ndarray) -> bytes:
    return msgpack.packb({"args": [{"dtype": x.dtype.name, "shape": list(x.shape),
                                    "data": x.tobytes()}]})


def p1(url: str, base: str, asgi: str, n: int, block: int = 1) -> dict[str, float]:
    """A small cached call, three ways: the SDK (``Client.execute`` with a wait, and
    ``np.asarray(client.jit(f)(x))`` with its default hold and without one, running
    ahead as by default and with ``run_ahead=0``), and raw
    REST with a msgpack body (as is, and with ``keep=false``, which keeps nothing, as
    the baseline) and a JSON body; each against the baseline endpoint in the same encoding, in
    process (``/run``) and in a child process (``/run_child``, the supervised
    baseline: the floor of a server that runs no program in its API process);
    and both baseline endpoints in msgpack as plain ASGI (``asgi``, without FastAPI).
    All are called in turn, ``block`` calls each per round (``interleaved_ms``)."""
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    jitted = jax.jit(f)
    local_ms = median_ms(lambda: np.asarray(jitted(x)), n)
    packed = baseline_body(x)
    as_json = json.dumps({"args": [{"dtype": x.dtype.name, "shape": list(x.shape),
                                    "data": x.tolist()}]}).encode()
    msgpack_headers = {"content-type": "application/msgpack"}
    json_headers = {"content-type": "application/json"}
    with Client(url) as c, Client(url, timeout=Timeout(hold=0)) as unheld, \
            Client(url, run_ahead=0) as waits, httpx.Client() as h:
        pid = c.upload(export(f, x)).program_id
        execute = f"{url}/v1/programs/{pid}/execute?wait=10000"
        jf, jf_unheld, jf_waits = c.jit(f), unheld.jit(f), waits.jit(f)

        def raw(target: str, body: bytes, headers: dict[str, str]) -> Any:
            def call() -> None:
                r = h.post(target, content=body, headers=headers)
                assert r.status_code == 200, r.text
            return call

        ms = interleaved_ms({
            "sdk": lambda: c.execute(pid, [x], wait=10)[0].result(),
            "sdk_jit": lambda: np.asarray(jf(x)),
            "sdk_jit_unheld": lambda: np.asarray(jf_unheld(x)),
            "sdk_jit_waits": lambda: np.asarray(jf_waits(x)),
            "rest": raw(execute, packed, msgpack_headers),
            "rest_drop": raw(execute + "&keep=false", packed, msgpack_headers),
            "rest_json": raw(execute, as_json, json_headers),
            "base": raw(f"{base}/run", packed, msgpack_headers),
            "base_json": raw(f"{base}/run", as_json, json_headers),
            "child": raw(f"{base}/run_child", packed, msgpack_headers),
            "child_json": raw(f"{base}/run_child", as_json, json_headers),
            "asgi": raw(f"{asgi}/run", packed, msgpack_headers),
            "asgi_child": raw(f"{asgi}/run_child", packed, msgpack_headers)}, n, block=block)
    return {"jitserve_sdk_ms": ms["sdk"], "jitserve_sdk_jit_ms": ms["sdk_jit"],
            "jitserve_sdk_jit_unheld_ms": ms["sdk_jit_unheld"],
            "jitserve_sdk_jit_run_ahead_0_ms": ms["sdk_jit_waits"],
            "ratio_sdk_jit_vs_run_ahead_0": ms["sdk_jit"] / ms["sdk_jit_waits"],
            "jitserve_rest_msgpack_ms": ms["rest"],
            "jitserve_rest_json_ms": ms["rest_json"],
            "jitserve_rest_msgpack_keep_false_ms": ms["rest_drop"],
            "baseline_fastapi_ms": ms["base"],
            "baseline_fastapi_json_ms": ms["base_json"],
            "supervised_baseline_ms": ms["child"],
            "supervised_baseline_json_ms": ms["child_json"], "local_jit_ms": local_ms,
            "asgi_baseline_ms": ms["asgi"], "asgi_supervised_baseline_ms": ms["asgi_child"],
            "ratio_vs_baseline": ms["sdk"] / ms["base"],
            "ratio_sdk_jit_vs_baseline": ms["sdk_jit"] / ms["base"],
            "ratio_sdk_jit_unheld_vs_baseline": ms["sdk_jit_unheld"] / ms["base"],
            "ratio_rest_msgpack_vs_baseline": ms["rest"] / ms["base"],
            "ratio_rest_msgpack_keep_false_vs_baseline": ms["rest_drop"] / ms["base"],
            "ratio_rest_json_vs_baseline_json": ms["rest_json"] / ms["base_json"],
            "ratio_rest_msgpack_vs_supervised_baseline": ms["rest"] / ms["child"],
            "ratio_rest_json_vs_supervised_baseline_json": ms["rest_json"] / ms["child_json"],
            "ratio_supervised_baseline_vs_baseline": ms["child"] / ms["base"],
            "ratio_asgi_baseline_vs_baseline": ms["asgi"] / ms["base"],
            "ratio_asgi_supervised_baseline_vs_baseline": ms["asgi_child"] / ms["base"],
            "ratio_rest_msgpack_vs_asgi_supervised_baseline": ms["rest"] / ms["asgi_child"],
            "ratio_vs_local_jit": ms["sdk"] / local_ms}


AsyncCall = Callable[[], Awaitable[None]]
MSGPACK = {"content-type": "application/msgpack"}


async def throughput(call: AsyncCall, total: int, in_flight: int) -> float:
    """Calls per second of ``total`` calls, ``in_flight`` at a time, after as many
    untimed as are in flight (the connections open, the code warm). One round of
    P2: ``bench/trees.py`` takes turns between servers with it."""
    sem = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with sem:
            await call()

    await asyncio.gather(*(one() for _ in range(in_flight)))  # warm-up
    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    return total / (time.perf_counter() - t)


def sdk_execute(ac: AsyncClient, program: str, x: np.ndarray) -> AsyncCall:
    """P2's call through the SDK: ``execute`` with a wait, then its output read."""
    async def call() -> None:
        outs = await ac.execute(program, [x], wait=30)
        await outs[0].result()
    return call


def httpx_post(h: httpx.AsyncClient, target: str, body: bytes) -> AsyncCall:
    """A msgpack POST of ``body`` through httpx, as a caller would drive the baseline."""
    async def call() -> None:
        await h.post(target, content=body, headers=MSGPACK)
    return call


def aiohttp_post(session: Any, target: str, body: bytes) -> AsyncCall:
    """A msgpack POST through aiohttp (an ``aiohttp.ClientSession``): a client fast
    enough that the server, not the client, bounds the rate."""
    async def call() -> None:
        async with session.post(target, data=body, headers=MSGPACK) as r:
            await r.read()
            assert r.status == 200, r.status
    return call


def execute_url(url: str, program: str) -> str:
    """The REST route of one call that waits for its answer (P2's aiohttp call)."""
    return f"{url}/v1/programs/{program}/execute?wait=30000"


async def p2(url: str, base: str, total: int, pid: int) -> dict[str, float]:
    """64 calls in flight: the SDK's AsyncClient against the baseline driven by httpx,
    as a caller would drive it, and by httpx with the SDK's own connection pool
    (client/_transport.py: httpx's slows down past 16 connections); and both
    servers driven by aiohttp, a faster client that leaves the servers, not the
    client, as the bound. bench/results/service.json has all three."""
    import aiohttp

    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    body = baseline_body(x)
    async with AsyncClient(url) as ac, httpx.AsyncClient(limits=limits) as h, \
            httpx.AsyncClient(transport=async_transport()) as h_pool, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        program = (await ac.upload(export(f, x))).program_id
        remote_cps = await throughput(sdk_execute(ac, program, x), total, 64)
        base_cps = await throughput(httpx_post(h, f"{base}/run", body), total, 64)
        base_pool_cps = await throughput(httpx_post(h_pool, f"{base}/run", body), total, 64)
        api0, runtimes0 = cpu_seconds(pid)
        rest_cps = await throughput(aiohttp_post(session, execute_url(url, program), body),
                                    total, 64)
        api1, runtimes1 = cpu_seconds(pid)
        base_fast_cps = await throughput(aiohttp_post(session, f"{base}/run", body), total, 64)
        child_fast_cps = await throughput(aiohttp_post(session, f"{base}/run_child", body),
                                          total, 64)
    return {"jitserve_sdk_calls_per_s": remote_cps, "baseline_httpx_calls_per_s": base_cps,
            "ratio_vs_baseline": remote_cps / base_cps,
            "baseline_httpx_sdk_pool_calls_per_s": base_pool_cps,
            "ratio_vs_baseline_sdk_pool": remote_cps / base_pool_cps,
            "jitserve_rest_aiohttp_calls_per_s": rest_cps,
            "baseline_aiohttp_calls_per_s": base_fast_cps,
            "ratio_rest_vs_baseline_aiohttp": rest_cps / base_fast_cps,
            "supervised_baseline_aiohttp_calls_per_s": child_fast_cps,
            "ratio_rest_vs_supervised_baseline_aiohttp": rest_cps / child_fast_cps,
            # CPU per call of the aiohttp phase (warm-up included: 64 more calls)
            "api_process_cpu_ms_per_call": (api1 - api0) / (total + 64) * 1e3,
            "runtimes_cpu_ms_per_call": (runtimes1 - runtimes0) / (total + 64) * 1e3}


class PeakRss:
    """Samples a process's RSS in a thread; ``peak - start`` is the growth."""

    def __init__(self, pid: int) -> None:
        self.pid, self.start, self.peak = pid, rss_bytes(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.002)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def transfer_program(c: Client, x: np.ndarray) -> str:
    """P4's program for arrays like ``x`` (``v + 1``), uploaded and compiled by a
    first call, so that no round trip pays for the compile."""
    program = c.upload(export(lambda v: v + 1.0, x)).program_id
    c.execute(program, [x], wait=60)[0].result()
    return program


def round_trip(c: Client, program: str, x: np.ndarray, pid_server: int) -> dict[str, float]:
    """One of P4's round trips of ``x``: upload (execute's POST, until its 202) and
    download (``result``) GB/s, and the peak RSS growth during it, over the payload,
    of the server's API process and of this one. ``bench/trees.py`` takes turns
    between servers with it."""
    with PeakRss(pid_server) as rss, PeakRss(os.getpid()) as mine:
        t0 = time.perf_counter()
        fut = c.execute(program, [x])[0]
        t1 = time.perf_counter()
        c.wait(fut.future_id)
        t2 = time.perf_counter()
        out = c.result(fut.future_id)[0]
        t3 = time.perf_counter()
    assert out.shape == x.shape and out[0] == 2.0
    c.delete(fut.future_id)
    return {"upload_gb_s": x.nbytes / (t1 - t0) / 1e9,
            "download_gb_s": x.nbytes / (t3 - t2) / 1e9,
            "server_rss_growth_x_payload": (rss.peak - rss.start) / x.nbytes,
            "client_rss_growth_x_payload": (mine.peak - mine.start) / x.nbytes}


def transfer_row(mib: int, first: dict[str, float], timed: list[dict[str, float]]) -> dict[str, float]:
    """P4's figures for one size: median rates and highest memory growth of the
    ``timed`` round trips, and the memory growth of the untimed ``first``."""
    return {"mib": mib,
            "upload_gb_s": statistics.median(t["upload_gb_s"] for t in timed),
            "download_gb_s": statistics.median(t["download_gb_s"] for t in timed),
            "server_rss_growth_x_payload": max(t["server_rss_growth_x_payload"] for t in timed),
            "client_rss_growth_x_payload": max(t["client_rss_growth_x_payload"] for t in timed),
            "server_rss_growth_first_x_payload": first["server_rss_growth_x_payload"],
            "client_rss_growth_first_x_payload": first["client_rss_growth_x_payload"]}


def p4(url: str, pid_server: int, sizes_mib: list[int], reps: int = 5) -> list[dict[str, float]]:
    """Upload (execute's POST, until its 202) and download (``result``) of one float32 array.

    Rates are medians of ``reps`` round trips (each size makes one untimed first,
    as a caller that moves such arrays would have). Memory is the highest peak RSS
    growth of each side during a timed round trip, over the payload: the client's
    (this process; its input array exists before) and the server's (the API
    process; shared-memory pages it maps count); ``*_first_*`` is the untimed
    first one's, which allocates what the later ones reuse.
    """
    rows = []
    with Client(url, timeout=600) as c:
        for mib in sizes_mib:
            x = np.ones(mib * MiB // 4, np.float32)
            program = transfer_program(c, x)
            first = round_trip(c, program, x, pid_server)
            timed = [round_trip(c, program, x, pid_server) for _ in range(reps)]
            rows.append(transfer_row(mib, first, timed))
    return rows


def p5(url: str, steps: int = 10, mib: int = 64) -> dict[str, float]:
    x = np.ones(mib * MiB // 4, np.float32)

    def step(v):  # noqa: ANN001, ANN202
        return v * 1.0001

    with Client(url, timeout=600) as c:
        remote = c.jit(step)
        np.asarray(remote(x))  # compile
        pid = c.upload(export(step, x)).program_id
        t = time.perf_counter()
        y = remote(x)
        for _ in range(steps - 1):
            y = remote(y)
        chained = np.asarray(y)
        chain_s = time.perf_counter() - t
        t = time.perf_counter()
        v = x
        for _ in range(steps):
            v = c.execute(pid, [v], wait=60)[0].result()
        ship_s = time.perf_counter() - t
    np.testing.assert_allclose(chained, v, rtol=1e-6)
    return {"chain_s": chain_s, "ship_each_step_s": ship_s, "speedup": ship_s / chain_s}


def p1_runs(n: int, runs: int, block: int = 1) -> dict[str, Any]:
    """P1 ``runs`` times, each on servers of its own: one run's ratio moves by a
    tenth or more on this machine, so a verdict needs the spread of several."""
    each = []
    for i in range(runs):
        with jitserve() as (url, _), baseline() as base, baseline("asgi_app") as asgi:
            each.append({**p1(url, base, asgi, n, block), "block": block})
        if runs > 1:
            print(f"P1 run {i + 1}/{runs}, {block} at a time: REST msgpack "
                  f"{each[-1]['ratio_rest_msgpack_vs_baseline']:.3f}x (plain ASGI floor "
                  f"{each[-1]['ratio_asgi_supervised_baseline_vs_baseline']:.3f}x), JSON "
                  f"{each[-1]['ratio_rest_json_vs_baseline_json']:.3f}x, SDK "
                  f"{each[-1]['ratio_vs_baseline']:.3f}x, client.jit "
                  f"{each[-1]['ratio_sdk_jit_vs_baseline']:.3f}x", flush=True)
    if runs == 1:
        return each[0]
    ratios = [k for k in each[0] if k.startswith("ratio")]
    return {**{k: statistics.median(r[k] for r in each) for k in each[0]},
            "runs": runs,
            "spread": {k: {"min": min(r[k] for r in each), "max": max(r[k] for r in each)}
                       for k in ratios},
            "each_run": each}


PARTS = ("P1", "P2", "P4", "P5")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer calls, no 256 MiB")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS),
                        help="run these parts only")
    parser.add_argument("--runs", type=int, default=1,
                        help="P1 this many times, each on fresh servers: its medians "
                             "over the runs, and each ratio's min and max")
    parser.add_argument("--stretch", type=int, default=50,
                        help="P1 again with this many calls in a row to each server "
                             "(at most a sixth of its calls; 0: not)")
    args = parser.parse_args()
    n, total = (50, 256) if args.quick else (300, 2048)
    sizes = [1, 16] if args.quick else [1, 16, 256]
    results: dict[str, Any] = {"machine": {"cpus": len(os.sched_getaffinity(0))}}
    if "P1" in args.only:
        # Calls taking turns one by one, each after another server's; then in
        # stretches, as a server serving one client sees them (docs/performance.md).
        p1s = {"P1_round_trip": 1,
               "P1_round_trip_in_stretches": min(args.stretch, max(n // 6, 1))}
        for key, block in p1s.items():
            if block > 0:
                results[key] = p1_runs(n, max(args.runs, 1), block)
                print(key, json.dumps({k: v for k, v in results[key].items()
                                       if k != "each_run"}, indent=1))
    rest = [part for part in args.only if part != "P1"]
    if rest:
        with jitserve() as (url, proc), baseline() as base:
            if "P2" in rest:
                results["P2_throughput_64_in_flight"] = asyncio.run(p2(url, base, total,
                                                                             proc.pid))
                print("P2", json.dumps(results["P2_throughput_64_in_flight"], indent=1))
            if "P4" in rest:
                results["P4_transfer"] = p4(url, proc.pid, sizes)
                print("P4", json.dumps(results["P4_transfer"], indent=1))
            if "P5" in rest:
                results["P5_chain_64MiB"] = p5(url)
                print("P5", json.dumps(results["P5_chain_64MiB"], indent=1))
    write_results("service", results)


if __name__ == "__main__":
    main()
