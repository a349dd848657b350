"""Hostile and broken programs are refused with the right error, and the compiler survives.

Every refusal is a ``CompilerError`` subclass whose message names the problem.
The last test checks that a normal program still compiles and runs on the same
``Compiler`` afterwards. Inputs that could crash the process that parses them
(deeply nested text, mis-sized kernel buffers) are only ever decoded in a
subprocess or never run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jitserve.client.jaxpr import encode_function
from jitserve.compiler import (
    Aval,
    Compiler,
    CompilerError,
    InvalidProgram,
    LimitExceeded,
    Limits,
    PlatformMismatch,
    UnsafeProgram,
)
from jitserve.compiler.jaxpr import JaxprLimits

pytestmark = pytest.mark.timeout(120)

F32_4 = jax.ShapeDtypeStruct((4,), jnp.float32)


def _export(fn: Callable, *specs: jax.ShapeDtypeStruct, **kwargs) -> bytes:
    return bytes(jax.export.export(jax.jit(fn), **kwargs)(*specs).serialize())


def _text(fn: Callable, *specs: jax.ShapeDtypeStruct) -> bytes:
    return jax.jit(fn, keep_unused=True).lower(*specs).as_text().encode()


def _main(signature: str, body: str) -> bytes:
    """A hand-written module: ``func.func public @main<signature> { body }``."""
    return f"func.func public @main{signature} {{\n{textwrap.dedent(body)}\n}}\n".encode()


def _refused(c: Compiler, data: bytes, fmt: str | None,
             in_avals: list[Aval] | None = None) -> CompilerError:
    """Decode and look up ``data``; the ``CompilerError`` that one of them must raise."""
    with pytest.raises(CompilerError) as info:
        program = c.decode(data, fmt)
        c.lookup(program, in_avals)
    return info.value


def _assert_refused(error: CompilerError, kind: type[CompilerError], *words: str) -> None:
    assert isinstance(error, kind), f"expected {kind.__name__}, got {type(error).__name__}: {error}"
    for word in words:
        assert word.lower() in str(error).lower(), f"{word!r} not in the message: {error}"


# --------------------------------------------------------------------------- unreadable bytes


def _small_export() -> bytes:
    return _export(lambda x: jnp.sin(x) * 2, F32_4)


UNREADABLE: dict[str, Callable[[], tuple[bytes, str | None]]] = {
    "random_bytes": lambda: (np.random.default_rng(0).bytes(512), None),
    "random_bytes_as_export": lambda: (np.random.default_rng(1).bytes(512), "jax_export"),
    "random_bytes_as_stablehlo": lambda: (np.random.default_rng(2).bytes(512), "stablehlo"),
    "empty": lambda: (b"", None),
    "export_first_half": lambda: (_small_export()[: len(_small_export()) // 2], "jax_export"),
    "export_first_32_bytes": lambda: (_small_export()[:32], None),
    "export_last_half": lambda: (_small_export()[len(_small_export()) // 2:], "jax_export"),
    "not_mlir_text": lambda: (b"this is not MLIR, just some text\n", "stablehlo"),
    "unterminated_module": lambda: (b"module @m {\n  func.func public @main(", "stablehlo"),
    "bytecode_magic_then_garbage": lambda: (b"ML\xefR" + np.random.default_rng(3).bytes(256), "stablehlo"),
    "vhlo_header_then_garbage": lambda: (
        bytes(jax.export.export(jax.jit(jnp.sin))(F32_4).mlir_module_serialized)[:40]
        + np.random.default_rng(4).bytes(256), "stablehlo"),
    "no_main": lambda: (b"func.func public @other(%a: tensor<f32>) -> tensor<f32> {\n"
                        b"  return %a : tensor<f32>\n}\n", "stablehlo"),
    "token_input": lambda: (_main("(%t: !stablehlo.token) -> !stablehlo.token",
                                  "return %t : !stablehlo.token"), "stablehlo"),
    "undefined_callee": lambda: (_main("(%a: tensor<f32>) -> tensor<f32>", """
        %0 = func.call @nowhere(%a) : (tensor<f32>) -> tensor<f32>
        return %0 : tensor<f32>"""), "stablehlo"),
}


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_unreadable_program(compiler: Compiler, name: str) -> None:
    data, fmt = UNREADABLE[name]()
    _assert_refused(_refused(compiler, data, fmt), InvalidProgram)


def test_unknown_format_name(compiler: Compiler) -> None:
    _assert_refused(_refused(compiler, _small_export(), "pickle"), InvalidProgram, "pickle")


# --------------------------------------------------------------------------- unsafe programs


def _pure_callback(x: jax.Array) -> jax.Array:
    return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _debug_print(x: jax.Array) -> jax.Array:
    jax.debug.print("x = {x}", x=x)
    return x * 2


def _custom_call(target: str) -> bytes:
    return _main("(%arg0: tensor<4xf32>) -> tensor<4xf32>", f"""
        %0 = stablehlo.custom_call @{target}(%arg0) {{api_version = 4 : i32}}
            : (tensor<4xf32>) -> tensor<4xf32>
        return %0 : tensor<4xf32>""")


OUTFEED = _main("(%arg0: tensor<4xf32>) -> tensor<4xf32>", """
    %t = stablehlo.create_token : !stablehlo.token
    %0 = "stablehlo.outfeed"(%arg0, %t) {outfeed_config = ""}
        : (tensor<4xf32>, !stablehlo.token) -> !stablehlo.token
    return %arg0 : tensor<4xf32>""")

INFEED = _main("(%arg0: tensor<4xf32>) -> tensor<4xf32>", """
    %t = stablehlo.create_token : !stablehlo.token
    %0:2 = "stablehlo.infeed"(%t) {infeed_config = ""}
        : (!stablehlo.token) -> (tensor<4xf32>, !stablehlo.token)
    %1 = stablehlo.add %arg0, %0#0 : tensor<4xf32>
    return %1 : tensor<4xf32>""")

# An allowlisted LAPACK kernel whose pivot buffer is 1 element for a 64x64 matrix:
# run, getrf writes 64 pivots into it (a heap overflow in the process that runs it).
MIS_SIZED_LAPACK = _main("(%arg0: tensor<64x64xf32>) -> tensor<1xi32>", """
    %0:3 = stablehlo.custom_call @lapack_sgetrf_ffi(%arg0) {
        mhlo.backend_config = {}, api_version = 4 : i32,
        operand_layouts = [dense<[0, 1]> : tensor<2xindex>],
        output_operand_aliases = [#stablehlo.output_operand_alias<
            output_tuple_indices = [0], operand_index = 0, operand_tuple_indices = []>],
        result_layouts = [dense<[0, 1]> : tensor<2xindex>, dense<0> : tensor<1xindex>,
                          dense<> : tensor<0xindex>]}
        : (tensor<64x64xf32>) -> (tensor<64x64xf32>, tensor<1xi32>, tensor<i32>)
    return %0#1 : tensor<1xi32>""")

UNSAFE: dict[str, Callable[[], tuple[bytes, tuple[str, ...]]]] = {
    "pure_callback": lambda: (_text(_pure_callback, F32_4), ("xla_ffi_python_cpu_callback",)),
    "debug_print": lambda: (_text(_debug_print, F32_4), ("xla_ffi_python_cpu_callback",)),
    "evil_target": lambda: (_custom_call("evil_target"), ("evil_target",)),
    "legacy_python_callback": lambda: (_custom_call("xla_python_cpu_callback"),
                                       ("xla_python_cpu_callback",)),
    "gpu_python_callback": lambda: (_custom_call("xla_ffi_python_gpu_callback"),
                                    ("xla_ffi_python_gpu_callback",)),
    "pallas_tpu_kernel": lambda: (_custom_call("tpu_custom_call"), ("tpu_custom_call",)),
    "triton_kernel": lambda: (_custom_call("__gpu$xla.gpu.triton"), ("triton",)),
    "outfeed": lambda: (OUTFEED, ("outfeed",)),
    "infeed": lambda: (INFEED, ("infeed",)),
}


@pytest.mark.parametrize("name", list(UNSAFE))
def test_unsafe_program(compiler: Compiler, name: str) -> None:
    data, words = UNSAFE[name]()
    _assert_refused(_refused(compiler, data, "stablehlo"), UnsafeProgram, *words)


def test_mis_sized_kernel_buffers_are_refused(compiler: Compiler) -> None:
    # Never run: accepting it would already be the bug.
    error = _refused(compiler, MIS_SIZED_LAPACK, "stablehlo")
    _assert_refused(error, CompilerError, "lapack_sgetrf_ffi")


# --------------------------------------------------------------------------- platforms


@pytest.mark.parametrize("platforms", [["tpu"], ["tpu", "cuda"], ["rocm"]])
def test_export_for_other_platforms(compiler: Compiler, platforms: list[str]) -> None:
    data = _export(jnp.sin, F32_4, platforms=platforms)
    error = _refused(compiler, data, None)
    _assert_refused(error, PlatformMismatch, platforms[0], compiler.platform)


# --------------------------------------------------------------------------- limits

TERABYTES = _main("(%arg0: tensor<f32>) -> tensor<f32>", """
    %0 = stablehlo.broadcast_in_dim %arg0, dims = [] : (tensor<f32>) -> tensor<1000000x1000000x1000xf32>
    %1 = stablehlo.reduce(%0 init: %arg0) applies stablehlo.add across dimensions = [0, 1, 2]
        : (tensor<1000000x1000000x1000xf32>, tensor<f32>) -> tensor<f32>
    return %1 : tensor<f32>""")

TERABYTE_INPUT = _main("(%arg0: tensor<1000000x1000000xf32>) -> tensor<1000000x1000000xf32>",
                       "return %arg0 : tensor<1000000x1000000xf32>")

# Small until its dynamic dim is known: each row is 4 GB.
DYNAMIC_BLOWUP = _main("(%arg0: tensor<?xf32>) -> tensor<f32>", """
    %c = stablehlo.constant dense<1000000000> : tensor<1xi32>
    %0 = stablehlo.get_dimension_size %arg0, dim = 0 : (tensor<?xf32>) -> tensor<i32>
    %1 = stablehlo.reshape %0 : (tensor<i32>) -> tensor<1xi32>
    %2 = stablehlo.concatenate %1, %c, dim = 0 : (tensor<1xi32>, tensor<1xi32>) -> tensor<2xi32>
    %3 = stablehlo.dynamic_broadcast_in_dim %arg0, %2, dims = [0]
        : (tensor<?xf32>, tensor<2xi32>) -> tensor<?x1000000000xf32>
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %4 = stablehlo.reduce(%3 init: %z) applies stablehlo.add across dimensions = [0, 1]
        : (tensor<?x1000000000xf32>, tensor<f32>) -> tensor<f32>
    return %4 : tensor<f32>""")


@pytest.mark.parametrize("data", [TERABYTES, TERABYTE_INPUT], ids=["intermediate", "input"])
def test_terabyte_tensors(compiler: Compiler, data: bytes) -> None:
    _assert_refused(_refused(compiler, data, "stablehlo"), LimitExceeded, "1000000x1000000")


def test_terabytes_once_dynamic_dims_are_known(compiler: Compiler) -> None:
    program = compiler.decode(DYNAMIC_BLOWUP, "stablehlo")
    error = _refused(compiler, DYNAMIC_BLOWUP, "stablehlo", [Aval((100,), "float32")])
    _assert_refused(error, LimitExceeded, "bytes")
    with pytest.raises(LimitExceeded):  # a concrete input that is itself too big
        compiler.lookup(program, [Aval((10**12,), "float32")])


def _mlp(x: jax.Array, w: jax.Array) -> jax.Array:
    for _ in range(6):
        x = jnp.tanh(x @ w + 1.0)
    return x


def _nested(x: jax.Array) -> jax.Array:
    """Five while loops, each in the body of the one before."""
    def level(depth: int) -> Callable[[int, jax.Array], jax.Array]:
        if depth == 0:
            return lambda i, v: v * 1.5 + i
        return lambda i, v: jax.lax.fori_loop(0, 2, level(depth - 1), v)

    return jax.lax.fori_loop(0, 2, level(4), x)


MAT = jax.ShapeDtypeStruct((4, 4), jnp.float32)
LIMITED: dict[str, tuple[Limits, Callable[[], bytes], tuple[str, ...]]] = {
    "ops": (Limits(max_ops=20), lambda: _text(_mlp, MAT, MAT), ("ops", "20")),
    "ops_export": (Limits(max_ops=20), lambda: _export(_mlp, MAT, MAT), ("ops", "20")),
    "nesting": (Limits(max_nesting=3), lambda: _text(_nested, F32_4), ("nest", "3")),
    "nesting_export": (Limits(max_nesting=3), lambda: _export(_nested, F32_4), ("nest", "3")),
    "tensor_bytes": (Limits(max_tensor_bytes=1000), lambda: _text(jnp.sin, MAT.update(shape=(16, 16))),
                     ("16x16", "bytes")),
    "program_bytes": (Limits(max_program_bytes=100), lambda: _text(jnp.sin, F32_4),
                      ("limit of 100", "JITSERVE_MAX_PROGRAM_BYTES", "closes over")),
    "inputs": (Limits(max_inputs=3), lambda: _text(lambda *xs: sum(xs), *[F32_4] * 5), ("inputs", "3")),
    "jaxpr_eqns": (Limits(jaxpr=JaxprLimits(max_eqns=2)), lambda: encode_function(_mlp, MAT, MAT),
                   ("eqn 2", "more than 2 equations")),
}


@pytest.mark.parametrize("name", list(LIMITED))
def test_limits(make_compiler: Callable[..., Compiler], name: str) -> None:
    limits, make, words = LIMITED[name]
    c = make_compiler(limits=limits)
    _assert_refused(_refused(c, make(), None), LimitExceeded, *words)


def test_a_module_over_the_program_bytes_is_refused_as_it_is_parsed() -> None:
    """The IFRT proxy's compiles parse StableHLO themselves (``parse_module``)."""
    from jitserve.compiler import stablehlo

    with pytest.raises(LimitExceeded, match=r"over the limit of 100 \(JITSERVE_MAX_PROGRAM_BYTES"):
        stablehlo.parse_module(_text(jnp.sin, F32_4), stablehlo.new_context(),
                               Limits(max_program_bytes=100))


def test_jaxpr_limits_come_from_the_compiler_limits(make_compiler: Callable[..., Compiler]) -> None:
    """The decoder runs with ``Limits.jaxpr``, not with defaults of its own."""
    doc = encode_function(_mlp, MAT, MAT)
    error = _refused(make_compiler(limits=Limits(jaxpr=JaxprLimits(max_eqns=2))), doc, "jaxpr")
    assert isinstance(error, LimitExceeded) and error.code == "limit_exceeded", error
    make_compiler().decode(doc, "jaxpr")  # the default limits take it


def test_limits_leave_normal_programs_alone(make_compiler: Callable[..., Compiler]) -> None:
    c = make_compiler(limits=Limits(max_ops=100, max_nesting=8))
    program = c.decode(_text(_nested, F32_4), "stablehlo")
    (out,) = c.lookup(program).executable.run([jax.device_put(np.ones(4, np.float32), c.device)])
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(_nested)(np.ones(4, np.float32))))


# --------------------------------------------------------------------------- parser bombs

# Decodes each bomb in a forked child of one subprocess (jax is imported once), so a
# crash shows as that child's signal and the other bombs still get their turn.
_BOMB_SCRIPT = """
import os, sys
from jitserve.compiler import CompilerError, Limits
from jitserve.compiler.programs import decode_program
n = 200_000
bombs = {
    "braces": "module {" * n,
    "brackets": "func.func public @main() -> tensor<f32> { %0 = stablehlo.constant dense<"
                + "[" * n + "1.0" + "]" * n + "> : tensor<f32> return %0 : tensor<f32> }",
    "parens": "func.func public @main() -> " + "(" * n + "tensor<f32>" + ")" * n + " {}",
    "angles": "func.func public @main(%a: " + "tensor<" * n + "f32" + ">" * n + ") { return }",
    "locations": "func.func public @main() { return } loc(" + "callsite(" * n + '"a"'
                 + ' at "b")' * n + ")",
}
for name in sys.argv[1:]:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            decode_program(bombs[name].encode(), "stablehlo", platform="cpu", limits=Limits())
            result = "accepted"
        except CompilerError as e:
            result = type(e).__name__
        print(name, result, flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        print(name, f"crashed (wait status {status})", flush=True)
"""

BOMBS = ["braces", "brackets", "parens", "angles", "locations"]


def test_deeply_nested_text_is_refused_without_crashing() -> None:
    """Nesting 200,000 deep overflows a recursive parser's stack: it must be refused first.

    Decoded in a subprocess, so that a crash fails this test instead of killing pytest.
    """
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _BOMB_SCRIPT, *BOMBS], cwd=root, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    results = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line)
    assert results == {bomb: "LimitExceeded" for bomb in BOMBS}


# --------------------------------------------------------------------------- still healthy


def test_still_healthy_after_all_that(compiler: Compiler) -> None:
    x = np.linspace(-1, 1, 4, dtype=np.float32)
    for data in (_small_export(), _text(lambda v: jnp.sin(v) * 2, F32_4)):
        lookup = compiler.lookup(compiler.decode(data))
        (out,) = lookup.executable.run([jax.device_put(x, compiler.device)])
        np.testing.assert_allclose(np.asarray(out), np.sin(x) * 2, rtol=1e-6)
