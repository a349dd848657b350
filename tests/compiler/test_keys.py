"""The cache key: named parts, computed as jax computes its own key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src import compiler as jax_compiler

from jitserve.compiler import Compiler
from jitserve.compiler.keys import KEY_SCHEMA_VERSION, Backend, key_parts, options_digest, xla_flags
from jitserve.wire import Aval

BACKEND = Backend(platform="cpu", platform_version="cpu", runtime_type="pjrt_ifrt",
                  device_kind="cpu", device_count=1, options_digest="0" * 64)


def test_parts_are_named_and_in_a_fixed_order() -> None:
    parts = key_parts(program_id="p" * 64, in_avals=[Aval((2,), "float32", True)],
                      static_key="[3]", backend=BACKEND)
    assert [name for name, _ in parts] == [
        "schema", "program", "in_avals", "static", "compile_options", "platform",
        "runtime_type", "device_kind", "device_count", "jax", "jaxlib", "xla_flags"]
    values = dict(parts)
    assert values["schema"] == str(KEY_SCHEMA_VERSION)
    assert values["in_avals"] == "float32[2]~weak"
    assert values["runtime_type"] == "pjrt_ifrt"


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, ""),
    ({"XLA_FLAGS": "--xla_b=1  --xla_a=2"}, "--xla_a=2 --xla_b=1"),
    ({"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_cpu_fast_math=true --xla_dump_hlo_as_text"},
     "--xla_cpu_fast_math=true"),
    ({"XLA_FLAGS": "--xla_z=1", "LIBTPU_INIT_ARGS": "--xla_tpu_a=1"}, "--xla_tpu_a=1 --xla_z=1"),
])
def test_xla_flags_are_sorted_without_dump_flags(environ: dict[str, str], expected: str) -> None:
    assert xla_flags(environ) == expected


def test_options_digest_ignores_dump_options_but_not_real_ones() -> None:
    base = jax_compiler.get_compile_options(num_replicas=1, num_partitions=1)
    dumped = jax_compiler.get_compile_options(num_replicas=1, num_partitions=1)
    dumped.executable_build_options.debug_options.xla_dump_to = "/tmp/dumps"
    assert options_digest(dumped) == options_digest(base)
    assert dumped.executable_build_options.debug_options.xla_dump_to == "/tmp/dumps"  # untouched
    other = jax_compiler.get_compile_options(num_replicas=1, num_partitions=1)
    other.executable_build_options.num_partitions = 2
    assert options_digest(other) != options_digest(base)


def test_the_key_follows_xla_flags_that_change_code(compiler: Compiler,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    exported = jax.export.export(jax.jit(jnp.sin))(jax.ShapeDtypeStruct((3,), jnp.float32))
    program = compiler.decode(bytes(exported.serialize()))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    plain = compiler.executable_id(program)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/nowhere")
    assert compiler.executable_id(program) == plain
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert compiler.executable_id(program) != plain
