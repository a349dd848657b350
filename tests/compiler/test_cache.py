"""The tiers: L1 (memory), L2 (disk), single-flight compiles, and cache hygiene on failure;
the one tier mechanism (``TieredStore``, ``DiskTier``, ``atomic_write``) that executables
and programs share."""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jitserve.compiler import (
    Aval,
    CompileFailed,
    Compiler,
    CompilerConfig,
    CompileTimeout,
    Limits,
    Lookup,
    Program,
)
from jitserve.compiler.cache import (
    EXECUTABLES,
    PROGRAMS,
    CorruptEntry,
    DiskTier,
    Entry,
    MemoryCache,
    TieredStore,
    atomic_write,
    decode_entry,
    encode_entry,
)
from jitserve.compiler.program_store import decode_program_blob, encode_program_blob

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


# -- the one tier mechanism, for every blob kind ----------------------------------------------


def test_atomic_write_fsyncs_the_file_and_the_directory(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write(tmp_path / "blob", b"data")
    assert synced == ["file", "directory"]  # the directory after the rename
    assert (tmp_path / "blob").read_bytes() == b"data"


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_atomic_write_failure_leaves_the_old_file_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    (tmp_path / "blob").write_bytes(b"old")

    def fail(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match="No space"):
        atomic_write(tmp_path / "blob", b"new")
    assert _files(tmp_path) == [tmp_path / "blob"]
    assert (tmp_path / "blob").read_bytes() == b"old"


def test_a_failing_disk_is_a_warning_and_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    def fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    store = _store([DiskTier(tmp_path, PROGRAMS)])
    monkeypatch.setattr(os, "fsync", fsync)
    with caplog.at_level(logging.WARNING, "jitserve.compiler.cache"):
        store.put(KEY, b"blob", "value")  # no exception: the value is still served from memory
    assert "disk tier failed writing programs" in caplog.text
    assert _files(tmp_path) == []  # no temporary left behind
    assert store.get(KEY) == ("value", "memory")


class FakeTier:
    """An L2 tier in a dict; ``fail`` makes every call raise."""

    def __init__(self, name: str) -> None:
        self.name, self.blobs, self.fail = name, {}, False

    def _check(self) -> None:
        if self.fail:
            raise ConnectionError(f"{self.name} is down")

    def get(self, key: str) -> bytes | None:
        self._check()
        return self.blobs.get(key)

    def put(self, key: str, data: bytes) -> None:
        self._check()
        self.blobs[key] = data

    def delete(self, key: str) -> None:
        self._check()
        self.blobs.pop(key, None)

    def contains(self, key: str) -> bool:
        self._check()
        return key in self.blobs


KEY = hashlib.sha256(b"key").hexdigest()


def _load(key: str, data: bytes) -> str | None:
    """Blobs are ``good:<value>``, ``skip`` (sound but unusable here) or corrupt."""
    if data == b"skip":
        return None
    if not data.startswith(b"good:"):
        raise CorruptEntry("not good")
    return data[5:].decode()


def _store(tiers: list) -> TieredStore[str]:
    return TieredStore(PROGRAMS, tiers, MemoryCache(8, 1 << 20), _load, len)


def test_a_hit_fills_the_faster_tiers_and_memory() -> None:
    fast, slow = FakeTier("fast"), FakeTier("slow")
    store = _store([fast, slow])
    slow.blobs[KEY] = b"good:v"
    assert store.get(KEY) == ("v", "slow")
    assert fast.blobs[KEY] == b"good:v"
    assert store.cached(KEY) == "v" and store.get(KEY) == ("v", "memory")


def test_corrupt_blobs_are_dropped_and_unusable_ones_kept() -> None:
    first, second, third = FakeTier("first"), FakeTier("second"), FakeTier("third")
    first.blobs[KEY], second.blobs[KEY], third.blobs[KEY] = b"garbage", b"skip", b"good:v"
    store = _store([first, second, third])
    assert store.get(KEY) == ("v", "third")
    assert first.blobs[KEY] == second.blobs[KEY] == b"good:v"  # filled with the good bytes
    alone = FakeTier("alone")
    alone.blobs[KEY] = b"skip"
    assert _store([alone]).get(KEY) is None
    assert alone.blobs[KEY] == b"skip"  # not dropped: another process may use it


def test_a_failing_tier_is_a_miss_and_put_and_fill_go_on() -> None:
    down, up = FakeTier("down"), FakeTier("up")
    store = _store([down, up])
    down.fail = True
    store.put(KEY, b"good:v")
    assert up.blobs == {KEY: b"good:v"}
    store.memory = MemoryCache(8, 1 << 20)  # a fresh process
    assert store.get(KEY) == ("v", "up")
    down.fail = False
    store.fill(KEY, b"good:v")  # writes only where it is missing
    assert down.blobs == {KEY: b"good:v"}


def test_programs_and_executables_go_through_the_same_tiers(
        make_compiler: MakeCompiler, tmp_path: Path, program_bytes: bytes) -> None:
    c = make_compiler(tmp_path)
    program, created = c.programs.put(program_bytes)
    assert created
    lookup = _lookup_and_check(c, program_bytes)
    assert [type(t) for t in c.tiers] == [type(t) for t in c.programs.store.tiers] == [DiskTier]
    assert [t.kind for t in c.tiers] == [EXECUTABLES]
    assert [t.kind for t in c.programs.store.tiers] == [PROGRAMS]
    pid, eid = program.program_id, lookup.executable_id
    assert _files(tmp_path) == sorted([tmp_path / "executables" / eid[:2] / eid,
                                       tmp_path / "programs" / pid[:2] / pid])
    blob = (tmp_path / "programs" / pid[:2] / pid).read_bytes()
    assert decode_program_blob(pid, blob) == (program_bytes, "jax_export")  # format kept with it


def test_programs_survive_a_restart(make_compiler: MakeCompiler, tmp_path: Path,
                                    program_bytes: bytes) -> None:
    program, _ = make_compiler(tmp_path).programs.put(program_bytes)
    again = make_compiler(tmp_path).programs
    assert again.cached(program.program_id) is None
    found = again.get(program.program_id)
    assert found is not None and found.in_avals == program.in_avals
    assert again.put(program_bytes)[1] is False


@pytest.mark.parametrize("damage", ["another_program", "truncated", "garbage", "old_layout"])
def test_corrupt_program_file_is_ignored(make_compiler: MakeCompiler, tmp_path: Path,
                                         program_bytes: bytes, damage: str) -> None:
    pid = hashlib.sha256(program_bytes).hexdigest()
    blob = encode_program_blob(program_bytes, "jax_export")
    path = tmp_path / "programs" / pid[:2] / pid
    path.parent.mkdir(parents=True)
    path.write_bytes({"another_program": encode_program_blob(FAILS_TO_COMPILE, "stablehlo"),
                      "truncated": blob[:-1], "garbage": b"\x00" * 64,
                      "old_layout": program_bytes}[damage])
    c = make_compiler(tmp_path)
    assert c.programs.get(pid) is None
    assert not path.exists()
    assert c.programs.put(program_bytes)[1] is True and path.read_bytes() == blob


def test_a_program_refused_by_tighter_limits_is_kept(make_compiler: MakeCompiler, tmp_path: Path,
                                                     program_bytes: bytes) -> None:
    program, _ = make_compiler(tmp_path).programs.put(program_bytes)
    strict = make_compiler(tmp_path, limits=Limits(max_program_bytes=64))
    assert strict.programs.get(program.program_id) is None  # re-validated like an upload
    assert make_compiler(tmp_path).programs.get(program.program_id) is not None  # still there
