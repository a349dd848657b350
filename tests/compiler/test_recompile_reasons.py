"""Why a compile happened: the key parts that differ from the program's nearest earlier key."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jitserve.compiler import Compiler
from jitserve.compiler.keys import KeyHistory, nearest_reasons, recompile_reasons
from jitserve.wire import Aval

pytestmark = pytest.mark.timeout(300)

BASE = {"schema": "2", "program": "p" * 64, "in_avals": "float32[8]", "static": "",
        "compile_options": "a" * 64, "platform": "cpu 0", "jax": "0.10.2", "jaxlib": "0.10.2",
        "xla_flags": ""}


@pytest.mark.parametrize(("change", "expected"), [
    ({"in_avals": "float32[16]"}, ["shape: arg 0 float32[8] -> float32[16]"]),
    ({"in_avals": "int32[8]"}, ["dtype: arg 0 float32[8] -> int32[8]"]),
    ({"in_avals": "float32[8]~weak"}, ["weak_type: arg 0 float32[8] -> float32[8]~weak"]),
    ({"in_avals": "float32[8];float32[2]"}, ["shape: 1 -> 2 inputs"]),
    ({"static": "[3]"}, ["static: static '' -> '[3]'"]),
    ({"donate": "0"}, ["donate: donate '' -> '0'"]),
    ({"compiler_options": "xla_cpu_enable_fast_math=true"},
     ["flags: compiler_options '' -> 'xla_cpu_enable_fast_math=true'"]),
    ({"xla_flags": "--xla_cpu_fast_math=true"},
     ["flags: xla_flags '' -> '--xla_cpu_fast_math=true'"]),
    ({"compile_options": "b" * 64}, [f"flags: compile_options {'a' * 12} -> {'b' * 12}"]),
    ({"jax": "0.10.3", "jaxlib": "0.10.3"},
     ["versions: jax '0.10.2' -> '0.10.3'", "versions: jaxlib '0.10.2' -> '0.10.3'"]),
])
def test_each_kind_of_part_is_named(change: dict[str, str], expected: list[str]) -> None:
    assert recompile_reasons(BASE, {**BASE, **change}) == expected


def test_the_nearest_previous_key_explains() -> None:
    far = {**BASE, "in_avals": "int32[4]", "static": "x"}
    near = {**BASE, "in_avals": "float32[4]"}
    current = {**BASE, "in_avals": "float32[16]"}
    assert nearest_reasons([far, near], current) == ["shape: arg 0 float32[4] -> float32[16]"]
    assert nearest_reasons([], current) is None


def test_history_is_bounded_and_forgets() -> None:
    history = KeyHistory(max_programs=2, per_program=2)
    for i in range(3):
        history.record("a", f"k{i}", {"i": str(i)})
    assert list(history.previous("a")) == ["k1", "k2"]
    assert list(history.previous("a", but="k2")) == ["k1"]
    history.forget("k1")
    assert list(history.previous("a")) == ["k2"]
    history.record("b", "x", {})
    history.record("c", "y", {})
    assert history.previous("a") == {}


def _polymorphic(compiler: Compiler):  # noqa: ANN202
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b,), np.float32)
    exported = jax.export.export(jax.jit(lambda x: jnp.sin(x) * 2))(spec)
    return compiler.decode(bytes(exported.serialize()))


def test_a_compile_says_why_and_keeps_the_analyses(make_compiler, tmp_path: Path) -> None:  # noqa: ANN001
    compiler = make_compiler(tmp_path / "cache")
    program = _polymorphic(compiler)
    first = compiler.lookup(program, [Aval((8,), "float32")])
    assert first.tier == "compiled" and first.executable.meta["recompiled_because"] is None
    parts = first.executable.meta["key_parts"]
    assert parts["program"] == program.program_id and parts["in_avals"] == "float32[8]"
    assert {"flops", "bytes_accessed"} <= set(first.executable.meta["cost"])
    assert first.executable.meta["memory"]["argument_bytes"] == 32
    second = compiler.lookup(program, [Aval((16,), "float32")], static_key="s")
    assert second.tier == "compiled"
    assert second.executable.meta["recompiled_because"] == [
        "shape: arg 0 float32[8] -> float32[16]", "static: static '' -> 's'"]
    # Deleted from every tier: the next lookup compiles again.
    assert set(compiler.forget(second.executable_id)) == {"memory", "disk"}
    assert compiler.forget(second.executable_id) == []
    again = compiler.lookup(program, [Aval((16,), "float32")], static_key="s")
    assert again.tier == "compiled"
    # A second process on the same disk reads the reasons from the entry.
    other = make_compiler(tmp_path / "cache")
    loaded = other.lookup(program, [Aval((16,), "float32")], static_key="s")
    assert loaded.tier == "disk"
    assert loaded.executable.meta["recompiled_because"] == [
        "shape: arg 0 float32[8] -> float32[16]", "static: static '' -> 's'"]


def test_redis_keeps_the_history_and_the_record(make_compiler, tmp_path: Path,  # noqa: ANN001
                                                redis_url: str, redis_prefix: str) -> None:
    import redis

    from jitserve.compiler import RedisSettings
    from jitserve.compiler.cache import CacheSecret
    from jitserve.compiler.redis import LAYOUT_VERSION

    secret = CacheSecret.from_value("recompile-test-cache-secret-" + "4d1f" * 8)
    settings = RedisSettings.from_url(redis_url, prefix=redis_prefix)
    a = make_compiler(None, cache_secret=secret, redis=settings)
    b = make_compiler(None, cache_secret=secret, redis=settings)
    program = _polymorphic(a)
    first = a.lookup(program, [Aval((4,), "float32")])
    # Another process, which never saw the first key, still explains its compile.
    second = b.lookup(b.decode(program.payload), [Aval((12,), "float32")])
    assert second.tier == "compiled"
    assert second.executable.meta["recompiled_because"] == ["shape: arg 0 float32[4] -> float32[12]"]
    record = b.catalog.describe(second.executable_id)
    assert record is not None and record["source"] == "redis"
    assert record["recompiled_because"] == ["shape: arg 0 float32[4] -> float32[12]"]
    assert record["key_parts"]["in_avals"] == "float32[12]"
    assert record["cost"]["flops"] > 0 and record["memory"]["argument_bytes"] == 48
    raw = redis.Redis.from_url(redis_url)
    history = f"jitserve:v{LAYOUT_VERSION}:{redis_prefix}:keys:{program.program_id}"
    assert {k.decode() for k in raw.hkeys(history)} == {first.executable_id,
                                                        second.executable_id}
    assert set(b.forget(second.executable_id)) == {"memory", "redis"}
    assert b.catalog.describe(second.executable_id) is None
    assert {k.decode() for k in raw.hkeys(history)} == {first.executable_id}
    raw.close()


def test_compiler_options_key_their_own_executable(make_compiler, tmp_path: Path) -> None:  # noqa: ANN001
    """A caller's XLA options (``jax.jit``'s ``compiler_options``) reach XLA, key their
    own executable (kept on disk with them) and are checked against the allowlist."""
    from jitserve.compiler.errors import InvalidProgram

    compiler = make_compiler(tmp_path / "cache")
    exported = jax.export.export(jax.jit(lambda x: x - x))(jax.ShapeDtypeStruct((2,), np.float32))
    program = compiler.decode(bytes(exported.serialize()))
    fast = {"xla_cpu_fast_math_honor_infs": False, "xla_cpu_enable_fast_math": True,
            "xla_cpu_fast_math_honor_nans": False}
    plain = compiler.lookup(program)
    chosen = compiler.lookup(program, overrides=fast)
    assert chosen.tier == "compiled" and chosen.executable_id != plain.executable_id
    assert chosen.executable.meta["compiler_options"] == fast
    (reason,) = chosen.executable.meta["recompiled_because"]  # long values are cut at 80
    assert reason.startswith("flags: compiler_options '' -> 'xla_cpu_enable_fast_math=true;"
                             "xla_cpu_fast_math_honor_infs=false;")
    # The same options in another order are the same executable.
    assert compiler.executable_id(program, overrides=dict(reversed(fast.items()))) == \
        chosen.executable_id
    assert compiler.lookup(program, overrides={**fast}).tier == "memory"
    inf = jnp.full((2,), np.inf, np.float32)
    assert np.isnan(np.asarray(plain.executable.run([inf])[0])).all()
    np.testing.assert_array_equal(np.asarray(chosen.executable.run([inf])[0]), [0, 0])
    loaded = make_compiler(tmp_path / "cache").lookup(program, overrides=fast)
    assert loaded.tier == "disk" and loaded.executable_id == chosen.executable_id
    np.testing.assert_array_equal(np.asarray(loaded.executable.run([inf])[0]), [0, 0])
    with pytest.raises(InvalidProgram, match="compile option 'xla_dump_to' is not allowed"):
        compiler.lookup(program, overrides={"xla_dump_to": "/tmp"})
    with pytest.raises(InvalidProgram, match="must be a bool, a number or a string"):
        compiler.lookup(program, overrides={"xla_cpu_ftz": None})
