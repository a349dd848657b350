"""``jitserve bench URL``: measure a running server from the outside, as a caller sees it.

    jitserve bench http://127.0.0.1:8000                    # P1 and P4, a table
    jitserve bench http://host:8000 --mib 64 --calls 500 --json bench.json

P1 is the latency of a small cached call (``execute?wait``, a 4-element float32
add already compiled), p50 and p99 over ``--calls`` calls, with a msgpack body
and with a JSON one. P4 is the transfer rate of one ``--mib`` MiB array up
(``POST /v1/arrays``) and down (``GET /v1/futures/{id}/result``), in GB/s
(10^9 bytes), the best and the median of ``--repeat`` round trips; bodies are
encoded before the clock starts. Everything it creates is released at the end.
The benchmark program is StableHLO text, so this needs only the client install
(httpx, numpy); ``--api-key`` (or ``JITSERVE_API_KEY``) when the server has keys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def add_command(commands: Any) -> None:
    """Add ``bench`` to the ``jitserve`` parser's ``commands``."""
    bench = commands.add_parser("bench", help="measure call latency and transfer rates",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    bench.add_argument("--calls", type=int, default=200, help="P1 calls per encoding (200)")
    bench.add_argument("--mib", type=float, default=256.0, help="P4 array size in MiB (256)")
    bench.add_argument("--repeat", type=int, default=3, help="P4 round trips (3)")
    bench.add_argument("--api-key", default=os.environ.get("JITSERVE_API_KEY"),
                       help="bearer key (JITSERVE_API_KEY)")
    bench.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    bench.add_argument("--skip", choices=["p1", "p4"], action="append", default=[],
                       help="leave out a measure")


def run(args: argparse.Namespace) -> int:
    """Run ``jitserve bench``; the exit status."""
    import httpx

    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: dict[str, Any] = {"url": args.url}
    try:
        with httpx.Client(base_url=args.url, headers=headers, timeout=600) as http:
            if "p1" not in args.skip:
                results["P1"] = _p1(http, args.calls)
            if "p4" not in args.skip:
                results["P4"] = _p4(http, args.mib, args.repeat)
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


def _p1(http: httpx.Client, calls: int) -> dict[str, Any]:
    import numpy as np

    from jitserve import wire

    r = _check(http.post("/v1/programs", params={"format": "stablehlo"}, content=_PROGRAM,
                         headers={"content-type": wire.OCTET_STREAM}), 200, 201)
    path = f"/v1/programs/{r.json()['program_id']}/execute"
    x = np.arange(4, dtype=np.float32)
    bodies = {
        "msgpack": (wire.packb({"args": [x]}), {"content-type": wire.MSGPACK,
                                                "accept": wire.MSGPACK}),
        "json": (json.dumps({"args": [{"dtype": "float32", "shape": [4],
                                       "data": x.tolist()}]}).encode(),
                 {"content-type": wire.JSON, "accept": wire.JSON}),
    }
    return {name: _p1_calls(http, path, body, headers, calls, name)
            for name, (body, headers) in bodies.items()}


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
    return {"calls": calls, "p50_ms": _percentile(latencies, 50) * 1e3,
            "p99_ms": _percentile(latencies, 99) * 1e3,
            "mean_ms": statistics.fmean(latencies) * 1e3}


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
            put = _check(http.post("/v1/arrays", content=iter(body), headers=headers), 201)
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
    for name, p1 in results.get("P1", {}).items():
        rows.append((f"P1 cached call, {name}: p50 / p99", f"{p1['p50_ms']:.3f} / "
                                                           f"{p1['p99_ms']:.3f} ms"))
    p4 = results.get("P4")
    if p4:
        for way in ("upload", "download"):
            rate = p4[f"{way}_gbps"]
            rows.append((f"P4 {way} {p4['mib']:g} MiB: best / median",
                         f"{rate['best']:.2f} / {rate['median']:.2f} GB/s"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{a:<{width}}  {b}" for a, b in rows]
    lines.insert(1, "-" * (width + 2 + max(len(r[1]) for r in rows)))
    return f"jitserve bench {results['url']}\n" + "\n".join(lines)
