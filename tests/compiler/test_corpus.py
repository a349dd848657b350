"""Every corpus program, in every format, compiles and runs exactly like ``jax.jit``."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from corpus import (
    CASES,
    CASES_BY_NAME,
    FORMATS,
    Case,
    assert_outputs_match,
    expected,
    export,
    flat_args,
    serialize,
    specs,
)

from jitserve.compiler import Aval, Compiler, Program

pytestmark = pytest.mark.timeout(120)


def _avals(arrays: list[np.ndarray]) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype name) of each array, the part of an aval the data determines."""
    return [(tuple(a.shape), a.dtype.name) for a in arrays]


def _program_avals(avals: tuple[Aval, ...] | None) -> list[tuple[tuple[int, ...], str]] | None:
    return None if avals is None else [(tuple(a.shape), a.dtype) for a in avals]


def _check_signature(program: Program, case: Case) -> None:
    """The decoded program's flat signature is the case's flat inputs and outputs."""
    assert _program_avals(program.in_avals) == _avals(flat_args(case))
    assert _program_avals(program.out_avals) == _avals(expected(case))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_corpus_matches_jax_jit(compiler: Compiler, case: Case, fmt: str) -> None:
    data, wire_format = serialize(case, fmt)
    program = compiler.decode(data, wire_format)
    assert program.format.value == wire_format
    _check_signature(program, case)
    lookup = compiler.lookup(program)
    assert [(a.shape, a.dtype) for a in lookup.executable.in_avals] == _program_avals(program.in_avals)
    outs = lookup.executable.run([jax.device_put(a, compiler.device) for a in flat_args(case)])
    assert_outputs_match(case, outs, expected(case))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["mlp_train_step", "pytrees", "scalars"])
def test_format_is_detected(compiler: Compiler, name: str, fmt: str) -> None:
    data, wire_format = serialize(CASES_BY_NAME[name], fmt)
    assert compiler.decode(data).format.value == wire_format


@pytest.mark.parametrize("fmt", FORMATS)
def test_program_id_is_a_content_hash(compiler: Compiler, fmt: str) -> None:
    data, wire_format = serialize(CASES_BY_NAME["einsum"], fmt)
    first, second = compiler.decode(data, wire_format), compiler.decode(bytes(data), wire_format)
    assert first.program_id == second.program_id
    other, _ = serialize(CASES_BY_NAME["eigh"], fmt)
    assert compiler.decode(other, wire_format).program_id != first.program_id


def test_export_keeps_pytrees(compiler: Compiler) -> None:
    case = CASES_BY_NAME["pytrees"]
    program = compiler.decode(serialize(case, "jax_export")[0], "jax_export")
    args_tree, kwargs_tree = program.in_tree["tuple"]
    assert len(args_tree["tuple"]) == 2 and kwargs_tree == {"dict": {}}
    assert set(program.out_tree["dict"]) == {"n", "nested", "sum"}
    lookup = compiler.lookup(program)
    assert lookup.executable.out_tree == program.out_tree


# Cases whose arguments are all used, so jax.export's module takes every flat leaf.
VHLO_CASES = ["mlp_train_step", "eigh", "random_key_data", "complex128_math", "integers"]


@pytest.mark.parametrize("name", VHLO_CASES)
def test_vhlo_portable_artifact(compiler: Compiler, name: str) -> None:
    case = CASES_BY_NAME[name]
    data = bytes(export(case).mlir_module_serialized)
    program = compiler.decode(data)
    assert program.format.value == "stablehlo"
    _check_signature(program, case)
    outs = compiler.lookup(program).executable.run(
        [jax.device_put(a, compiler.device) for a in flat_args(case)])
    assert_outputs_match(case, outs, expected(case))


@pytest.mark.parametrize("platforms", [["cpu", "cuda"], ["tpu", "cpu"]])
def test_multi_platform_export_runs_here(compiler: Compiler, platforms: list[str]) -> None:
    case = CASES_BY_NAME["mlp_train_step"]
    data = bytes(jax.export.export(jax.jit(case.fn), platforms=platforms)(*specs(case)).serialize())
    program = compiler.decode(data)
    assert program.platforms == tuple(platforms)
    _check_signature(program, case)
    outs = compiler.lookup(program).executable.run(
        [jax.device_put(a, compiler.device) for a in flat_args(case)])
    assert_outputs_match(case, outs, expected(case))


def test_a_run_s_outputs_are_its_device_s_arrays_that_the_next_run_takes(
        compiler: Compiler) -> None:
    """A single-device run's outputs come out of jaxlib's result handlers in one call
    (``Executable.run``): committed arrays on the executable's device, of its output
    avals whatever their dtype, which a next run takes and donates, run after run."""
    import ml_dtypes

    def step(x: jax.Array, n: jax.Array) -> tuple[jax.Array, ...]:
        return x * 2 + 1, n + 1, x > 3, x.astype(ml_dtypes.bfloat16)

    specs = (jax.ShapeDtypeStruct((5,), np.float32), jax.ShapeDtypeStruct((), np.int32))
    program = compiler.decode(bytes(jax.export.export(jax.jit(step))(*specs).serialize()))
    exe = compiler.lookup(program, donate=(0, 1)).executable
    assert exe._handlers is not None  # this jax's handlers, not the taking apart
    x, n = np.arange(5, dtype=np.float32), np.int32(0)
    args = [jax.device_put(x, compiler.device), jax.device_put(n, compiler.device)]
    for _ in range(3):
        outs = exe.run(args)
        assert [(tuple(o.shape), o.dtype.name) for o in outs] == [
            (tuple(a.shape), a.dtype) for a in exe.out_avals]
        assert all(o.committed and o.sharding.device_set == {compiler.device} for o in outs)
        np.testing.assert_array_equal(np.asarray(outs[2]), x > 3)
        np.testing.assert_array_equal(np.asarray(outs[3]), x.astype(ml_dtypes.bfloat16))
        x, n = x * 2 + 1, n + 1
        np.testing.assert_array_equal(np.asarray(outs[0]), x)
        assert int(outs[1]) == n
        args = outs[:2]
