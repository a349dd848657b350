"""What a Redis hit saves: cold compile vs a Redis hit in a fresh process vs an L1 hit.

The program is a mid-size MLP (``--layers`` x ``--width``, weights as inputs),
exported with ``jax.export``; ``--repeats`` variants of it differ only in a
constant added to the output (distinct cache keys, the same compile work). In
one run, against one Redis:

1. cold compile: ``Compiler.lookup`` of a variant no tier has (lower, compile in
   the worker, load, store in Redis) in a server-like process whose worker is up
   and has compiled before (the process's first compile, which pays one-time
   initialisation, is reported apart).
2. Redis hit in a fresh process: a child process looks the variants up, each
   time through a new ``Compiler`` with an empty L1 (GET, checksum, decompress,
   deserialize and load); it runs one and checks its output against the
   parent's. The first lookup of the process is reported apart.
3. L1 hit: a lookup of a loaded variant in the parent.

It prints the ratios and the entry's sizes (raw and compressed) and writes
``bench/results/redis_cache.json``. Target: a Redis hit costs at most 1/20 of a
cold compile. Uses ``REDIS_URL`` (or ``--redis-url``) if given, else starts a
private ``redis-server`` on a free port::

    python bench/redis_cache.py                 # 20 layers x 512
    python bench/redis_cache.py --layers 40 --width 1024 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jitserve.compiler import CacheSecret, Compiler, CompilerConfig, RedisSettings  # noqa: E402

jax.config.update("jax_enable_x64", True)

RESULTS = ROOT / "bench" / "results" / "redis_cache.json"
TARGET_RATIO = 20.0


def mlp_program(layers: int, width: int, batch: int,
                salt: float = 0.0) -> tuple[bytes, list[np.ndarray]]:
    """The exported MLP and deterministic arguments (weights, biases, input).

    ``salt`` is added to the output: programs with different salts are distinct
    programs (different cache keys) that cost the same to compile.
    """
    def mlp(params: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
        for w, b in params:
            x = jnp.tanh(x @ w + b)
        return x + salt

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((width, width), np.float32) / np.sqrt(width),
               rng.standard_normal((width,), np.float32) * 0.1) for _ in range(layers)]
    x = rng.standard_normal((batch, width), np.float32)
    exported = jax.export.export(jax.jit(mlp))(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
        jax.ShapeDtypeStruct(x.shape, x.dtype))
    return exported.serialize(), [*jax.tree.leaves(params), x]


def make_compiler(url: str, prefix: str) -> Compiler:
    """A Compiler with no disk tier and only Redis as L2, as a fresh server would have.

    Processes sharing a Redis sign entries with one secret: the first call makes a
    random one, and the child process inherits it through the environment.
    """
    secret = os.environ.setdefault("BENCH_CACHE_SECRET", secrets.token_hex(32))
    return Compiler(CompilerConfig(cache_dir=None, cache_secret=CacheSecret.from_value(secret),
                                   redis=RedisSettings.from_url(url, prefix=prefix)))


def run(compiler: Compiler, lookup: Any, args: list[np.ndarray]) -> float:
    """Run ``lookup``'s executable; a checksum of its output."""
    outs = lookup.executable.run([jax.device_put(a, compiler.device) for a in args])
    return float(np.asarray(outs[0]).astype(np.float64).sum())


def timed_lookup(compiler: Compiler, data: bytes) -> tuple[float, Any]:
    program = compiler.decode(data, "jax_export")  # not timed: the service keeps programs decoded
    start = time.perf_counter()
    lookup = compiler.lookup(program)
    return time.perf_counter() - start, lookup


def child(url: str, prefix: str, programs_dir: str, repeats: int) -> None:
    """The fresh process: Redis-hit lookups, each by a new Compiler (empty L1); JSON out."""
    paths = sorted(Path(programs_dir).glob("variant-*.bin"))
    _, args = mlp_program(*json.loads(os.environ["BENCH_SHAPE"]))
    times, tiers, checksum = [], [], None
    for i in range(repeats):
        compiler = make_compiler(url, prefix)
        seconds, lookup = timed_lookup(compiler, paths[i % len(paths)].read_bytes())
        times.append(seconds)
        tiers.append(lookup.tier)
        if i == 0:
            checksum = run(compiler, lookup, args)
        compiler.close()  # and its Redis connection
    print(json.dumps({"seconds": times, "tiers": tiers, "checksum": checksum}))


@contextmanager
def redis_url(given: str | None, workdir: Path) -> Iterator[str]:
    """``given``, or a private redis-server (LRU-bounded, no persistence) for the run."""
    if given:
        yield given
        return
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        import redis

        url, client = f"redis://127.0.0.1:{port}/0", redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def cold_compiles(compiler: Compiler, variants: list[bytes]) -> tuple[float, list[float], Any]:
    """The first compile of the process, then one cold compile of each variant.

    The first compile pays one-time costs (MLIR and XLA initialisation in both
    processes); the later ones are what a running server pays for a new program.
    """
    first, _ = timed_lookup(compiler, mlp_program(2, 8, 1, salt=-1.0)[0])
    times, lookups = [], []
    for data in variants:
        seconds, lookup = timed_lookup(compiler, data)
        assert lookup.tier == "compiled", lookup.tier
        times.append(seconds)
        lookups.append(lookup)
    return first, times, lookups[0]


def l1_hits(compiler: Compiler, data: bytes, n: int = 200) -> list[float]:
    program = compiler.decode(data, "jax_export")
    times = []
    for _ in range(n):
        start = time.perf_counter()
        lookup = compiler.lookup(program)
        times.append(time.perf_counter() - start)
        assert lookup.tier == "memory"
    return times


def fresh_process_hits(url: str, prefix: str, variants: list[bytes],
                       shape: tuple[int, int, int], repeats: int,
                       workdir: Path) -> dict[str, Any]:
    programs_dir = workdir / "programs"
    programs_dir.mkdir()
    for i, data in enumerate(variants):
        (programs_dir / f"variant-{i:03d}.bin").write_bytes(data)
    env = {**os.environ, "BENCH_SHAPE": json.dumps(shape),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, "--child", url, prefix, str(programs_dir),
                           str(repeats)], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5,
                        help="cold compiles, each of a distinct variant of the program")
    parser.add_argument("--hit-repeats", type=int, default=20,
                        help="Redis-hit lookups in the fresh process, each with an empty L1")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        url, prefix, path, repeats = ns.child
        child(url, prefix, path, int(repeats))
        return
    shape = (ns.layers, ns.width, ns.batch)
    variants = [mlp_program(*shape, salt=float(i))[0] for i in range(ns.repeats)]
    _, args = mlp_program(*shape)
    with tempfile.TemporaryDirectory() as tmp, redis_url(ns.redis_url, Path(tmp)) as url:
        prefix = f"bench-{uuid.uuid4().hex[:10]}"
        compiler = make_compiler(url, prefix)
        compiler.warm()  # a worker start is not part of a compile
        first, cold, lookup = cold_compiles(compiler, variants)
        checksum = run(compiler, lookup, args)
        meta = compiler.catalog.describe(lookup.executable_id) or {}
        hits = fresh_process_hits(url, prefix, variants, shape, ns.hit_repeats, Path(tmp))
        l1 = l1_hits(compiler, variants[0])
        compiler.close()
    report(shape, variants[0], first, cold, hits, l1, meta, checksum)


def report(shape: tuple[int, int, int], data: bytes, first: float, cold: list[float],
           hits: dict[str, Any], l1: list[float], meta: dict[str, Any], checksum: float) -> None:
    assert all(t == "redis" for t in hits["tiers"]), hits["tiers"]
    assert abs(hits["checksum"] - checksum) <= 1e-6 * max(1.0, abs(checksum)), "outputs differ"
    cold_s, hit_first, hit_med = statistics.median(cold), hits["seconds"][0], \
        statistics.median(hits["seconds"])
    l1_med = statistics.median(l1)
    cold_min, hit_min = min(cold), min(hits["seconds"])
    result = {
        "program": {"kind": "mlp", "layers": shape[0], "width": shape[1], "batch": shape[2],
                    "program_bytes": len(data)},
        "first_compile_in_process_s": first,
        "cold_compile_s": {"median": cold_s, "min": cold_min, "all": cold},
        "redis_hit_fresh_process_s": {"first": hit_first, "median": hit_med, "min": hit_min,
                                      "all": hits["seconds"]},
        "l1_hit_s": {"median": l1_med, "min": min(l1)},
        "entry_bytes": {"raw": meta.get("raw_size"), "compressed": meta.get("size"),
                        "ratio": (meta["raw_size"] / meta["size"]) if meta.get("size") else None},
        "ratios": {"cold_over_redis_hit": cold_s / hit_med,
                   "cold_over_redis_hit_min": cold_min / hit_min,
                   "cold_over_redis_hit_first": cold_s / hit_first,
                   "cold_over_l1_hit": cold_s / l1_med,
                   "redis_hit_over_l1_hit": hit_med / l1_med},
        "target": {"max_redis_hit_fraction_of_cold": 1 / TARGET_RATIO,
                   "met": hit_med <= cold_s / TARGET_RATIO},
        "environment": {"jax": jax.__version__, "platform": jax.default_backend(),
                        "device_kind": jax.devices()[0].device_kind, "python": platform.python_version(),
                        "machine": platform.machine(), "cpus": os.cpu_count(),
                        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    }
    print(f"MLP {shape[0]} layers x {shape[1]} (batch {shape[2]}), program {len(data)} bytes")
    print(f"  cold compile            {cold_s * 1e3:9.1f} ms  (median of {len(cold)}; "
          f"min {cold_min * 1e3:.1f} ms; the process's first compile {first * 1e3:.1f} ms)")
    print(f"  Redis hit, new process  {hit_med * 1e3:9.1f} ms  (median of {len(hits['seconds'])}; "
          f"min {hit_min * 1e3:.1f} ms; first in the process {hit_first * 1e3:.1f} ms)")
    print(f"  L1 hit                  {l1_med * 1e6:9.1f} us")
    print(f"  entry: raw {meta.get('raw_size')} B, compressed {meta.get('size')} B "
          f"({result['entry_bytes']['ratio'] or 0:.2f}x)")
    print(f"  cold / Redis hit = {cold_s / hit_med:.1f}x (mins: {cold_min / hit_min:.1f}x)   "
          f"cold / L1 hit = {cold_s / l1_med:.0f}x   "
          f"target >= {TARGET_RATIO:.0f}x: {'met' if result['target']['met'] else 'NOT met'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
