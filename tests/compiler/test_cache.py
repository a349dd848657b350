"""The tiers: L1 (memory), L2 (disk), single-flight compiles, and cache hygiene on failure."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jitserve.compiler import Aval, CompileFailed, Compiler, CompilerConfig, CompileTimeout, Lookup, Program
from jitserve.compiler.cache import Entry, decode_entry, encode_entry

pytestmark = pytest.mark.timeout(120)

MakeCompiler = Callable[..., Compiler]


def small_fn(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.tanh(x @ y) + 1.0


X = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
Y = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)
WANT = np.asarray(jax.jit(small_fn)(X, Y))

# Valid and allowed (AllocateBuffer writes nothing sized by attributes), but given
# an operand XLA has no handler for it: it passes validation and fails to compile.
FAILS_TO_COMPILE = b"""
func.func public @main(%arg0: tensor<4xi32>) -> tensor<4xi32> {
  %0 = stablehlo.custom_call @AllocateBuffer(%arg0) : (tensor<4xi32>) -> tensor<4xi32>
  return %0 : tensor<4xi32>
}
"""

# Valid and allowed, but XLA aborts on it (a CHECK in its sharding remover): the
# compile worker dies, the caller gets CompileFailed, and the next compile works.
CRASHES_XLA = b"""
func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.custom_call @Sharding(%arg0, %arg1) {mhlo.sharding = "{replicated}"} : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""


@pytest.fixture(scope="module")
def program_bytes() -> bytes:
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (X, Y)]
    return bytes(jax.export.export(jax.jit(small_fn))(*specs).serialize())


def _lookup_and_check(c: Compiler, data: bytes) -> Lookup:
    """Look the program up in ``c``, run it, and check its answer."""
    lookup = c.lookup(c.decode(data))
    (out,) = lookup.executable.run([jax.device_put(a, c.device) for a in (X, Y)])
    np.testing.assert_allclose(np.asarray(out), WANT, rtol=1e-6)
    return lookup


def _files(root: Path) -> list[Path]:
    """Every regular file under ``root`` (entries and any temporaries)."""
    return sorted(p for p in root.rglob("*") if p.is_file())


def _entry_file(root: Path) -> Path:
    """The one L2 entry under ``root``."""
    files = _files(root)
    assert len(files) == 1, f"expected one cache entry under {root}, found {files}"
    return files[0]


def test_second_lookup_is_memory(make_compiler: MakeCompiler, tmp_path: Path,
                                 program_bytes: bytes) -> None:
    c = make_compiler(tmp_path)
    first = _lookup_and_check(c, program_bytes)
    assert first.tier == "compiled" and first.compile_seconds > 0
    assert c.stats()["compilations"] == 1
    second = _lookup_and_check(c, program_bytes)
    assert second.tier == "memory" and second.compile_seconds == 0
    assert second.executable_id == first.executable_id
    assert c.stats()["compilations"] == 1


def test_fresh_compiler_hits_disk(make_compiler: MakeCompiler, tmp_path: Path,
                                  program_bytes: bytes) -> None:
    first = _lookup_and_check(make_compiler(tmp_path), program_bytes)
    _entry_file(tmp_path)
    c = make_compiler(tmp_path)
    hit = _lookup_and_check(c, program_bytes)
    assert (hit.tier, hit.executable_id) == ("disk", first.executable_id)
    assert c.stats()["compilations"] == 0
    assert _lookup_and_check(c, program_bytes).tier == "memory"  # the disk hit filled L1
    assert hit.executable.out_avals == (Aval((3, 2), "float32"),)


def _flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 16]) + data[middle + 16:]


def _reframe(data: bytes, mangle: Callable[[bytes], bytes]) -> bytes:
    """A well-framed entry (valid checksum) whose executable bytes are mangled."""
    with_meta = decode_entry(data, {})
    return encode_entry(Entry(mangle(with_meta.executable), with_meta.meta))


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "flipped_bytes": _flip,
    "truncated": lambda d: d[: len(d) // 2],
    "header_only": lambda d: d[:10],
    "empty": lambda d: b"",
    "not_an_entry": lambda d: b"\x00" * len(d),
    "bad_executable_valid_frame": lambda d: _reframe(d, lambda e: e[: len(e) // 2]),
    "random_executable_valid_frame": lambda d: _reframe(
        d, lambda e: np.random.default_rng(0).bytes(len(e))),
}


@pytest.fixture(scope="module")
def good_entry(tmp_path_factory: pytest.TempPathFactory, program_bytes: bytes) -> tuple[Path, bytes, str]:
    """The L2 entry of ``program_bytes``: (path relative to the cache dir, bytes, executable id)."""
    root = tmp_path_factory.mktemp("template-cache")
    c = Compiler(CompilerConfig(cache_dir=root))
    try:
        executable_id = _lookup_and_check(c, program_bytes).executable_id
    finally:
        c.close()
    path = _entry_file(root)
    return path.relative_to(root), path.read_bytes(), executable_id


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_disk_entry_recompiles(make_compiler: MakeCompiler, tmp_path: Path, program_bytes: bytes,
                                       good_entry: tuple[Path, bytes, str], corruption: str) -> None:
    relative, data, executable_id = good_entry
    (tmp_path / relative).parent.mkdir(parents=True)
    (tmp_path / relative).write_bytes(CORRUPTIONS[corruption](data))
    c = make_compiler(tmp_path)
    again = _lookup_and_check(c, program_bytes)
    assert (again.tier, again.executable_id) == ("compiled", executable_id)
    assert c.stats()["compilations"] == 1
    # The recompile replaced the bad entry: the next process hits disk again.
    assert _lookup_and_check(make_compiler(tmp_path), program_bytes).tier == "disk"


def test_concurrent_first_lookups_compile_once(make_compiler: MakeCompiler, tmp_path: Path,
                                               program_bytes: bytes) -> None:
    c = make_compiler(tmp_path)
    program = c.decode(program_bytes)
    start = threading.Barrier(16)

    def look() -> Lookup:
        start.wait()
        return c.lookup(program)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        lookups = list(pool.map(lambda _: look(), range(16)))
    assert c.stats()["compilations"] == 1
    assert len({lk.executable_id for lk in lookups}) == 1
    assert sorted(lk.tier for lk in lookups).count("compiled") == 1
    assert _lookup_and_check(c, program_bytes).tier == "memory"


def test_keys_separate_static_keys(compiler: Compiler, program_bytes: bytes) -> None:
    program = compiler.decode(program_bytes)
    before = compiler.stats()["compilations"]
    ids = {compiler.lookup(program, static_key=k).executable_id for k in ("", "a", "b")}
    assert len(ids) == 3 and compiler.stats()["compilations"] == before + 3
    assert compiler.lookup(program, static_key="a").tier == "memory"


def test_l1_eviction_falls_back_to_disk(make_compiler: MakeCompiler, tmp_path: Path,
                                        program_bytes: bytes) -> None:
    c = make_compiler(tmp_path, l1_max_entries=1)
    program = c.decode(program_bytes)
    assert c.lookup(program, static_key="a").tier == "compiled"
    assert c.lookup(program, static_key="b").tier == "compiled"  # evicts "a" from L1
    assert c.lookup(program, static_key="a").tier == "disk"
    assert c.stats()["compilations"] == 2


def _assert_only_successes_cached(program: Program, root: Path) -> None:
    """Nothing under ``root`` but (maybe) empty folders: no entry, no temporary."""
    assert _files(root) == [], f"failed compile of {program.program_id} left {_files(root)}"


def test_failed_compile_leaves_nothing(make_compiler: MakeCompiler, tmp_path: Path,
                                       program_bytes: bytes) -> None:
    c = make_compiler(tmp_path)
    program = c.decode(FAILS_TO_COMPILE, "stablehlo")
    for _ in range(2):  # nothing cached from the first failure: the second fails alike
        with pytest.raises(CompileFailed, match="AllocateBuffer"):
            c.lookup(program)
    _assert_only_successes_cached(program, tmp_path)
    assert _lookup_and_check(c, program_bytes).tier == "compiled"  # still healthy


def test_xla_crash_is_contained(make_compiler: MakeCompiler, tmp_path: Path,
                                program_bytes: bytes) -> None:
    c = make_compiler(tmp_path)
    program = c.decode(CRASHES_XLA, "stablehlo")
    with pytest.raises(CompileFailed, match="crashed"):
        c.lookup(program)
    _assert_only_successes_cached(program, tmp_path)
    assert _lookup_and_check(c, program_bytes).tier == "compiled"  # a fresh worker compiles


def test_compile_timeout_leaves_nothing(make_compiler: MakeCompiler, tmp_path: Path,
                                        program_bytes: bytes) -> None:
    c = make_compiler(tmp_path, compile_timeout_s=0.001)
    program = c.decode(program_bytes)
    with pytest.raises(CompileTimeout, match="time limit"):
        c.lookup(program)
    _assert_only_successes_cached(program, tmp_path)
    assert c.stats()["l1_entries"] == 0
