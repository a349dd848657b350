"""Cold compile vs L1 (memory) hit vs L2 (disk) hit, measured in one run.

For each program and each repeat: a fresh cache dir and a fresh ``Compiler``
(its compile worker started beforehand, so a cold compile is the compile, not
jax's import) looks the program up cold; the same ``Compiler`` looks it up again
(L1); a fresh ``Compiler`` on the same dir looks it up a third time (L2). Each
lookup's executable is then run and checked against ``jax.jit`` (untimed), so a
fast but broken cache hit cannot pass for a good one.

Usage::

    python bench/compile.py [--repeats 5] [--out bench/results/compile.json]

Prints medians and the ratios L2/cold and L1/cold, checks the target
"L2 hit <= 1/20 of cold compile", and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jitserve.compiler import Compiler, CompilerConfig, Lookup

jax.config.update("jax_enable_x64", True)

TARGET_L2_FRACTION = 1 / 20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compile.json"


@dataclass(frozen=True)
class BenchProgram:
    """A program to time: its function and example arguments (a pytree)."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]

    def serialized(self) -> bytes:
        specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.args)
        return bytes(jax.export.export(jax.jit(self.fn))(*specs).serialize())

    def flat_args(self) -> list[np.ndarray]:
        return jax.tree_util.tree_leaves(self.args)

    def expected(self) -> list[np.ndarray]:
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.jit(self.fn)(*self.args))]


def small_fn(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.tanh(x @ y) + 1.0


def mlp_loss(params: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return jnp.mean(x**2)


def mlp_train_step(params: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> Any:
    """One SGD step of a deep MLP: the loss, and the updated parameters."""
    loss, grads = jax.value_and_grad(mlp_loss)(params, x)
    return loss, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def programs(layers: int = 20, width: int = 512) -> list[BenchProgram]:
    rng = np.random.default_rng(0)
    scale = np.float32(1 / np.sqrt(width))
    params = [((rng.standard_normal((width, width), np.float32) * scale), np.zeros(width, np.float32))
              for _ in range(layers)]
    small = (rng.standard_normal((8, 8), np.float32), rng.standard_normal((8, 8), np.float32))
    return [
        BenchProgram("small", small_fn, small),
        BenchProgram(f"mlp_{layers}x{width}_train_step", mlp_train_step,
                     (params, rng.standard_normal((32, width), np.float32))),
    ]


def _timed(f: Callable[[], Lookup]) -> tuple[float, Lookup]:
    start = time.perf_counter()
    result = f()
    return time.perf_counter() - start, result


def _check(c: Compiler, lookup: Lookup, program: BenchProgram, want: list[np.ndarray]) -> str | None:
    """Run the looked-up executable; ``None`` if it matches jax.jit, else what went wrong."""
    try:
        outs = lookup.executable.run([jax.device_put(a, c.device) for a in program.flat_args()])
        for got, exp in zip(outs, want, strict=True):
            np.testing.assert_allclose(np.asarray(got), exp, rtol=1e-4, atol=1e-5)
    except Exception as e:  # reported, not raised: the timings are still worth printing
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None


def one_repeat(program: BenchProgram, data: bytes, want: list[np.ndarray]) -> dict[str, Any]:
    """Cold, L1 and L2 lookups of ``program`` on a fresh cache dir."""
    row: dict[str, Any] = {"errors": {}}
    with tempfile.TemporaryDirectory(prefix="jitserve-bench-") as cache_dir:
        config = CompilerConfig(cache_dir=Path(cache_dir))
        cold_c = Compiler(config)
        cold_c.warm()  # the worker's start-up is not part of a compile
        try:
            prog = cold_c.decode(data)
            for tier, expect in (("cold", "compiled"), ("l1", "memory")):
                row[tier], lookup = _timed(lambda: cold_c.lookup(prog))
                assert lookup.tier == expect, f"{tier} lookup answered by {lookup.tier}"
                row["errors"][tier] = _check(cold_c, lookup, program, want)
        finally:
            cold_c.close()
        warm_c = Compiler(config)
        try:
            prog = warm_c.decode(data)
            row["l2"], lookup = _timed(lambda: warm_c.lookup(prog))
            assert lookup.tier == "disk", f"l2 lookup answered by {lookup.tier}"
            row["errors"]["l2"] = _check(warm_c, lookup, program, want)
        finally:
            warm_c.close()
    return row


def bench(program: BenchProgram, repeats: int) -> dict[str, Any]:
    data, want = program.serialized(), program.expected()
    rows = [one_repeat(program, data, want) for _ in range(repeats)]
    medians = {tier: statistics.median(r[tier] for r in rows) for tier in ("cold", "l1", "l2")}
    errors = sorted({f"{tier}: {e}" for r in rows for tier, e in r["errors"].items() if e})
    return {
        "program": program.name, "program_bytes": len(data), "repeats": repeats,
        "median_s": medians, "runs_s": {t: [r[t] for r in rows] for t in medians},
        "l2_over_cold": medians["l2"] / medians["cold"], "l1_over_cold": medians["l1"] / medians["cold"],
        "target_l2_over_cold": TARGET_L2_FRACTION,
        "target_met": medians["l2"] <= TARGET_L2_FRACTION * medians["cold"] and not errors,
        "errors": errors,
    }


def report(result: dict[str, Any]) -> None:
    m = result["median_s"]
    verdict = "MET" if result["target_met"] else "NOT MET"
    print(f"{result['program']} ({result['program_bytes']:,} bytes, median of {result['repeats']}):")
    print(f"  cold compile {m['cold'] * 1e3:9.2f} ms")
    print(f"  L1 hit       {m['l1'] * 1e3:9.3f} ms   L1/cold = {result['l1_over_cold']:.5f}")
    print(f"  L2 hit       {m['l2'] * 1e3:9.2f} ms   L2/cold = {result['l2_over_cold']:.4f}")
    print(f"  target L2 hit <= 1/20 of cold compile: {verdict}")
    for error in result["errors"]:
        print(f"  ERROR {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    results = []
    for program in programs(args.layers, args.width):
        results.append(bench(program, args.repeats))
        report(results[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "python": platform.python_version(),
            "host": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["target_met"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
