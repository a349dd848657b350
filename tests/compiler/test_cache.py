"""The tiers: L1 (memory), L2 (disk), single-flight compiles, and cache hygiene on failure;
the one tier mechanism (``TieredStore``, ``DiskTier``, ``atomic_write``) that executables
and programs share; signed entries (``CacheSecret``) and the secret kept in the cache dir."""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import stat
import struct
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
    ENTRY_VERSION,
    EXECUTABLES,
    PROGRAMS,
    CacheSecret,
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

SECRET = CacheSecret.from_value("test-cache-secret-" + "4f9a" * 8)
OTHER_SECRET = CacheSecret.from_value("another-cache-secret-" + "c3d1" * 8)
SECRET_FILE = "cache-secret"  # in the cache dir, when no secret is configured


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
  %0 = stablehlo.custom_call @Sharding(%arg0, %arg1) {mhlo.sharding = "{replicated}"}
      : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
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
    """Every regular file under ``root`` (entries and any temporaries) but the cache secret."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p != root / SECRET_FILE)


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


def test_load_by_id_needs_no_program(make_compiler: MakeCompiler, tmp_path: Path,
                                     program_bytes: bytes) -> None:
    """``Compiler.load`` reads an entry by its key alone (a restarted runtime told which
    executable to run): no decode, no compile; ``None`` where no tier has it."""
    first = _lookup_and_check(make_compiler(tmp_path), program_bytes)
    c = make_compiler(tmp_path)
    hit = c.load(first.executable_id)
    assert hit is not None and (hit.tier, hit.executable_id) == ("disk", first.executable_id)
    (out,) = hit.executable.run([jax.device_put(a, c.device) for a in (X, Y)])
    np.testing.assert_allclose(np.asarray(out), WANT, rtol=1e-6)
    assert hit.executable.in_avals == (Aval((3, 4), "float32"), Aval((4, 2), "float32"))
    again = c.load(first.executable_id)
    assert again is not None and again.tier == "memory" and again.executable is hit.executable
    assert c.lookup(c.decode(program_bytes)).tier == "memory"  # the same L1 entry
    assert c.stats()["compilations"] == 0
    assert c.load("0" * 64) is None  # no tier has it: never compiles
    assert c.load("../" + "a" * 61) is None and c.load("") is None  # not keys
    assert c.stats()["compilations"] == 0


def test_load_refuses_an_entry_under_another_key(make_compiler: MakeCompiler, tmp_path: Path,
                                                 program_bytes: bytes) -> None:
    """The entry's MAC binds it to its key: a copy under another id is dropped, not loaded."""
    first = _lookup_and_check(make_compiler(tmp_path), program_bytes)
    entry = _entry_file(tmp_path)
    other = "f" * 64
    (entry.parent.parent / other[:2]).mkdir(exist_ok=True)
    (entry.parent.parent / other[:2] / other).write_bytes(entry.read_bytes())
    c = make_compiler(tmp_path)
    assert c.load(other) is None
    assert not (entry.parent.parent / other[:2] / other).exists()  # dropped as corrupt
    assert c.load(first.executable_id) is not None


class _Loaded:
    """A stand-in for a loaded executable that counts its memory analyses."""

    def __init__(self) -> None:
        self.asked = 0

    def get_compiled_memory_stats(self) -> object:
        self.asked += 1
        raise RuntimeError("no analysis here")

    def cost_analysis(self) -> dict[str, float]:
        return {"flops": 1.0}


@pytest.mark.parametrize("stored", [
    {"argument_bytes": 8, "output_bytes": 4, "alias_bytes": 0, "temp_bytes": 16,
     "generated_code_bytes": 0},
    {"argument_bytes": 8, "output_bytes": 4, "alias_bytes": 0, "temp_bytes": 16},  # older entry
])
def test_a_hit_reuses_the_stored_memory_stats(stored: dict[str, int]) -> None:
    """An entry's meta has the memory stats its compile measured; a hit does not ask XLA again."""
    from jitserve.compiler import Executable

    loaded = _Loaded()
    meta = {"in_avals": [], "out_avals": [], "memory": stored, "cost": {"flops": 1.0}}
    exe = Executable(loaded, "0" * 64, meta, 10)
    assert loaded.asked == 0
    assert exe.memory is not None and exe.memory.temp_bytes == 16
    assert exe.meta["memory"]["generated_code_bytes"] == 0


def test_a_compile_measures_the_memory_stats() -> None:
    """Without stored stats (a compile) the loaded executable is asked; ``None`` if it cannot say."""
    from jitserve.compiler import Executable

    loaded = _Loaded()
    exe = Executable(loaded, "0" * 64, {"in_avals": [], "out_avals": []}, 10)
    assert loaded.asked == 1 and exe.memory is None


def test_an_executable_knows_its_output_bytes(make_compiler: MakeCompiler, tmp_path: Path,
                                              program_bytes: bytes) -> None:
    """A runtime decides from ``out_nbytes`` whether outputs come with a run's answer."""
    from jitserve.compiler import Executable

    exe = _lookup_and_check(make_compiler(tmp_path), program_bytes).executable
    (out,) = exe.run([jax.device_put(a, jax.devices("cpu")[0]) for a in (X, Y)])
    assert exe.out_nbytes == out.nbytes == 3 * 2 * 4
    dynamic = {"in_avals": [], "out_avals": [{"shape": [None, 2], "dtype": "float32"}]}
    assert Executable(_Loaded(), "0" * 64, dynamic, 10).out_nbytes is None


def _flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 16]) + data[middle + 16:]


def _reframe(data: bytes, key: str, mangle: Callable[[bytes], bytes]) -> bytes:
    """A well-framed entry (valid MAC) whose executable bytes are mangled."""
    with_meta = decode_entry(key, data, SECRET)
    return encode_entry(key, Entry(mangle(with_meta.executable), with_meta.meta), SECRET)


def _resign(data: bytes, key: str, *, as_key: str | None = None,
            secret: CacheSecret = SECRET) -> bytes:
    """Entry ``data`` of ``key`` signed again with ``secret``, for ``as_key`` (its meta too)."""
    entry = decode_entry(key, data, SECRET)
    meta = {**entry.meta, "key": as_key or key}
    return encode_entry(as_key or key, Entry(entry.executable, meta), secret)


def _version(data: bytes, version: int) -> bytes:
    return data[:4] + struct.pack("<H", version) + data[6:]


CORRUPTIONS: dict[str, Callable[[bytes, str], bytes]] = {
    "flipped_bytes": lambda d, k: _flip(d),
    "flipped_mac": lambda d, k: d[:6] + bytes([d[6] ^ 1]) + d[7:],
    "truncated": lambda d, k: d[: len(d) // 2],
    "header_only": lambda d, k: d[:10],
    "empty": lambda d, k: b"",
    "not_an_entry": lambda d, k: b"\x00" * len(d),
    "old_version": lambda d, k: _version(d, 1),
    "signed_with_another_secret": lambda d, k: _resign(d, k, secret=OTHER_SECRET),
    "signed_for_another_key": lambda d, k: _resign(d, k, as_key="0" * 64),
    "bad_executable_valid_frame": lambda d, k: _reframe(d, k, lambda e: e[: len(e) // 2]),
    "random_executable_valid_frame": lambda d, k: _reframe(
        d, k, lambda e: np.random.default_rng(0).bytes(len(e))),
}


@pytest.fixture(scope="module")
def good_entry(tmp_path_factory: pytest.TempPathFactory, program_bytes: bytes) -> tuple[Path, bytes, str]:
    """The L2 entry of ``program_bytes``: (path relative to the cache dir, bytes, executable id)."""
    root = tmp_path_factory.mktemp("template-cache")
    c = Compiler(CompilerConfig(cache_dir=root, cache_secret=SECRET))
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
    (tmp_path / relative).write_bytes(CORRUPTIONS[corruption](data, executable_id))
    c = make_compiler(tmp_path, cache_secret=SECRET)
    again = _lookup_and_check(c, program_bytes)
    assert (again.tier, again.executable_id) == ("compiled", executable_id)
    assert c.stats()["compilations"] == 1
    # The recompile replaced the bad entry: the next process hits disk again.
    assert _lookup_and_check(make_compiler(tmp_path, cache_secret=SECRET),
                             program_bytes).tier == "disk"


def other_fn(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.tanh(x @ y) - 1.0


@pytest.fixture(scope="module")
def other_program_bytes() -> bytes:
    """A program with ``small_fn``'s signature and another answer."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (X, Y)]
    return bytes(jax.export.export(jax.jit(other_fn))(*specs).serialize())


def _exe_path(root: Path, key: str) -> Path:
    return root / "executables" / key[:2] / key


@pytest.mark.parametrize("swap", ["as_is", "key_rewritten_and_signed_with_another_secret"])
def test_swapped_disk_entry_is_refused(make_compiler: MakeCompiler, tmp_path: Path,
                                       program_bytes: bytes, other_program_bytes: bytes,
                                       caplog: pytest.LogCaptureFixture, swap: str) -> None:
    """The entry of program X written under program Z's key: Z recompiles and answers as Z."""
    a = make_compiler(tmp_path)
    x_key = _lookup_and_check(a, program_bytes).executable_id
    z_key = a.executable_id(a.decode(other_program_bytes))
    x_entry = _exe_path(tmp_path, x_key).read_bytes()
    if swap != "as_is":  # what a writer without the secret could do at best
        entry = decode_entry(x_key, x_entry, CacheSecret.in_directory(tmp_path))
        x_entry = encode_entry(z_key, Entry(entry.executable, {**entry.meta, "key": z_key}),
                               OTHER_SECRET)
    _exe_path(tmp_path, z_key).parent.mkdir(exist_ok=True)
    _exe_path(tmp_path, z_key).write_bytes(x_entry)
    b = make_compiler(tmp_path)  # a restart, with the secret kept in the cache dir
    with caplog.at_level(logging.WARNING, "jitserve.compiler.cache"):
        lookup = b.lookup(b.decode(other_program_bytes))
    assert (lookup.tier, lookup.executable_id) == ("compiled", z_key)
    assert "MAC does not match" in caplog.text
    (out,) = lookup.executable.run([jax.device_put(v, b.device) for v in (X, Y)])
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(other_fn)(X, Y)), rtol=1e-6)
    assert _lookup_and_check(b, program_bytes).tier == "disk"  # X's own entry is fine
    assert make_compiler(tmp_path).lookup(b.decode(other_program_bytes)).tier == "disk"


def test_secret_file_is_private_and_reused_after_a_restart(
        make_compiler: MakeCompiler, tmp_path: Path, program_bytes: bytes) -> None:
    first = _lookup_and_check(make_compiler(tmp_path), program_bytes)
    path = tmp_path / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    kept = path.read_bytes()
    assert len(kept.strip()) == 64 and int(kept, 16)  # 32 random bytes, in hex
    hit = _lookup_and_check(make_compiler(tmp_path), program_bytes)
    assert (hit.tier, hit.executable_id) == ("disk", first.executable_id)
    assert path.read_bytes() == kept
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == [SECRET_FILE]  # no temporary


def test_a_new_secret_makes_old_entries_misses(make_compiler: MakeCompiler, tmp_path: Path,
                                               program_bytes: bytes) -> None:
    """Rotation: entries signed with the old secret are dropped and recompiled, never run."""
    _lookup_and_check(make_compiler(tmp_path, cache_secret=SECRET), program_bytes)
    c = make_compiler(tmp_path, cache_secret=OTHER_SECRET)
    assert _lookup_and_check(c, program_bytes).tier == "compiled"
    assert _lookup_and_check(make_compiler(tmp_path, cache_secret=OTHER_SECRET),
                             program_bytes).tier == "disk"
    assert not (tmp_path / SECRET_FILE).exists()  # a configured secret needs no file


def test_processes_starting_at_once_agree_on_the_secret(tmp_path: Path) -> None:
    start = threading.Barrier(8)

    def make(_: int) -> bytes:
        start.wait()
        return CacheSecret.in_directory(tmp_path).value

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        values = set(pool.map(make, range(8)))
    assert len(values) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [SECRET_FILE]


def test_a_readable_secret_file_is_made_private(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    made = CacheSecret.in_directory(tmp_path)
    (tmp_path / SECRET_FILE).chmod(0o644)
    with caplog.at_level(logging.WARNING, "jitserve.compiler.cache"):
        assert CacheSecret.in_directory(tmp_path) == made
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600
    assert "mode 644" in caplog.text and made.value.decode() not in caplog.text


def test_a_damaged_secret_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / SECRET_FILE).write_text("hunter2\n")
    with pytest.raises(ValueError, match="damaged") as raised:
        CacheSecret.in_directory(tmp_path)
    assert "hunter2" not in str(raised.value)


KEY_A, KEY_B = (hashlib.sha256(n).hexdigest() for n in (b"a", b"b"))


@pytest.mark.parametrize("key, secret, data_of", [
    (KEY_B, SECRET, lambda d: d),                  # moved under another key
    (KEY_A, OTHER_SECRET, lambda d: d),            # read with another secret
    (KEY_A, SECRET, lambda d: d[:-1] + bytes([d[-1] ^ 1])),  # a body byte
    (KEY_A, SECRET, lambda d: d[:10] + bytes([d[10] ^ 1]) + d[11:]),  # a MAC byte
])
def test_entry_mac_binds_key_body_and_secret(key: str, secret: CacheSecret,
                                             data_of: Callable[[bytes], bytes]) -> None:
    entry = Entry(b"executable bytes" * 64, {"key": KEY_A, "n": 1})
    data = encode_entry(KEY_A, entry, SECRET)
    assert decode_entry(KEY_A, data, SECRET) == entry
    with pytest.raises(CorruptEntry, match="MAC does not match") as raised:
        decode_entry(key, data_of(data), secret)
    assert SECRET.value.decode() not in str(raised.value)


def test_old_entry_versions_are_refused() -> None:
    data = encode_entry(KEY_A, Entry(b"x", {}), SECRET)
    assert ENTRY_VERSION == 2
    with pytest.raises(CorruptEntry, match="version 1"):
        decode_entry(KEY_A, _version(data, 1), SECRET)


def test_the_secret_stays_out_of_reprs() -> None:
    assert "4f9a" not in repr(SECRET) and "4f9a" not in str(SECRET)
    assert "configured" in repr(SECRET)
    with pytest.raises(ValueError, match="empty"):
        CacheSecret.from_value("")


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


def test_atomic_write_exclusive_keeps_an_existing_file(tmp_path: Path) -> None:
    atomic_write(tmp_path / "blob", b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        atomic_write(tmp_path / "blob", b"second", exclusive=True)
    assert _files(tmp_path) == [tmp_path / "blob"]  # no temporary left
    assert (tmp_path / "blob").read_bytes() == b"first"
    assert stat.S_IMODE((tmp_path / "blob").stat().st_mode) == 0o600


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
