"""Programs with dynamic dimensions: one executable per concrete shape, checked inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jitserve.compiler import Aval, Compiler, CompilerError, Program, SignatureMismatch

pytestmark = pytest.mark.timeout(120)

BATCHES = (1, 5, 17)


def batch_fn(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Uses the batch size as data too, so a wrong specialization shows in the numbers."""
    return jnp.sin(x) * 2.0 + x.sum(axis=0), x.shape[0] * jnp.mean(x, axis=0)


def pair_fn(x: jax.Array, y: jax.Array) -> jax.Array:
    return x @ y + x.shape[1]


# A raw module a non-jax frontend could send: `?` dims and nothing jax-specific.
HAND_WRITTEN = """
func.func public @main(%arg0: tensor<?x3xf32>, %arg1: tensor<3xf32>) -> tensor<?x3xf32> {
  %0 = stablehlo.multiply %arg0, %arg0 : tensor<?x3xf32>
  %1 = stablehlo.get_dimension_size %arg0, dim = 0 : (tensor<?x3xf32>) -> tensor<i32>
  %2 = stablehlo.reshape %1 : (tensor<i32>) -> tensor<1xi32>
  %3 = stablehlo.constant dense<3> : tensor<1xi32>
  %4 = stablehlo.concatenate %2, %3, dim = 0 : (tensor<1xi32>, tensor<1xi32>) -> tensor<2xi32>
  %5 = stablehlo.dynamic_broadcast_in_dim %arg1, %4, dims = [1]
      : (tensor<3xf32>, tensor<2xi32>) -> tensor<?x3xf32>
  %6 = stablehlo.add %0, %5 : tensor<?x3xf32>
  return %6 : tensor<?x3xf32>
}
"""


def hand_written_fn(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return x * x + y


def _batch(n: int, width: int = 4, dtype: type = np.float32) -> np.ndarray:
    """Deterministic inputs for batch size ``n``."""
    return np.random.default_rng(n).standard_normal((n, width)).astype(dtype)


def _poly_export(fn, *shapes: str, dtype=jnp.float32) -> jax.export.Exported:
    """Export ``fn`` with one symbolic-shape spec per argument (shared symbols)."""
    scope = jax.export.SymbolicScope()
    specs = [jax.ShapeDtypeStruct(jax.export.symbolic_shape(s, scope=scope), dtype) for s in shapes]
    return jax.export.export(jax.jit(fn))(*specs)


@pytest.fixture(scope="module")
def batch_export() -> jax.export.Exported:
    return _poly_export(batch_fn, "b, 4")


@pytest.fixture(scope="module")
def batch_program(compiler: Compiler, batch_export: jax.export.Exported) -> Program:
    return compiler.decode(bytes(batch_export.serialize()), "jax_export")


def _run(compiler: Compiler, program: Program, *args: np.ndarray) -> tuple[str, list[np.ndarray]]:
    """Look up ``program`` for ``args``' avals and run it; (executable_id, outputs)."""
    lookup = compiler.lookup(program, [Aval.of(a) for a in args])
    outs = lookup.executable.run([jax.device_put(a, compiler.device) for a in args])
    return lookup.executable_id, [np.asarray(o) for o in outs]


def _assert_close(got: list[np.ndarray], want) -> None:
    want = [np.asarray(w) for w in jax.tree_util.tree_leaves(want)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_symbolic_dims_are_read(batch_program: Program) -> None:
    assert [a.shape for a in batch_program.in_avals] == [("b", 4)]
    assert not batch_program.is_static


@pytest.mark.parametrize("n", BATCHES)
def test_symbolic_batch_runs_at_each_size(compiler: Compiler, batch_program: Program, n: int) -> None:
    x = _batch(n)
    _, outs = _run(compiler, batch_program, x)
    _assert_close(outs, jax.jit(batch_fn)(x))


def test_each_size_is_its_own_executable(compiler: Compiler, batch_program: Program) -> None:
    ids = [_run(compiler, batch_program, _batch(n))[0] for n in BATCHES]
    assert len(set(ids)) == len(BATCHES)
    again = compiler.lookup(batch_program, [Aval.of(_batch(5))])
    assert again.tier == "memory" and again.executable_id == ids[1]
    assert again.executable.in_avals == (Aval((5, 4), "float32"),)


def test_shared_symbols_across_inputs(compiler: Compiler) -> None:
    program = compiler.decode(bytes(_poly_export(pair_fn, "b, n", "n, 2").serialize()))
    x, y = _batch(3, 5), _batch(5, 2)
    _, outs = _run(compiler, program, x, y)
    _assert_close(outs, jax.jit(pair_fn)(x, y))
    with pytest.raises(SignatureMismatch):
        compiler.lookup(program, [Aval((3, 5), "float32"), Aval((4, 2), "float32")])


def _raw_from_export(batch_export: jax.export.Exported) -> bytes:
    """The polymorphic export's module as raw StableHLO text (`?` dims, shape assertions)."""
    return str(batch_export.mlir_module()).encode()


@pytest.mark.parametrize("source", ["export_text", "hand_written"])
def test_raw_stablehlo_with_dynamic_dims(compiler: Compiler, batch_export: jax.export.Exported,
                                         source: str) -> None:
    data = _raw_from_export(batch_export) if source == "export_text" else HAND_WRITTEN.encode()
    program = compiler.decode(data, "stablehlo")
    assert program.in_avals[0].shape[0] is None and program.is_static is False
    ids = set()
    for n in (2, 9):
        if source == "export_text":
            x = _batch(n)
            exe_id, outs = _run(compiler, program, x)
            _assert_close(outs, jax.jit(batch_fn)(x))
        else:
            x, y = _batch(n, 3), _batch(1, 3)[0]
            exe_id, outs = _run(compiler, program, x, y)
            _assert_close(outs, hand_written_fn(x, y))
        ids.add(exe_id)
    assert len(ids) == 2


def test_dynamic_program_needs_concrete_avals(compiler: Compiler, batch_program: Program) -> None:
    with pytest.raises(SignatureMismatch, match="dynamic"):
        compiler.lookup(batch_program)


WRONG_INPUTS = {
    "dtype": [Aval((5, 4), "float64")],
    "rank": [Aval((5, 4, 1), "float32")],
    "static_dim": [Aval((5, 3), "float32")],
    "count": [Aval((5, 4), "float32"), Aval((5, 4), "float32")],
    "dynamic_given": [Aval((None, 4), "float32")],
    "shape_assertion_b_ge_1": [Aval((0, 4), "float32")],
}


@pytest.mark.parametrize("wrong", list(WRONG_INPUTS))
def test_wrong_inputs_for_export(compiler: Compiler, batch_program: Program, wrong: str) -> None:
    with pytest.raises(SignatureMismatch):
        compiler.lookup(batch_program, WRONG_INPUTS[wrong])


@pytest.mark.parametrize("wrong", ["dtype", "rank", "static_dim", "count", "dynamic_given"])
def test_wrong_inputs_for_raw_stablehlo(compiler: Compiler, batch_export: jax.export.Exported,
                                        wrong: str) -> None:
    program = compiler.decode(_raw_from_export(batch_export), "stablehlo")
    with pytest.raises(SignatureMismatch):
        compiler.lookup(program, WRONG_INPUTS[wrong])


def test_wrong_inputs_for_static_program(compiler: Compiler) -> None:
    exp = jax.export.export(jax.jit(jnp.sin))(jax.ShapeDtypeStruct((3,), jnp.float32))
    program = compiler.decode(bytes(exp.serialize()))
    for avals in ([Aval((4,), "float32")], [Aval((3,), "int32")], []):
        with pytest.raises(SignatureMismatch) as info:
            compiler.lookup(program, avals)
        assert isinstance(info.value, CompilerError) and str(info.value)
