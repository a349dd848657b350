"""Custom-call targets jax guarantees stable that shape refinement rewrites.

A shape-polymorphic export of ``top_k``, ``approx_max_k`` or ``rng_bit_generator``
whose size is symbolic calls a ``stablehlo.dynamic_*`` placeholder; refinement turns
it into a plain op (``ApproxTopK`` for the approximate one, whose result types XLA
checks against its attributes). These run, and a resized ``ApproxTopK`` is a
compile error, never a crash.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from jax import lax

from jitserve.compiler import Aval, CompileFailed, Compiler

B = jax.export.symbolic_shape("b")[0]
KEY = np.arange(4, dtype=np.uint32)

CASES: dict[str, tuple[Callable[..., Any], list[jax.ShapeDtypeStruct], str]] = {
    "top_k": (lambda x: lax.top_k(x, x.shape[0] // 2),
              [jax.ShapeDtypeStruct((B,), np.float32)], "stablehlo.dynamic_top_k"),
    "approx_max_k": (lambda x: lax.approx_max_k(x, x.shape[0]),
                     [jax.ShapeDtypeStruct((B,), np.float32)], "stablehlo.dynamic_approx_top_k"),
    "rng_bit_generator": (
        lambda key, x: lax.rng_bit_generator(key, (x.shape[0], 3), dtype=np.uint32)[1],
        [jax.ShapeDtypeStruct((4,), np.uint32), jax.ShapeDtypeStruct((B,), np.float32)],
        "stablehlo.dynamic_rng_bit_generator"),
}


def _args(name: str, n: int) -> list[np.ndarray]:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    return [KEY, x] if name == "rng_bit_generator" else [x]


@pytest.mark.parametrize("name", sorted(CASES))
def test_dynamic_placeholders_run_once_refined(compiler: Compiler, name: str) -> None:
    fn, specs, target = CASES[name]
    exported = jax.export.export(jax.jit(fn))(*specs)
    assert target in exported.mlir_module()
    program = compiler.decode(bytes(exported.serialize()))
    for n in (4, 7):
        args = _args(name, n)
        lookup = compiler.lookup(program, [Aval.of(a) for a in args])
        outs = lookup.executable.run([jax.device_put(a, compiler.device) for a in args])
        for got, want in zip(outs, jax.tree.leaves(jax.jit(fn)(*args)), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


APPROX_TEXT = jax.jit(lambda x: lax.approx_max_k(x, 3)).lower(np.ones(6, np.float32)).as_text()
RESIZED = {
    "results_bigger": APPROX_TEXT.replace("tensor<3xf32>", "tensor<100xf32>")
                                 .replace("tensor<3xi32>", "tensor<100xi32>"),
    "top_k_bigger": re.sub(r"top_k = 3 : i64", "top_k = 1000 : i64", APPROX_TEXT),
    "reduction_dim_out_of_range": re.sub(r"reduction_dim = 0 : i64", "reduction_dim = 5 : i64",
                                         APPROX_TEXT),
}


@pytest.mark.parametrize("name", sorted(RESIZED))
def test_a_resized_approx_top_k_is_a_compile_error(compiler: Compiler, name: str) -> None:
    assert RESIZED[name] != APPROX_TEXT
    program = compiler.decode(RESIZED[name].encode(), "stablehlo")
    with pytest.raises(CompileFailed):
        compiler.lookup(program)
