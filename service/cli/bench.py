"""``jitserve bench URL``: measure a running server from the outside, as a caller sees it.

    jitserve bench http://127.0.0.1:8000                    # P1, P2, P4 and the cache, a table
    jitserve bench http://host:8000 --mib 64 --calls 500 --json bench.json

P1 is the latency of a small cached call (``execute?wait``, a 4-element float32
add already compiled), p50 and p99 over ``--calls`` calls, with a msgpack body
and with a JSON one, and each as a ratio to a baseline measured over the same
connection in the same run: ``GET /healthz``, the server's cheapest endpoint (no
body, no decode, no runtime), so the ratio is what a call costs beyond HTTP
itself. P2 is throughput: ``--calls`` msgpack calls (at least twice
``--in-flight``) with ``--in-flight`` (64) of them in flight at once
(threads sharing one client's pool), in calls/s, as a ratio to the same calls one at a time
and to ``GET /healthz`` at the same concurrency. P4 is the transfer rate of one
``--mib`` MiB array up (``POST /v1/arrays``) and down
(``GET /v1/futures/{id}/result``), in GB/s (10^9 bytes), the best and the
median of ``--repeat`` round trips; bodies are encoded before the clock starts.
The cache line is what the server reports when it does (``/readyz``'s
``cache``: ``local``, ``ok`` or ``degraded`` Redis; ``/metrics``' hits by tier
and misses since the server started). P3, a cold compile over a Redis hit in a
fresh process, needs a process of its own and a 20-layer program to compile:
``python bench/redis_cache.py`` measures it (with jax), not this command.

Everything it creates is released at the end. The benchmark program is
StableHLO text, so this needs only the client install (httpx, numpy);
``--api-key`` (or ``JITSERVE_API_KEY``) when the server has keys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import httpx

__all__ = ["add_command", "run"]

# The smallest useful program: x + x on float32[4], in StableHLO (no jax needed here).
_PROGRAM = b"""module @jitserve_bench {
  func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""
_WARMUP_CALLS = 5
_BASELINE = "/healthz"  # the server's cheapest endpoint: the floor of any call over HTTP


def add_command(commands: Any) -> None:
    """Add ``bench`` to the ``jitserve`` parser's ``commands``."""
    bench = commands.add_parser("bench", help="measure call latency and transfer rates",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    bench.add_argument("--calls", type=int, default=200,
                       help="P1 calls per encoding, and P2 calls (200)")
    bench.add_argument("--in-flight", type=int, default=64,
                       help="P2 calls in flight at once (64)")
    bench.add_argument("--mib", type=float, default=256.0, help="P4 array size in MiB (256)")
    bench.add_argument("--repeat", type=int, default=3, help="P4 round trips (3)")
    bench.add_argument("--api-key", default=os.environ.get("JITSERVE_API_KEY"),
                       help="bearer key (JITSERVE_API_KEY)")
    bench.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    bench.add_argument("--skip", choices=["p1", "p2", "p4", "cache"], action="append",
                       default=[], help="leave out a measure")


def run(args: argparse.Namespace) -> int:
    """Run ``jitserve bench``; the exit status."""
    import httpx

    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: dict[str, Any] = {"url": args.url}
    try:
        with httpx.Client(base_url=args.url, headers=headers, timeout=600) as http:
            if "p1" not in args.skip:
                results["P1"] = _p1(http, args.calls)
            if "p2" not in args.skip:
                results["P2"] = _p2(args.url, headers, _execute_path(http), args.calls,
                                    args.in_flight)
            if "p4" not in args.skip:
                results["P4"] = _p4(http, args.mib, args.repeat)
            if "cache" not in args.skip:
                cache = _cache(http)
                if cache:
                    results["cache"] = cache
    except (httpx.HTTPError, _Refused) as e:
        print(f"jitserve bench: {e}", file=sys.stderr)
        return 1
    print(_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


class _Refused(Exception):
    """The server answered with an error where the benchmark needs an answer."""


def _check(response: httpx.Response, *expected: int) -> httpx.Response:
    if response.status_code not in expected:
        raise _Refused(f"{response.request.method} {response.request.url.path}: "
                       f"{response.status_code} {response.text[:300]}")
    return response


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="call", leave=False, file=sys.stderr,
                disable=not sys.stderr.isatty())


# -- P1 ----------------------------------------------------------------------------


def _execute_path(http: httpx.Client) -> str:
    """Upload the benchmark program (idempotent); the path of its execute."""
    from jitserve import wire

    r = _check(http.post("/v1/programs", params={"format": "stablehlo"}, content=_PROGRAM,
                         headers={"content-type": wire.OCTET_STREAM}), 200, 201)
    return f"/v1/programs/{r.json()['program_id']}/execute"


def _msgpack_call() -> tuple[bytes, dict[str, str]]:
    """The body and headers of one small msgpack call."""
    import numpy as np

    from jitserve import wire

    return wire.packb({"args": [np.arange(4, dtype=np.float32)]}), {
        "content-type": wire.MSGPACK, "accept": wire.MSGPACK}


def _p1(http: httpx.Client, calls: int) -> dict[str, Any]:
    from jitserve import wire

    path = _execute_path(http)
    bodies = {
        "msgpack": _msgpack_call(),
        "json": (json.dumps({"args": [{"dtype": "float32", "shape": [4],
                                       "data": [0.0, 1.0, 2.0, 3.0]}]}).encode(),
                 {"content-type": wire.JSON, "accept": wire.JSON}),
    }
    out: dict[str, Any] = {name: _p1_calls(http, path, body, headers, calls, name)
                           for name, (body, headers) in bodies.items()}
    out["baseline"] = baseline = _baseline_calls(http, calls)
    for name in bodies:
        out[name]["over_baseline_p50"] = out[name]["p50_ms"] / baseline["p50_ms"]
    return out


def _latencies(latencies: list[float], calls: int) -> dict[str, Any]:
    return {"calls": calls, "p50_ms": _percentile(latencies, 50) * 1e3,
            "p99_ms": _percentile(latencies, 99) * 1e3,
            "mean_ms": statistics.fmean(latencies) * 1e3}


def _baseline_calls(http: httpx.Client, calls: int) -> dict[str, Any]:
    """Latencies of ``GET /healthz`` over the same connection: HTTP's own floor here."""
    def call() -> None:
        _check(http.get(_BASELINE), 200)

    for _ in range(_WARMUP_CALLS):
        call()
    return {"endpoint": f"GET {_BASELINE}",
            **_latencies(_timed(call, calls, f"P1 baseline {_BASELINE}"), calls)}


def _p1_calls(http: httpx.Client, path: str, body: bytes, headers: dict[str, str],
              calls: int, name: str) -> dict[str, Any]:
    """Latencies of ``calls`` executes of ``body`` (after a few unmeasured ones)."""
    futures: list[str] = []

    def call() -> None:
        answer = _check(http.post(path, params={"wait": 60_000}, content=body,
                                  headers=headers), 200)
        futures.append(_future_id(answer))

    for _ in range(_WARMUP_CALLS):  # the first compiles; all warm the connection
        call()
    latencies = _timed(call, calls, f"P1 {name}")
    _release(http, futures)
    return _latencies(latencies, calls)


# -- P2 ----------------------------------------------------------------------------


def _p2(url: str, headers: dict[str, str], path: str, calls: int,
        in_flight: int) -> dict[str, Any]:
    """Throughput of small msgpack calls ``in_flight`` at a time, against the same calls
    one at a time and ``GET /healthz`` at the same concurrency.

    Threads over one ``httpx.Client`` (a pool of ``in_flight`` connections): on a
    small host that client costs a fifth of what ``httpx.AsyncClient`` does per
    request, and the figure should be the server's, not the client's.
    """
    import httpx

    in_flight = max(1, in_flight)
    total = max(calls, 2 * in_flight)
    body, call_headers = _msgpack_call()
    futures: list[str] = []
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    with httpx.Client(base_url=url, headers=headers, limits=limits, timeout=600) as http:
        def call() -> None:
            answer = _check(http.post(path, params={"wait": 60_000}, content=body,
                                      headers=call_headers), 200)
            futures.append(_future_id(answer))  # list.append is atomic

        def baseline() -> None:
            _check(http.get(_BASELINE), 200)

        _concurrently(call, in_flight, in_flight)  # opens the connections; unmeasured
        sequential = _concurrently(call, total, 1)
        concurrent = _concurrently(call, total, in_flight)
        _concurrently(baseline, in_flight, in_flight)
        floor = _concurrently(baseline, total, in_flight)
        _release(http, futures)
    return {"in_flight": in_flight, "calls": total,
            "calls_per_s": total / concurrent, "sequential_calls_per_s": total / sequential,
            "over_sequential": sequential / concurrent,
            "baseline": {"endpoint": f"GET {_BASELINE}", "calls_per_s": total / floor},
            "over_baseline": floor / concurrent}


def _concurrently(call: Callable[[], None], n: int, width: int) -> float:
    """Seconds to make ``n`` calls from ``width`` threads (each takes the next); the
    first failure is raised."""
    import concurrent.futures
    import itertools

    tickets = itertools.count()  # next() on it is atomic: each call is taken once

    def worker() -> None:
        while next(tickets) < n:
            call()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(width, n)) as pool:
        for done in [pool.submit(worker) for _ in range(min(width, n))]:
            done.result()
    return time.perf_counter() - start


# -- the cache, as the server reports it ---------------------------------------------


def _cache(http: httpx.Client) -> dict[str, Any] | None:
    """``/readyz``'s cache mode and ``/metrics``' executable lookups by tier (since the
    server started); ``None`` when the server reports neither."""
    out: dict[str, Any] = {}
    ready = http.get("/readyz")
    if ready.headers.get("content-type", "").startswith("application/json"):
        doc = ready.json()
        mode = doc.get("cache", (doc.get("error") or {}).get("cache"))
        if mode is not None:
            out["mode"] = mode
    metrics = http.get("/metrics")
    if metrics.status_code == 200:
        hits: dict[str, float] = {}
        for line in metrics.text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith('jitserve_cache_hits_total{tier="'):
                hits[name.split('"')[1]] = float(value)
            elif name == "jitserve_cache_misses_total":
                out["misses"] = float(value)
            elif name == "jitserve_compilations_total":
                out["compilations"] = float(value)
        if hits:
            out["hits"] = hits
    return out or None


def _future_id(answer: httpx.Response) -> str:
    from jitserve import wire

    if answer.headers.get("content-type", "").startswith(wire.JSON):
        return str(answer.json()["future_id"])
    return str(wire.unpackb(answer.content)["future_id"])


def _timed(fn: Callable[[], None], n: int, desc: str) -> list[float]:
    times = []
    with _bar(n, desc) as bar:
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            bar.update(1)
    return times


def _percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q))


def _release(http: httpx.Client, futures: list[str]) -> None:
    for i in range(0, len(futures), 5000):
        outputs = [{"future": f, "output": 0} for f in futures[i:i + 5000]]
        _check(http.post("/v1/futures/release", json={"outputs": outputs}), 200)


# -- P4 ----------------------------------------------------------------------------


def _p4(http: httpx.Client, mib: float, repeat: int) -> dict[str, Any]:
    import numpy as np

    from jitserve import wire

    nbytes = int(mib * (1 << 20)) // 4 * 4
    array = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    # As the SDK sends it: views of the array's buffer in slices, with a length.
    body = wire.PackedBody(wire.pack_pieces({"arrays": [array]}))
    headers = {"content-type": wire.MSGPACK, "content-length": str(body.nbytes)}
    up, down = [], []
    with _bar(repeat, f"P4 {mib:g} MiB") as bar:
        for _ in range(repeat):
            start = time.perf_counter()
            # httpx sends memoryviews as well, though its hints name bytes alone
            pieces = cast("Iterator[bytes]", iter(body))
            put = _check(http.post("/v1/arrays", content=pieces, headers=headers), 201)
            up.append(time.perf_counter() - start)
            future = put.json()["future_id"]
            start = time.perf_counter()
            got = _download(http, f"/v1/futures/{future}/result")
            down.append(time.perf_counter() - start)
            if got < nbytes:
                raise _Refused(f"the result was {got} bytes, not {nbytes}")
            _release(http, [future])
            bar.update(1)
    return {"mib": mib, "bytes": nbytes, "repeat": repeat,
            "upload_gbps": _rates(nbytes, up), "download_gbps": _rates(nbytes, down)}


def _download(http: httpx.Client, path: str) -> int:
    """GET ``path`` as msgpack into one buffer of its declared length, as the SDK reads
    big answers; the bytes read."""
    from jitserve import wire

    with http.stream("GET", path, headers={"accept": wire.MSGPACK}) as response:
        if response.status_code != 200:
            response.read()
            _check(response, 200)
        buf = bytearray(int(response.headers.get("content-length") or 0))
        pos = 0
        for chunk in response.iter_raw():
            buf[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
    return pos


def _rates(nbytes: int, seconds: list[float]) -> dict[str, float]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"best": max(rates), "median": statistics.median(rates)}


def _table(results: dict[str, Any]) -> str:
    rows = [("measure", "value")]
    p1 = results.get("P1")
    if p1:
        base = p1["baseline"]
        rows.append((f"P1 baseline, {base['endpoint']}: p50 / p99",
                     f"{base['p50_ms']:.3f} / {base['p99_ms']:.3f} ms"))
        for name in ("msgpack", "json"):
            rows.append((f"P1 cached call, {name}: p50 / p99 (p50 / baseline)",
                         f"{p1[name]['p50_ms']:.3f} / {p1[name]['p99_ms']:.3f} ms "
                         f"({p1[name]['over_baseline_p50']:.2f}x)"))
    p2 = results.get("P2")
    if p2:
        rows.append((f"P2 {p2['calls']} calls, {p2['in_flight']} in flight",
                     f"{p2['calls_per_s']:.0f} calls/s ({p2['over_sequential']:.2f}x one at "
                     f"a time: {p2['sequential_calls_per_s']:.0f}/s)"))
        rows.append((f"P2 baseline, {p2['baseline']['endpoint']}, {p2['in_flight']} in flight",
                     f"{p2['baseline']['calls_per_s']:.0f} calls/s (calls: "
                     f"{p2['over_baseline']:.2f}x of it)"))
    p4 = results.get("P4")
    if p4:
        for way in ("upload", "download"):
            rate = p4[f"{way}_gbps"]
            rows.append((f"P4 {way} {p4['mib']:g} MiB: best / median",
                         f"{rate['best']:.2f} / {rate['median']:.2f} GB/s"))
    cache = results.get("cache")
    if cache:
        hits = ", ".join(f"{tier} {n:.0f}" for tier, n in cache.get("hits", {}).items())
        rows.append((f"cache ({cache.get('mode', '?')}), since start",
                     f"hits {hits or '?'}; misses {cache.get('misses', 0):.0f}"))
    rows.append(("P3 (cold compile / Redis hit)", "needs a fresh process: bench/redis_cache.py"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{a:<{width}}  {b}" for a, b in rows]
    lines.insert(1, "-" * (width + 2 + max(len(r[1]) for r in rows)))
    return f"jitserve bench {results['url']}\n" + "\n".join(lines)
