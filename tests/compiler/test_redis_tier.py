"""The Redis tiers (``jitserve.compiler.redis``) against a real ``redis-server``:
storage, metadata, listing, programs, the cross-process compile lock, corrupt,
swapped and foreign-signed entries and blobs, and Redis dying and coming back.

Two ``Compiler`` instances with their own cache dirs stand for two processes
that share one Redis; the lock-holder test uses a real second process.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
import redis
from redis_server import RedisServer, free_port, make_tls_certs

from jitserve.compiler import CacheUnavailable, Compiler, Lookup, RedisSettings, SharedTier
from jitserve.compiler.cache import CacheSecret, Entry, decode_entry, encode_entry
from jitserve.compiler.program_store import encode_program_blob
from jitserve.compiler.redis import LAYOUT_VERSION, RedisTier, RedisTiers, RedisUnavailable

pytestmark = pytest.mark.timeout(180)

SECRET = CacheSecret.from_value("redis-test-cache-secret-" + "9e27" * 8)
OTHER_SECRET = CacheSecret.from_value("someone-elses-cache-secret-" + "51b0" * 8)

MakeSettings = Callable[..., RedisSettings]
MakeTiers = Callable[..., RedisTiers]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def settings(redis_url: str, redis_prefix: str) -> MakeSettings:
    """``RedisSettings`` on this test's prefix (``url`` and the other fields overridable)."""
    def make(url: str | None = None, **options: Any) -> RedisSettings:
        options.setdefault("prefix", redis_prefix)
        return RedisSettings.from_url(url or redis_url, **options)

    return make


@pytest.fixture
def make_tiers(settings: MakeSettings) -> Iterator[MakeTiers]:
    """``RedisTiers`` (same arguments as ``settings``), closed at teardown."""
    made: list[RedisTiers] = []

    def make(url: str | None = None, **options: Any) -> RedisTiers:
        made.append(RedisTiers(settings(url, **options), SECRET))
        return made[-1]

    yield make
    for tiers in made:
        tiers.close()


def rkey(prefix: str, kind: str, name: str) -> str:
    """The full Redis key of record ``name`` of ``kind`` under deployment ``prefix``."""
    return f"jitserve:v{LAYOUT_VERSION}:{prefix}:{kind}:{name}"


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    """A plain client, for reading and damaging records by hand."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@functools.cache
def program_bytes(scale: float = 2.0) -> bytes:
    """A small exported program; ``scale`` makes distinct programs (and keys).

    Cached: an export carries source locations of its call stack, so two exports
    from different lines are different programs.
    """
    def f(x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.tanh(x @ y) * scale

    spec = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    return jax.export.export(jax.jit(f))(spec, spec).serialize()


ARGS = [np.eye(8, dtype=np.float32), np.full((8, 8), 0.5, np.float32)]
EXPECTED = np.tanh(ARGS[0] @ ARGS[1]) * 2.0


def run_program(c: Compiler, data: bytes, fmt: str,
                args: list[np.ndarray]) -> tuple[Lookup, list[np.ndarray]]:
    """Decode, look up and run ``data``; the lookup and the numpy outputs."""
    lookup = c.lookup(c.decode(data, fmt))
    outs = lookup.executable.run([jax.device_put(a, c.device) for a in args])
    return lookup, [np.asarray(o) for o in outs]


def fake_entry(key: str, device_kind: str = "cpu", size: int = 5000,
               secret: CacheSecret = SECRET) -> bytes:
    meta = {"key": key, "jaxlib_version": jaxlib.__version__, "platform": "cpu",
            "device_kind": device_kind, "compile_seconds": 1.25, "created": 1000.0,
            "program_id": "p" * 64}
    return encode_entry(key, Entry(os.urandom(size // 2) + bytes(size // 2), meta), secret)


def a_key(n: int = 0) -> str:
    return hashlib.sha256(f"key-{n}".encode()).hexdigest()


# -- settings ---------------------------------------------------------------------------


def test_settings_from_url() -> None:
    s = RedisSettings.from_url("rediss://jitserve:s3cret@cache:6380/2", prefix="prod", ttl_s=60)
    assert s.key_prefix == f"jitserve:v{LAYOUT_VERSION}:prod:"
    assert s.redacted_url == "rediss://jitserve:***@cache:6380/2"
    assert "s3cret" not in repr(s.redacted_url)


@pytest.mark.parametrize("url, options, message", [
    ("http://cache:6379", {}, "scheme"),
    ("redis://cache", {"prefix": "a*b"}, "prefix"),
    ("redis://cache", {"prefix": ""}, "prefix"),
    ("redis://cache", {"ttl_s": 0}, "ttl_s"),
    ("redis://cache", {"lock_ttl_s": -1}, "lock_ttl_s"),
])
def test_settings_refuse(url: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisSettings.from_url(url, **options)


def test_settings_module_loads_no_redis() -> None:
    """``service.settings`` reads ``RedisSettings`` at every start, Redis or not."""
    done = subprocess.run([sys.executable, "-c", (
        "import sys; from jitserve.compiler.redis.settings import RedisSettings; "
        "import jitserve.compiler; assert 'redis' not in sys.modules, 'redis loaded'")],
        capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]


def test_executables_are_a_shared_tier(make_tiers: MakeTiers) -> None:
    assert isinstance(make_tiers().executables, SharedTier)


def _exercise(tiers: RedisTiers) -> None:
    """Every command the tiers use, with no error counted."""
    key = a_key()
    tiers.executables.put(key, fake_entry(key))
    assert tiers.executables.get(key) is not None and tiers.catalog.metadata(key) is not None
    assert [e["executable_id"] for e in tiers.catalog.list_entries().entries] == [key]
    program_id, blob = program_blob()
    tiers.programs.put(program_id, blob)
    assert tiers.programs.get(program_id) == blob and tiers.programs.contains(program_id)
    with tiers.executables.compile_lock(a_key(1)) as should_compile:
        assert should_compile
    assert tiers.connection.stats()["errors"] == 0 and tiers.connection.available


def program_blob(*scale: float) -> tuple[str, bytes]:
    """The id of ``program_bytes(*scale)`` and the blob the tiers keep for it."""
    data = program_bytes(*scale)
    program_id = hashlib.sha256(data).hexdigest()
    return program_id, encode_program_blob(data, "jax_export")


def test_password_and_acl_user(redis_server: Callable[..., RedisServer],
                               make_tiers: MakeTiers) -> None:
    server = redis_server(password="admin-pw-0123")
    admin = redis.Redis.from_url(server.url)
    # The ACL docs/redis.md recommends: jitserve's keys and channels, nothing dangerous.
    admin.execute_command("ACL", "SETUSER", "jitserve", "on", ">user-pw-4567", "resetkeys",
                          "~jitserve:*", "resetchannels", "&jitserve:*", "+@all", "-@dangerous")
    admin.close()
    url = f"redis://jitserve:user-pw-4567@127.0.0.1:{server.port}/0"
    _exercise(make_tiers(url))
    wrong = make_tiers(f"redis://jitserve:wrong-password@127.0.0.1:{server.port}/0")
    assert not wrong.connection.available and wrong.connection.stats()["errors"] >= 1
    assert wrong.executables.get(a_key()) is None


@pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl to make certificates")
def test_tls(redis_server: Callable[..., RedisServer], make_tiers: MakeTiers,
             tmp_path: Path) -> None:
    server = redis_server(tls_dir=make_tls_certs(tmp_path / "tls"), password="tls-pw-0123")
    assert server.url.startswith("rediss://")
    _exercise(make_tiers(server.url))


# -- storage, metadata, TTL, listing ------------------------------------------------------


def test_put_get_delete_with_metadata(make_tiers: MakeTiers) -> None:
    tiers, key = make_tiers(), a_key()
    tier, catalog = tiers.executables, tiers.catalog
    data = fake_entry(key)
    assert tier.get(key) is None and catalog.metadata(key) is None
    tier.put(key, data)
    assert tier.get(key) == data
    assert tier.get(key) == data
    meta = catalog.metadata(key)
    assert meta is not None
    assert meta["executable_id"] == key and meta["program_id"] == "p" * 64
    assert meta["size"] == len(data) and meta["raw_size"] == 5000
    assert meta["compile_seconds"] == 1.25 and meta["created"] == 1000.0
    assert meta["hits"] == 2 and meta["last_hit"] is not None
    assert meta["jax_version"] == jax.__version__
    assert meta["jaxlib_version"] == jaxlib.__version__ and meta["device_kind"] == "cpu"
    stats = tiers.connection.stats()
    assert stats["state"] == "ok" and stats["errors"] == 0 and stats["hits"] == 2
    assert stats["misses"] == 1
    assert stats["bytes_written"] == len(data) and stats["bytes_read"] == 2 * len(data)
    tier.delete(key)
    assert tier.get(key) is None and catalog.metadata(key) is None


def test_put_refuses_a_bad_entry(make_tiers: MakeTiers) -> None:
    tier, key = make_tiers().executables, a_key()
    tier.put(key, b"not an entry")
    tier.put(key, fake_entry(a_key(1)))  # an entry of another key
    tier.put(key, fake_entry(key, secret=OTHER_SECRET))  # signed with another secret
    assert tier.get(key) is None


def test_keys_are_under_the_versioned_prefix(make_tiers: MakeTiers, raw: redis.Redis,
                                             redis_prefix: str) -> None:
    tiers, key = make_tiers(), a_key()
    tiers.executables.put(key, fake_entry(key))
    program_id, blob = program_blob()
    tiers.programs.put(program_id, blob)
    keys = {k.decode() for k in raw.scan_iter(match=f"*{redis_prefix}*")}
    assert keys == {rkey(redis_prefix, "exe", key), rkey(redis_prefix, "meta", key),
                    rkey(redis_prefix, "prog", program_id)}
    assert raw.type(rkey(redis_prefix, "prog", program_id)) == b"string"  # one blob, no hash
    assert raw.get(rkey(redis_prefix, "prog", program_id)) == blob


def _wait_until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# The TTL tests wait on Redis's own clock (``PTTL``), not fixed sleeps: a read lands
# with at least a second of its TTL left however slow this machine is.
_TTL_S = 2.0


def test_ttl_expires_and_hits_refresh_it(make_tiers: MakeTiers, raw: redis.Redis,
                                         redis_prefix: str) -> None:
    tiers, key = make_tiers(ttl_s=_TTL_S), a_key()
    tier = tiers.executables
    tier.put(key, fake_entry(key))
    exe, meta = (rkey(redis_prefix, kind, key) for kind in ("exe", "meta"))
    assert 0 < raw.pttl(exe) <= 2000 and 0 < raw.pttl(meta) <= 2000
    _wait_until(lambda: raw.pttl(exe) <= 1500)
    assert tier.get(key) is not None  # a hit pushes the expiry out again
    assert raw.pttl(exe) > 1500 and raw.pttl(meta) > 1500
    _wait_until(lambda: not raw.exists(exe, meta))
    assert tier.get(key) is None and tiers.catalog.metadata(key) is None


def test_program_ttl_is_refreshed_by_reads(make_tiers: MakeTiers, raw: redis.Redis,
                                          redis_prefix: str) -> None:
    programs = make_tiers(ttl_s=_TTL_S).programs
    program_id, blob = program_blob()
    programs.put(program_id, blob)
    name = rkey(redis_prefix, "prog", program_id)
    assert 0 < raw.pttl(name) <= 2000
    _wait_until(lambda: raw.pttl(name) <= 1500)
    assert programs.get(program_id) == blob
    assert raw.pttl(name) > 1500
    _wait_until(lambda: not raw.exists(name))
    assert programs.get(program_id) is None and not programs.contains(program_id)


def test_no_ttl_by_default(make_tiers: MakeTiers, raw: redis.Redis, redis_prefix: str) -> None:
    tier, key = make_tiers().executables, a_key()
    tier.put(key, fake_entry(key))
    assert raw.pttl(rkey(redis_prefix, "exe", key)) == -1


def test_listing_pages_through_every_entry(make_tiers: MakeTiers, raw: redis.Redis,
                                           redis_prefix: str) -> None:
    tiers, other = make_tiers(), make_tiers(prefix=f"{redis_prefix}-other")
    tier = tiers.executables
    keys = {a_key(i) for i in range(25)}
    for key in keys:
        tier.put(key, fake_entry(key, size=100))
    other.executables.put(a_key(99), fake_entry(a_key(99), size=100))  # another deployment's
    orphan = a_key(7)
    raw.delete(rkey(redis_prefix, "exe", orphan))  # as if evicted by LRU
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        page = tiers.catalog.list_entries(cursor, limit=10)
        seen += [e["executable_id"] for e in page.entries]
        pages += 1
        cursor = page.next_cursor
        if cursor is None:
            break
    assert set(seen) == keys - {orphan}
    assert pages >= 2
    assert not raw.exists(rkey(redis_prefix, "meta", orphan))  # cleaned up
    for bad in ("not-a-cursor", str(1 << 64), "9" * 40):  # past SCAN's 64 bits too
        with pytest.raises(ValueError, match="cursor"):
            tiers.catalog.list_entries(bad)


def test_works_under_maxmemory_allkeys_lru(redis_server: Callable[..., RedisServer],
                                           make_tiers: MakeTiers) -> None:
    server = redis_server(maxmemory="4mb")
    tiers = make_tiers(server.url)
    tier = tiers.executables
    keys = [a_key(i) for i in range(100)]
    for key in keys:  # about 6 MB of entries into 4 MB
        tier.put(key, fake_entry(key, size=128 << 10))
    present = [key for key in keys if tier.get(key) is not None]
    assert 0 < len(present) < len(keys)  # some were evicted, none refused
    assert tiers.connection.stats()["errors"] == 0
    listed = {e["executable_id"] for e in tiers.catalog.list_entries(limit=1000).entries}
    assert listed <= set(present)  # nothing listed whose entry is gone


# -- programs: one more blob kind through the same tiers --------------------------------------


def test_program_hit_in_redis_fills_the_disk_tier(make_compiler: Callable[..., Compiler],
                                                  settings: MakeSettings, raw: redis.Redis,
                                                  redis_prefix: str, tmp_path: Path) -> None:
    a = make_compiler(tmp_path / "a", cache_secret=SECRET, redis=settings())
    program, created = a.programs.put(program_bytes(), "jax_export")
    assert created
    pid = program.program_id
    b = make_compiler(tmp_path / "b", cache_secret=SECRET, redis=settings())
    # One Redis tier class for both kinds (executables add their records and lock).
    assert [type(t).__name__ for t in b.programs.store.tiers] == ["DiskTier", "RedisTier"]
    assert all(isinstance(t, RedisTier) for t in (b.tiers[1], b.programs.store.tiers[1]))
    found = b.programs.get(pid)  # uploaded through A only
    assert found is not None and (found.program_id, found.format) == (pid, program.format)
    on_disk = tmp_path / "b" / "programs" / pid[:2] / pid
    assert on_disk.read_bytes() == raw.get(rkey(redis_prefix, "prog", pid))
    # A restart of B needs no Redis: its disk answers.
    restarted = make_compiler(tmp_path / "b", cache_secret=SECRET)
    assert restarted.programs.get(pid) is not None
    _, created = restarted.programs.put(program_bytes())
    assert not created


@pytest.mark.parametrize("damage", ["another_program", "truncated", "garbage", "empty",
                                    "unknown_format"])
def test_corrupt_program_blob_in_redis_is_ignored(make_compiler: Callable[..., Compiler],
                                                  settings: MakeSettings, raw: redis.Redis,
                                                  redis_prefix: str, tmp_path: Path,
                                                  damage: str) -> None:
    program_id, blob = program_blob()
    _, other = program_blob(5.0)
    name = rkey(redis_prefix, "prog", program_id)
    raw.set(name, {"another_program": other, "truncated": blob[:-1], "garbage": b"\x00" * 64,
                   "empty": b"", "unknown_format": blob.replace(b"jax_export", b"pickle_xxx", 1),
                   }[damage])
    c = make_compiler(tmp_path / "c", cache_secret=SECRET, redis=settings())
    assert c.programs.get(program_id) is None  # never decoded, never run
    assert not raw.exists(name)  # dropped, so an upload stores a good one again
    assert not (tmp_path / "c" / "programs" / program_id[:2] / program_id).exists()
    program, created = c.programs.put(program_bytes(), "jax_export")
    assert created and raw.get(name) == blob


def test_known_program_is_shared_again(make_compiler: Callable[..., Compiler],
                                       settings: MakeSettings, raw: redis.Redis,
                                       redis_prefix: str, tmp_path: Path) -> None:
    c = make_compiler(tmp_path, cache_secret=SECRET, redis=settings())
    program, _ = c.programs.put(program_bytes())
    name = rkey(redis_prefix, "prog", program.program_id)
    raw.delete(name)  # evicted, or uploaded while Redis was down
    again, created = c.programs.put(program_bytes())
    assert not created and again is program and raw.exists(name)


# -- through the Compiler -------------------------------------------------------------------


def test_second_process_is_a_redis_hit(make_compiler: Callable[..., Compiler],
                                       settings: MakeSettings,
                                       tmp_path: Path) -> None:
    a = make_compiler(tmp_path / "a", cache_secret=SECRET, redis=settings())
    b = make_compiler(tmp_path / "b", cache_secret=SECRET, redis=settings())
    first, _ = run_program(a, program_bytes(), "jax_export", ARGS)
    second, outs = run_program(b, program_bytes(), "jax_export", ARGS)
    assert first.tier == "compiled" and second.tier == "redis"
    assert second.executable_id == first.executable_id
    assert b.stats()["compilations"] == 0
    np.testing.assert_allclose(outs[0], EXPECTED, rtol=1e-6)
    # B filled its faster local tier: a restart of B hits its disk, not Redis.
    assert (tmp_path / "b" / "executables" / first.executable_id[:2] / first.executable_id).exists()


def test_second_process_loads_by_id_from_redis(make_compiler: Callable[..., Compiler],
                                               settings: MakeSettings, raw: redis.Redis,
                                               redis_prefix: str) -> None:
    """``Compiler.load``: a process with no program and no disk reads the entry by its id,
    counts the hit in its record, and runs it; a foreign-signed entry is refused."""
    a = make_compiler(None, cache_secret=SECRET, redis=settings())
    b = make_compiler(None, cache_secret=SECRET, redis=settings())
    first, _ = run_program(a, program_bytes(), "jax_export", ARGS)
    hit = b.load(first.executable_id)
    assert hit is not None and (hit.tier, hit.executable_id) == ("redis", first.executable_id)
    (out,) = hit.executable.run([jax.device_put(x, b.device) for x in ARGS])
    np.testing.assert_allclose(np.asarray(out), EXPECTED, rtol=1e-6)
    assert b.stats()["compilations"] == 0 and b.programs.cached(first.executable_id) is None
    assert int(raw.hget(rkey(redis_prefix, "meta", first.executable_id), "hits")) == 1
    stranger = make_compiler(None, cache_secret=OTHER_SECRET, redis=settings())
    assert stranger.load(first.executable_id) is None  # and the entry is dropped as corrupt
    assert stranger.stats()["compilations"] == 0


def _corrupt(raw: redis.Redis, name: str, kind: str) -> None:
    data = raw.get(name)
    assert data is not None
    key = name.rsplit(":", 1)[1]
    damaged = {"truncated": data[: len(data) // 2], "flipped": data[:-1] + bytes([data[-1] ^ 1]),
               "garbage": b"\x00" * 100, "empty": b"",
               "foreign_device": fake_entry(key, device_kind="TPU v9"),
               "other_secret": _resigned(data, key, key, OTHER_SECRET),
               "old_version": data[:4] + (1).to_bytes(2, "little") + data[6:]}[kind]
    raw.set(name, damaged)


def _resigned(data: bytes, key: str, as_key: str, secret: CacheSecret) -> bytes:
    """Entry ``data`` of ``key`` claiming ``as_key`` (in its meta too), signed with ``secret``."""
    entry = decode_entry(key, data, SECRET)
    return encode_entry(as_key, Entry(entry.executable, {**entry.meta, "key": as_key}), secret)


@pytest.mark.parametrize("kind", ["truncated", "flipped", "garbage", "empty", "foreign_device",
                                  "other_secret", "old_version"])
def test_corrupt_entry_is_dropped_and_recompiled(make_compiler: Callable[..., Compiler],
                                                 settings: MakeSettings,
                                                 raw: redis.Redis, redis_prefix: str,
                                                 kind: str) -> None:
    a = make_compiler(None, cache_secret=SECRET, redis=settings())
    first, _ = run_program(a, program_bytes(), "jax_export", ARGS)
    _corrupt(raw, rkey(redis_prefix, "exe", first.executable_id), kind)
    b = make_compiler(None, cache_secret=SECRET, redis=settings())
    again, outs = run_program(b, program_bytes(), "jax_export", ARGS)
    assert again.tier == "compiled"
    np.testing.assert_allclose(outs[0], EXPECTED, rtol=1e-6)
    c = make_compiler(None, cache_secret=SECRET, redis=settings())
    third, _ = run_program(c, program_bytes(), "jax_export", ARGS)
    assert third.tier == "redis"  # the recompiled entry replaced the bad one


@pytest.mark.parametrize("swap", ["as_is", "key_rewritten_and_signed_with_another_secret"])
def test_swapped_entry_is_refused_and_recompiled(make_compiler: Callable[..., Compiler],
                                                 settings: MakeSettings, raw: redis.Redis,
                                                 redis_prefix: str, swap: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Executable X's entry written under Y's key: Y recompiles and answers as Y, never as X."""
    a = make_compiler(None, cache_secret=SECRET, redis=settings())
    x, _ = run_program(a, program_bytes(), "jax_export", ARGS)
    y_key = a.executable_id(a.decode(program_bytes(5.0), "jax_export"))
    x_entry = raw.get(rkey(redis_prefix, "exe", x.executable_id))
    assert x_entry is not None
    if swap != "as_is":  # the best a writer without the secret can do
        x_entry = _resigned(x_entry, x.executable_id, y_key, OTHER_SECRET)
    raw.set(rkey(redis_prefix, "exe", y_key), x_entry)
    raw.hset(rkey(redis_prefix, "meta", y_key), mapping={"executable_id": y_key, "size": "1"})
    b = make_compiler(None, cache_secret=SECRET, redis=settings())
    with caplog.at_level(logging.WARNING, "jitserve.compiler.cache"):
        y, outs = run_program(b, program_bytes(5.0), "jax_export", ARGS)
    assert (y.tier, y.executable_id) == ("compiled", y_key)
    assert "dropping corrupt redis executables entry" in caplog.text
    assert "MAC does not match" in caplog.text
    np.testing.assert_allclose(outs[0], np.tanh(ARGS[0] @ ARGS[1]) * 5.0, rtol=1e-6)
    # The recompile stored Y's own entry: the next process hits it, and X's is untouched.
    c = make_compiler(None, cache_secret=SECRET, redis=settings())
    assert run_program(c, program_bytes(5.0), "jax_export", ARGS)[0].tier == "redis"
    x_again, outs = run_program(c, program_bytes(), "jax_export", ARGS)
    assert x_again.tier == "redis"
    np.testing.assert_allclose(outs[0], EXPECTED, rtol=1e-6)


def test_processes_need_the_same_secret(make_compiler: Callable[..., Compiler],
                                        settings: MakeSettings) -> None:
    """A process with another secret refuses the shared entries: it never runs them."""
    a = make_compiler(None, cache_secret=SECRET, redis=settings())
    assert run_program(a, program_bytes(), "jax_export", ARGS)[0].tier == "compiled"
    other = make_compiler(None, cache_secret=OTHER_SECRET, redis=settings())
    lookup, outs = run_program(other, program_bytes(), "jax_export", ARGS)
    assert lookup.tier == "compiled"
    np.testing.assert_allclose(outs[0], EXPECTED, rtol=1e-6)
    with pytest.raises(ValueError, match="cache_secret"):
        make_compiler(None, redis=settings())  # Redis without a secret: refused at once


def test_concurrent_first_calls_compile_once(make_compiler: Callable[..., Compiler],
                                             settings: MakeSettings) -> None:
    compilers = [make_compiler(None, cache_secret=SECRET, redis=settings()) for _ in range(2)]
    for c in compilers:
        c.warm()
    data = program_bytes(3.0)
    barrier = threading.Barrier(8)
    tiers: list[str] = []
    errors: list[BaseException] = []

    def call(c: Compiler) -> None:
        try:
            barrier.wait()
            tiers.append(run_program(c, data, "jax_export", ARGS)[0].tier)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(compilers[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(c.stats()["compilations"] for c in compilers) == 1
    assert sorted(tiers).count("compiled") == 1 and "redis" in tiers


_HOLDER = """
import sys, time
from jitserve.compiler import CacheSecret
from jitserve.compiler.redis import RedisSettings, RedisTiers
url, prefix, key, lock_ttl = sys.argv[1:5]
tiers = RedisTiers(RedisSettings.from_url(url, prefix=prefix, lock_ttl_s=float(lock_ttl)),
                   CacheSecret.per_process())  # it only locks
lock = tiers.executables.compile_lock(key)  # kept referenced: collecting it would release it
assert lock.__enter__() is True
print("locked", flush=True)
time.sleep(600)
"""


def _hold_lock(url: str, prefix: str, key: str, lock_ttl_s: float) -> subprocess.Popen[str]:
    """A second process that takes ``key``'s compile lock, keeps renewing it, and never ends."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, url, prefix, key, str(lock_ttl_s)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def _stop(holder: subprocess.Popen[str]) -> None:
    holder.kill()
    holder.wait()
    if holder.stdout is not None:
        holder.stdout.close()


def test_killed_lock_holder_lock_expires(make_compiler: Callable[..., Compiler],
                                         settings: MakeSettings, redis_url: str,
                                         redis_prefix: str) -> None:
    c = make_compiler(None, cache_secret=SECRET, redis=settings(lock_ttl_s=1.5, wait_s=60))
    c.warm()
    key = c.executable_id(c.decode(program_bytes(), "jax_export"))
    holder = _hold_lock(redis_url, redis_prefix, key, lock_ttl_s=1.5)
    try:
        result: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: result.update(
            lookup=run_program(c, program_bytes(), "jax_export", ARGS)[0]))
        start = time.monotonic()
        waiter.start()
        time.sleep(3.0)  # longer than the lock's expiry: the holder is renewing it
        assert waiter.is_alive(), "compiled while another live process held the lock"
        holder.send_signal(signal.SIGKILL)
        waiter.join(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        _stop(holder)
    assert result["lookup"].tier == "compiled" and c.stats()["compilations"] == 1
    assert elapsed < 20  # the lock expired; nobody waited out the 60 s limit


def test_waiter_gives_up_after_wait_s(make_compiler: Callable[..., Compiler],
                                      settings: MakeSettings, redis_url: str,
                                      redis_prefix: str) -> None:
    c = make_compiler(None, cache_secret=SECRET, redis=settings(wait_s=1.0))
    key = c.executable_id(c.decode(program_bytes(), "jax_export"))
    holder = _hold_lock(redis_url, redis_prefix, key, lock_ttl_s=30)
    try:
        start = time.monotonic()
        lookup, outs = run_program(c, program_bytes(), "jax_export", ARGS)
        assert time.monotonic() - start >= 1.0
    finally:
        _stop(holder)
    assert lookup.tier == "compiled"
    np.testing.assert_allclose(outs[0], EXPECTED, rtol=1e-6)


# -- Redis failures -------------------------------------------------------------------------


def test_unreachable_at_start_then_comes_up(make_tiers: MakeTiers, tmp_path: Path) -> None:
    port = free_port()
    tiers = make_tiers(f"redis://127.0.0.1:{port}/0", max_backoff_s=0.5)
    tier, connection = tiers.executables, tiers.connection
    assert not connection.available and connection.stats()["state"] == "degraded"
    assert connection.stats()["errors"] >= 1
    start = time.monotonic()
    assert tier.get(a_key()) is None and tiers.programs.get(a_key()) is None
    tier.put(a_key(), fake_entry(a_key()))
    with tier.compile_lock(a_key()) as should_compile:
        assert should_compile
    assert time.monotonic() - start < 0.05  # a dead Redis costs nothing per request
    with pytest.raises(RedisUnavailable):
        tiers.catalog.list_entries()
    with RedisServer(tmp_path / "late", port=port):
        _wait_until(lambda: connection.available)
        tier.put(a_key(), fake_entry(a_key()))
        assert tier.get(a_key()) is not None


def test_redis_killed_mid_run_and_back(make_compiler: Callable[..., Compiler],
                                       settings: MakeSettings,
                                       redis_server: Callable[[], RedisServer]) -> None:
    server = redis_server()
    shared = settings(server.url, max_backoff_s=0.5)
    a = make_compiler(None, redis=shared, cache_secret=SECRET)
    assert run_program(a, program_bytes(), "jax_export", ARGS)[0].tier == "compiled"
    server.kill()
    # Calls keep succeeding: L1 hits, and a fresh process (empty L1) compiles.
    assert run_program(a, program_bytes(), "jax_export", ARGS)[0].tier == "memory"
    b = make_compiler(None, redis=shared, cache_secret=SECRET)
    for scale in (2.0, 4.0):
        lookup, _ = run_program(b, program_bytes(scale), "jax_export", ARGS)
        assert lookup.tier == "compiled"
    assert b.catalog.state == "degraded" and b.catalog.shared_stats()["errors"] >= 1  # type: ignore[index]
    with pytest.raises(CacheUnavailable):  # the listing has no local answer
        b.catalog.page()
    server.start()  # same port, empty (no persistence)
    _wait_until(lambda: b.catalog.state == "ok")
    c = make_compiler(None, redis=shared, cache_secret=SECRET)
    assert run_program(c, program_bytes(5.0), "jax_export", ARGS)[0].tier == "compiled"
    assert run_program(b, program_bytes(5.0), "jax_export", ARGS)[0].tier == "redis"
    assert b.catalog.state == "ok"
