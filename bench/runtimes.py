"""Runtime benchmarks (issue 10): the process hop, and restarts.

Every figure is printed beside a baseline measured in the same run, and written to
bench/results/runtimes.json:

  hop      median round trip of an empty request from the event loop to a runtime
           process and back (``RuntimePool``, a pipe each way), vs the hop it
           replaced: the event loop to a worker thread and back
           (``loop.run_in_executor``), which is how executions ran before.
  restart  seconds from SIGKILL of a runtime to the first successful call after
           it (its executable reloaded from the disk tier), vs a cold server's
           start to its first successful call (which compiles).

Run: ``.venv/bin/python bench/runtimes.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file

from _servers import jitserve, write_results  # noqa: E402

from jitserve import wire  # noqa: E402
from jitserve.service.app import start_pool  # noqa: E402
from jitserve.service.settings import Settings  # noqa: E402


async def _median_us(call: Any, n: int) -> float:
    for _ in range(min(100, n)):
        await call()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


async def hop(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        pool = await start_pool(Settings(env="test", cache_dir=cache, runtimes=1))
        try:
            runtime = pool.runtimes[0]
            process_us = await _median_us(lambda: runtime.request("stats", {}), n)
        finally:
            pool.close()
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1) as threads:
        thread_us = await _median_us(lambda: loop.run_in_executor(threads, int), n)
    return {"process_hop_us": process_us, "thread_hop_us": thread_us,
            "extra_us": process_us - thread_us, "ratio": process_us / thread_us}


def _call(http: httpx.Client, pid: str) -> bool:
    try:
        r = http.post(f"/v1/programs/{pid}/execute", params={"wait": 30_000},
                      content=wire.packb({"args": [np.float32(2)]}),
                      headers={"content-type": wire.MSGPACK})
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and float(wire.unpackb(r.content)["outputs"][0]) == 4.0


def _until_ok(http: httpx.Client, pid: str, timeout_s: float = 120) -> float:
    start = time.monotonic()
    while not _call(http, pid):
        if time.monotonic() - start > timeout_s:
            raise RuntimeError("no successful call")
        time.sleep(0.01)
    return time.monotonic() - start


def restart(rounds: int) -> dict[str, float]:
    spec = jax.ShapeDtypeStruct((), np.float32)
    program = bytes(jax.export.export(jax.jit(lambda x: x * 2))(spec).serialize())
    started = time.monotonic()
    with jitserve(JITSERVE_RUNTIMES="1") as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        pid = http.post("/v1/programs", content=program,
                        headers={"content-type": wire.OCTET_STREAM}).json()["program_id"]
        _until_ok(http, pid)
        cold_s = time.monotonic() - started
        times = []
        for _ in range(rounds):
            (runtime,) = http.get("/readyz").json()["runtimes"]
            os.kill(runtime["pid"], signal.SIGKILL)
            t = time.monotonic()
            time.sleep(0.05)  # let the supervisor see the exit before we call
            _until_ok(http, pid)
            times.append(time.monotonic() - t)
    restart_s = statistics.median(times)
    return {"restart_s": restart_s, "cold_start_s": cold_s, "ratio": restart_s / cold_s,
            "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer hops and restarts")
    args = parser.parse_args()
    n, rounds = (500, 2) if args.quick else (5000, 5)
    results: dict[str, Any] = {"machine": {"cpus": len(os.sched_getaffinity(0))}}
    results["hop"] = asyncio.run(hop(n))
    print("hop", json.dumps(results["hop"], indent=1))
    results["restart"] = restart(rounds)
    print("restart", json.dumps(results["restart"], indent=1))
    write_results("runtimes", results)


if __name__ == "__main__":
    main()
