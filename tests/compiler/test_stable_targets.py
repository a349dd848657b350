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

from jitserve.compiler import Aval, CompileFailed, Compiler, CompilerError

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


# What jax 0.8 and 0.9 (the oldest clients the SDK supports) export for lax.top_k,
# and for the chlo ops below.
OLDER_TOPK = """module @jit_f {
  func.func public @main(%arg0: tensor<5xf32>) -> (tensor<2xf32>, tensor<2xi32>) {
    %0:2 = stablehlo.custom_call @mhlo.topk(%arg0)
        {mhlo.attributes = {k = 2 : i64}, mhlo.version = 1 : i64}
        : (tensor<5xf32>) -> (tensor<2xf32>, tensor<2xi32>)
    return %0#0, %0#1 : tensor<2xf32>, tensor<2xi32>
  }
}"""


def test_older_jaxs_top_k_runs(compiler: Compiler) -> None:
    x = np.array([3, 1, 4, 1, 5], np.float32)
    lookup = compiler.lookup(compiler.decode(OLDER_TOPK.encode(), "stablehlo"))
    values, indices = lookup.executable.run([jax.device_put(x, compiler.device)])
    np.testing.assert_array_equal(np.asarray(values), [5, 4])
    np.testing.assert_array_equal(np.asarray(indices), [4, 2])


@pytest.mark.parametrize("old, new", [
    ("tensor<2xf32>, tensor<2xi32>", "tensor<99xf32>, tensor<99xi32>"),  # results bigger
    ("k = 2", "k = 1000"),  # k past the operand
    ("k = 2", "k = 1"),  # k and the result types disagree
    ("k = 2", "k = -1"),
])
def test_a_resized_older_top_k_is_refused(compiler: Compiler, old: str, new: str) -> None:
    text = OLDER_TOPK.replace(old, new)
    assert text != OLDER_TOPK
    program = compiler.decode(text.encode(), "stablehlo")
    with pytest.raises(CompilerError):
        compiler.lookup(program)


OLDER_UNARY = """module @jit_f {
  func.func public @main(%arg0: tensor<5xf32>) -> (tensor<R>) {
    %0 = stablehlo.custom_call @TARGET(%arg0) {mhlo.attributes = {}, mhlo.version = 1 : i64}
        : (tensor<5xf32>) -> tensor<R>
    return %0 : tensor<R>
  }
}"""
OLDER_UNARY_TARGETS = {"mhlo.erf": lax.erf, "mhlo.acos": np.arccos, "mhlo.acosh": np.arccosh,
                       "mhlo.asin": np.arcsin, "mhlo.asinh": np.arcsinh, "mhlo.atanh": np.arctanh,
                       "mhlo.cosh": np.cosh, "mhlo.sinh": np.sinh}


@pytest.mark.parametrize("target", sorted(OLDER_UNARY_TARGETS))
def test_older_jaxs_unary_targets_run_and_refuse_other_types(compiler: Compiler,
                                                              target: str) -> None:
    x = np.linspace(0.1, 0.9, 5).astype(np.float32)
    text = OLDER_UNARY.replace("TARGET", target)
    lookup = compiler.lookup(compiler.decode(text.replace("R", "5xf32").encode(), "stablehlo"))
    (got,) = lookup.executable.run([jax.device_put(x, compiler.device)])
    with np.errstate(invalid="ignore"):  # arccosh is nan below 1, as on the server
        want = np.asarray(OLDER_UNARY_TARGETS[target](x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, equal_nan=True)
    for result in ("50xf32", "5xf64"):
        with pytest.raises(CompilerError):
            compiler.lookup(compiler.decode(text.replace("R", result).encode(), "stablehlo"))
