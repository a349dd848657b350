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
   time through a new ``Compiler`` with an empty L1 (GET, MAC check, decompress,
   deserialize and load); it runs one and checks its output against the
   parent's. The first lookup of the process is reported apart. Three ways in:
   ``lookup`` of a decoded program (the service keeps programs decoded),
   ``load`` by executable id (what a restarted runtime does when told which
   executable to run: no program needed), and the program's blob read from Redis
   and decoded, then ``lookup`` (a process that knows neither).
3. The hit's breakdown, stage by stage in the same child: Redis GET, MAC check +
   zstd + meta (``decode_entry``), XLA's ``deserialize_executable``, and the
   ``Executable`` wrapper; "other" is the lookup's median less their sum. Cold
   compile over XLA's deserialize alone is the bound of the ratio: what a hit
   that cost nothing but XLA's load would reach.
4. L1 hit: a lookup of a loaded variant in the parent.

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
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jitserve.compiler import (  # noqa: E402
    CacheSecret,
    Compiler,
    CompilerConfig,
    Executable,
    RedisSettings,
)
from jitserve.compiler.cache import decode_entry  # noqa: E402

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


def child(url: str, prefix: str, manifest: str, repeats: int) -> None:
    """The fresh process: Redis hits, each by a new Compiler (empty L1); JSON out.

    ``manifest`` is a JSON file of the variants: program file, program id, executable id.
    """
    variants = json.loads(Path(manifest).read_text())
    _, args = mlp_program(*json.loads(os.environ["BENCH_SHAPE"]))
    out: dict[str, Any] = {"seconds": [], "tiers": [], "load_s": [], "by_program_s": [],
                           "stages_s": {name: [] for name in STAGES}}
    # Each kind of hit in turn, so that all see the process at the same age (its
    # first hits cost more than its later ones).
    for i in range(repeats):
        variant = variants[i % len(variants)]
        compiler = make_compiler(url, prefix)
        seconds, lookup = timed_lookup(compiler, Path(variant["path"]).read_bytes())
        out["seconds"].append(seconds)
        out["tiers"].append(lookup.tier)
        if i == 0:
            out["checksum"] = run(compiler, lookup, args)
        compiler.close()  # and its Redis connection
        with closing(make_compiler(url, prefix)) as compiler:
            start = time.perf_counter()
            found = compiler.load(variant["executable_id"])
            out["load_s"].append(time.perf_counter() - start)
            assert found is not None and found.tier == "redis", found
        with closing(make_compiler(url, prefix)) as compiler:
            start = time.perf_counter()
            program = compiler.programs.get(variant["program_id"])
            assert program is not None
            assert compiler.lookup(program).tier == "redis"
            out["by_program_s"].append(time.perf_counter() - start)
        with closing(make_compiler(url, prefix)) as compiler:
            for name, seconds in hit_stages(compiler, variant["executable_id"]).items():
                out["stages_s"][name].append(seconds)
    print(json.dumps(out))


# The stages of an L2 hit, in order (``hit_stages``).
STAGES = ("redis_get", "check_and_decompress", "xla_deserialize", "wrap")


def hit_stages(compiler: Compiler, key: str) -> dict[str, float]:
    """One Redis hit of ``key`` taken apart, as ``Compiler.load`` does it; seconds by stage."""
    from jax._src.lib import xla_client as xc
    from jax.extend import backend as xb

    from jitserve.compiler._worker import compile_options

    backend, options = xb.get_backend(), compile_options()
    devices = xc.DeviceList((compiler.device,))
    secret = CacheSecret.from_value(os.environ["BENCH_CACHE_SECRET"])
    expect = {"key": key, "jaxlib_version": jaxlib.__version__, "platform": compiler.platform,
              "device_kind": compiler.device.device_kind}
    marks = [time.perf_counter()]
    data = compiler.tiers[-1].get(key)
    marks.append(time.perf_counter())
    entry = decode_entry(key, data, secret, expect)
    marks.append(time.perf_counter())
    loaded = backend.deserialize_executable(entry.executable, devices, options)
    marks.append(time.perf_counter())
    Executable(loaded, key, entry.meta, len(entry.executable))
    marks.append(time.perf_counter())
    return {name: b - a for name, a, b in zip(STAGES, marks, marks[1:])}


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


def first_compile(compiler: Compiler) -> float:
    """The first compile of the process: one-time costs (MLIR and XLA initialisation in
    both processes), reported apart from what a running server pays for a new program."""
    return timed_lookup(compiler, mlp_program(2, 8, 1, salt=-1.0)[0])[0]


def cold_compile(compiler: Compiler, data: bytes) -> tuple[float, Any]:
    seconds, lookup = timed_lookup(compiler, data)
    assert lookup.tier == "compiled", lookup.tier
    return seconds, lookup


def l1_hits(compiler: Compiler, data: bytes, n: int = 200) -> list[float]:
    program = compiler.decode(data, "jax_export")
    times = []
    for _ in range(n):
        start = time.perf_counter()
        lookup = compiler.lookup(program)
        times.append(time.perf_counter() - start)
        assert lookup.tier == "memory"
    return times


def fresh_process_hits(url: str, prefix: str, variants: list[dict[str, Any]],
                       shape: tuple[int, int, int], repeats: int,
                       workdir: Path) -> dict[str, Any]:
    manifest = workdir / "variants.json"
    manifest.write_text(json.dumps(variants))
    env = {**os.environ, "BENCH_SHAPE": json.dumps(shape),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, "--child", url, prefix, str(manifest),
                           str(repeats)], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def store_variant(compiler: Compiler, i: int, data: bytes, lookup: Any,
                  workdir: Path) -> dict[str, Any]:
    """Keep a variant's program in the tiers (Redis) and on disk for the child."""
    program, _ = compiler.programs.put(data, "jax_export")
    path = workdir / f"variant-{i:03d}.bin"
    path.write_bytes(data)
    return {"path": str(path), "program_id": program.program_id,
            "executable_id": lookup.executable_id}


def merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' fresh-process figures as one, and each round's first hit apart."""
    out: dict[str, Any] = {"checksum": rounds[0]["checksum"], "stages_s": {}}
    for name in ("seconds", "tiers", "load_s", "by_program_s"):
        out[name] = [x for r in rounds for x in r[name]]
    for name in STAGES:
        out["stages_s"][name] = [x for r in rounds for x in r["stages_s"][name]]
    out["firsts"] = {name: [r[name][0] for r in rounds]
                     for name in ("seconds", "load_s", "by_program_s")}
    assert all(r["checksum"] == out["checksum"] for r in rounds), "outputs differ"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds: a cold compile of a new variant of the program, then "
                             "a fresh process's hits")
    parser.add_argument("--hit-repeats", type=int, default=20,
                        help="Redis hits of each kind in all, each with an empty L1, spread "
                             "over the rounds' fresh processes")
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
        first = first_compile(compiler)
        # Rounds: a cold compile, then a fresh process's hits right after it, so that
        # each ratio pairs figures taken under the same load of the machine.
        per_round = max(2, -(-ns.hit_repeats // ns.repeats))
        cold, stored, rounds, checksum, meta = [], [], [], 0.0, {}
        for i, data in enumerate(variants):
            seconds, lookup = cold_compile(compiler, data)
            cold.append(seconds)
            if i == 0:
                checksum = run(compiler, lookup, args)
                meta = compiler.catalog.describe(lookup.executable_id) or {}
            stored.append(store_variant(compiler, i, data, lookup, Path(tmp)))
            rounds.append(fresh_process_hits(url, prefix, stored, shape, per_round, Path(tmp)))
        l1 = l1_hits(compiler, variants[0])
        compiler.close()
    hits = merge(rounds)
    hits["paired_ratios"] = [c / statistics.median(r["seconds"]) for c, r in zip(cold, rounds)]
    report(shape, variants[0], first, cold, hits, l1, meta, checksum)


def _summary(seconds: list[float], firsts: list[float]) -> dict[str, Any]:
    """Medians and mins of a kind of hit; ``first``: the median of the processes' first."""
    return {"first": statistics.median(firsts), "median": statistics.median(seconds),
            "min": min(seconds), "all": seconds, "firsts": firsts}


def breakdown(hits: dict[str, Any], hit_med: float) -> dict[str, float]:
    """Median seconds of each stage of a hit, and what the lookup spends beside them."""
    stages = {name: statistics.median(values) for name, values in hits["stages_s"].items()}
    stages["other"] = max(hit_med - sum(stages.values()), 0.0)
    return stages


def report(shape: tuple[int, int, int], data: bytes, first: float, cold: list[float],
           hits: dict[str, Any], l1: list[float], meta: dict[str, Any], checksum: float) -> None:
    assert all(t == "redis" for t in hits["tiers"]), hits["tiers"]
    assert abs(hits["checksum"] - checksum) <= 1e-6 * max(1.0, abs(checksum)), "outputs differ"
    cold_s, hit_first, hit_med = statistics.median(cold), \
        statistics.median(hits["firsts"]["seconds"]), statistics.median(hits["seconds"])
    l1_med = statistics.median(l1)
    cold_min, hit_min = min(cold), min(hits["seconds"])
    load = _summary(hits["load_s"], hits["firsts"]["load_s"])
    by_program = _summary(hits["by_program_s"], hits["firsts"]["by_program_s"])
    stages = breakdown(hits, hit_med)
    result = {
        "program": {"kind": "mlp", "layers": shape[0], "width": shape[1], "batch": shape[2],
                    "program_bytes": len(data)},
        "first_compile_in_process_s": first,
        "cold_compile_s": {"median": cold_s, "min": cold_min, "all": cold},
        "redis_hit_fresh_process_s": _summary(hits["seconds"], hits["firsts"]["seconds"]),
        "redis_load_by_id_fresh_process_s": load,
        "redis_program_and_hit_fresh_process_s": by_program,
        "redis_hit_breakdown_s": stages,
        "l1_hit_s": {"median": l1_med, "min": min(l1)},
        "entry_bytes": {"raw": meta.get("raw_size"), "compressed": meta.get("size"),
                        "ratio": (meta["raw_size"] / meta["size"]) if meta.get("size") else None},
        "ratios": {"cold_over_redis_hit": cold_s / hit_med,
                   "cold_over_redis_hit_paired": statistics.median(hits["paired_ratios"]),
                   "paired_by_round": hits["paired_ratios"],
                   "cold_over_redis_hit_min": cold_min / hit_min,
                   "cold_over_redis_hit_first": cold_s / hit_first,
                   "cold_over_redis_load_by_id": cold_s / load["median"],
                   "cold_over_redis_program_and_hit": cold_s / by_program["median"],
                   # the bound: no hit can cost less than XLA's load of the executable
                   "cold_over_xla_deserialize": cold_s / stages["xla_deserialize"],
                   "cold_over_l1_hit": cold_s / l1_med,
                   "redis_hit_over_l1_hit": hit_med / l1_med},
        "target": {"max_redis_hit_fraction_of_cold": 1 / TARGET_RATIO,
                   "met": hit_med <= cold_s / TARGET_RATIO},
        "environment": {"jax": jax.__version__, "platform": jax.default_backend(),
                        "device_kind": jax.devices()[0].device_kind,
                        "python": platform.python_version(), "machine": platform.machine(),
                        "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
                        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    }
    print_report(result, len(cold), len(hits["seconds"]))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  wrote {RESULTS.relative_to(ROOT)}")


def print_report(result: dict[str, Any], n_cold: int, n_hits: int) -> None:
    prog, ratios = result["program"], result["ratios"]
    cold, hit = result["cold_compile_s"], result["redis_hit_fresh_process_s"]
    entry = result["entry_bytes"]

    def ms(doc: dict[str, Any]) -> str:
        return (f"{doc['median'] * 1e3:9.1f} ms  (median of {n_hits}; min {doc['min'] * 1e3:.1f} "
                f"ms; first in a process {doc['first'] * 1e3:.1f} ms, median of "
                f"{len(doc['firsts'])})")

    print(f"MLP {prog['layers']} layers x {prog['width']} (batch {prog['batch']}), "
          f"program {prog['program_bytes']} bytes")
    print(f"  cold compile              {cold['median'] * 1e3:9.1f} ms  (median of {n_cold}; "
          f"min {cold['min'] * 1e3:.1f} ms; the process's first compile "
          f"{result['first_compile_in_process_s'] * 1e3:.1f} ms)")
    print(f"  Redis hit, new process    {ms(hit)}")
    print(f"    by executable id (load) {ms(result['redis_load_by_id_fresh_process_s'])}")
    print(f"    program from Redis+hit  {ms(result['redis_program_and_hit_fresh_process_s'])}")
    parts = result["redis_hit_breakdown_s"]
    total = sum(parts.values()) or 1.0
    print("    the hit, by stage (medians): " + ", ".join(
        f"{name} {seconds * 1e3:.2f} ms ({seconds / total:.0%})" for name, seconds in parts.items()))
    print(f"  L1 hit                    {result['l1_hit_s']['median'] * 1e6:9.1f} us")
    print(f"  entry: raw {entry['raw']} B, compressed {entry['compressed']} B "
          f"({entry['ratio'] or 0:.2f}x)")
    print(f"  cold / Redis hit = {ratios['cold_over_redis_hit']:.1f}x "
          f"(paired by round: {ratios['cold_over_redis_hit_paired']:.1f}x; "
          f"mins: {ratios['cold_over_redis_hit_min']:.1f}x; first: "
          f"{ratios['cold_over_redis_hit_first']:.1f}x; by id: "
          f"{ratios['cold_over_redis_load_by_id']:.1f}x; with the program's decode: "
          f"{ratios['cold_over_redis_program_and_hit']:.1f}x)   "
          f"cold / L1 hit = {ratios['cold_over_l1_hit']:.0f}x   target >= {TARGET_RATIO:.0f}x: "
          f"{'met' if result['target']['met'] else 'NOT met'}")
    print(f"  the bound: cold / XLA's deserialize alone = "
          f"{ratios['cold_over_xla_deserialize']:.1f}x (no hit can do better here)")
    print(f"  (load average {result['environment']['load_average']:.1f} on "
          f"{result['environment']['cpus']} CPUs: ratios are of one run, on one machine)")


if __name__ == "__main__":
    main()
