"""Dynamic batching (issue 14): throughput at 64 calls in flight, batching on vs off.

One server, one shape-polymorphic MLP (``jax.export`` with a symbolic batch
dimension), one row per call, 64 calls in flight from the ``AsyncClient`` (and
from aiohttp over raw REST, a client that is not itself the bound). The same
program is measured with batching off and on (``set_batching``) at a few
``max_delay_ms``, in rounds that take turns (medians over 3 rounds), in the same
run; the ratios are on vs off, and against the baseline: the minimal FastAPI
endpoint of bench/service.py running the same MLP with ``jax.jit`` in its own
process, one call at a time (bench/_baseline_app.py), driven by the same aiohttp
client. Results of batched calls are checked against local ``jax.jit`` first.
Writes bench/results/batching.json.

Run: ``.venv/bin/python bench/batching.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file

from _models import SIZES, make_mlp  # noqa: E402
from _servers import baseline, jitserve, write_results  # noqa: E402

from jitserve.client import AsyncClient  # noqa: E402


def export_poly(mlp: Any, n_in: int) -> bytes:
    (b,) = jax.export.symbolic_shape("b")
    exp = jax.export.export(jax.jit(mlp), platforms=["cpu"])(
        jax.ShapeDtypeStruct((b, n_in), jnp.float32))
    return bytes(exp.serialize())


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    return 0.0


async def _throughput(call: Any, total: int, in_flight: int) -> float:
    sem = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with sem:
            await call(i)

    await asyncio.gather(*(one(i) for i in range(2 * in_flight)))  # warm-up (buckets compile)
    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(total)))
    return total / (time.perf_counter() - t)


async def check_equal(ac: AsyncClient, pid: str, mlp: Any, xs: list[np.ndarray]) -> float:
    """The largest relative difference of 64 concurrent batched calls from local jax.jit."""
    outs = await asyncio.gather(*(ac.execute(pid, [x]) for x in xs))
    got = await asyncio.gather(*(o[0].result() for o in outs))
    local = jax.jit(mlp)
    worst = 0.0
    for x, g in zip(xs, got):
        want = np.asarray(local(x))
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)
        worst = max(worst, float(np.max(np.abs(np.asarray(g) - want) / (np.abs(want) + 1e-12))))
    return worst


async def run(url: str, base: str, size: str, total: int, delays: list[float],
              rounds: int) -> dict[str, Any]:
    import aiohttp

    n_in, hidden, n_out = SIZES[size]
    mlp = make_mlp(size)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1, n_in)).astype(np.float32) for _ in range(256)]
    bodies = [msgpack.packb({"args": [{"dtype": "float32", "shape": [1, n_in],
                                       "data": x.tobytes()}]}) for x in xs]
    headers = {"content-type": "application/msgpack"}
    out: dict[str, Any] = {"calls": total, "in_flight": 64, "rows_per_call": 1,
                           "mlp": [n_in, hidden, hidden, n_out], "dtype": "float32"}
    async with AsyncClient(url) as ac:
        pid = (await ac.upload(export_poly(mlp, n_in))).program_id

        # Fresh connections for each phase: a pool left idle during the other phase may
        # hold connections the server has closed meanwhile (keep-alive timeout).
        async def sdk_phase() -> float:
            async with AsyncClient(url) as c:
                async def sdk(i: int) -> None:
                    outs = await c.execute(pid, [xs[i % len(xs)]], wait=30)
                    await outs[0].result()

                return await _throughput(sdk, total, 64)

        async def rest_phase(target: str) -> float:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
                async def rest(i: int) -> None:
                    async with session.post(target, data=bodies[i % len(bodies)],
                                            headers=headers) as r:
                        await r.read()
                        assert r.status == 200, r.status

                return await _throughput(rest, total, 64)

        # Rounds of [off, on at each delay], medians over the rounds: the machine's
        # drift (other load) hits every configuration alike.
        configs: list[float | None] = [None, *delays]
        seen: dict[float | None, dict[str, list[float]]] = {
            c: {"sdk": [], "rest": [], "calls_per_run": []} for c in configs}
        execute = f"{url}/v1/programs/{pid}/execute?wait=30000&keep=false"
        baseline_rest: list[float] = []
        for _ in range(rounds):
            baseline_rest.append(await rest_phase(f"{base}/run"))
            for delay in configs:
                if delay is None:
                    await ac.clear_batching(pid)
                else:
                    await ac.set_batching(pid, max_batch_size=64, max_delay_ms=delay)
                if delay == delays[0] and "max_rel_diff_vs_local_jit" not in out:
                    out["max_rel_diff_vs_local_jit"] = await check_equal(ac, pid, mlp, xs[:64])
                runs0 = metric(url, "jitserve_batch_calls_count")
                calls0 = metric(url, "jitserve_batch_calls_sum")
                seen[delay]["sdk"].append(await sdk_phase())
                seen[delay]["rest"].append(await rest_phase(execute))
                runs = metric(url, "jitserve_batch_calls_count") - runs0
                if runs:
                    calls = metric(url, "jitserve_batch_calls_sum") - calls0
                    seen[delay]["calls_per_run"].append(calls / runs)
        off_sdk, off_rest = (statistics.median(seen[None][k]) for k in ("sdk", "rest"))
        base_rest = statistics.median(baseline_rest)
        out["baseline"] = {"rest_aiohttp_calls_per_s": base_rest, "rounds": baseline_rest}
        print(size, "baseline", json.dumps({"rest_aiohttp_calls_per_s": base_rest}))
        out["off"] = {"sdk_calls_per_s": off_sdk, "rest_aiohttp_calls_per_s": off_rest,
                      "rest_ratio_vs_baseline": off_rest / base_rest, "rounds": seen[None]}
        print(size, "off", json.dumps({k: v for k, v in out["off"].items() if k != "rounds"}))
        for delay in delays:
            sdk_cps, rest_cps = (statistics.median(seen[delay][k]) for k in ("sdk", "rest"))
            out[f"on_delay_{delay:g}ms"] = doc = {
                "sdk_calls_per_s": sdk_cps, "rest_aiohttp_calls_per_s": rest_cps,
                "sdk_ratio_vs_off": sdk_cps / off_sdk, "rest_ratio_vs_off": rest_cps / off_rest,
                "rest_ratio_vs_baseline": rest_cps / base_rest,
                "mean_calls_per_run": statistics.mean(seen[delay]["calls_per_run"]),
                "rounds": seen[delay]}
            print(size, f"on {delay:g} ms", json.dumps({k: v for k, v in doc.items()
                                                       if k != "rounds"}))
        await ac.clear_batching(pid)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer calls")
    args = parser.parse_args()
    total, rounds = (512, 1) if args.quick else (1024, 3)
    results: dict[str, Any] = {"machine": {"cpus": len(os.sched_getaffinity(0))}}
    # Raw REST calls leave their futures to the TTL: room for all of them.
    with jitserve(JITSERVE_MAX_LIVE_FUTURES="1000000") as (url, _):
        for size in SIZES:
            with baseline(BASELINE_MLP=size) as base:
                results[f"{size}_mlp_64_in_flight"] = asyncio.run(
                    run(url, base, size, total, [1.0, 2.0, 5.0], rounds))
    write_results("batching", results)


if __name__ == "__main__":
    main()
