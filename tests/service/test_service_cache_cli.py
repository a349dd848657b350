"""``jitserve cache ls | stats | prune | clear`` against a directory, as subprocesses.

Blobs are plain files at the disk tier's paths with set ages, and one real signed
executable entry for ``ls --meta``. The commands must not import jax.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitserve.compiler.cache import CacheSecret, Entry, encode_entry

pytestmark = pytest.mark.timeout(120)

PROGRAM_ID = "ab" * 32


def _cache(cache_dir: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITSERVE_")}
    done = subprocess.run([sys.executable, "-m", "jitserve.service", "cache", *args,
                           "--cache-dir", str(cache_dir)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _put(root: Path, kind: str, key: str, data: bytes, age: float) -> Path:
    path = root / kind / key[:2] / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (time.time() - age, time.time() - age))
    return path


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """An executable entry signed with the directory's secret, and two program blobs."""
    secret = CacheSecret.in_directory(tmp_path)
    key = "e1" * 32
    meta = {"key": key, "program_id": PROGRAM_ID, "compile_seconds": 0.25,
            "in_avals": [{"shape": [3, 4], "dtype": "float32"}]}
    _put(tmp_path, "executables", key, encode_entry(key, Entry(b"\0" * 1000, meta), secret), 10)
    _put(tmp_path, "programs", "a1" * 32, b"p" * 3000, 30)
    _put(tmp_path, "programs", "a2" * 32, b"p" * 2000, 20)
    return tmp_path


def _kinds(listing: str) -> list[tuple[str, str]]:
    return [(line.split()[0], line.split()[1]) for line in listing.splitlines()[1:]]


def test_ls_lists_least_recently_used_first(cache_dir: Path) -> None:
    assert _kinds(_cache(cache_dir, "ls")) == [
        ("programs", "a1" * 8), ("programs", "a2" * 8), ("executables", "e1" * 8)]


def test_ls_meta_reads_the_signed_entry(cache_dir: Path) -> None:
    last = _cache(cache_dir, "ls", "--meta").splitlines()[-1]
    assert PROGRAM_ID[:16] in last and "0.250" in last and "float32[3,4]" in last.replace(" ", "")


def test_stats_counts_blobs_and_bytes_per_kind(cache_dir: Path) -> None:
    rows = {line.split()[0]: line.split()[1:] for line in _cache(cache_dir, "stats").splitlines()}
    assert rows["programs"] == ["2", "5000"] and rows["executables"][0] == "1"
    assert rows["total"][0] == "3"


def test_prune_evicts_least_recently_used_until_under(cache_dir: Path) -> None:
    assert "removed 1 blobs" in _cache(cache_dir, "prune", "--max-bytes", "4k")
    assert _kinds(_cache(cache_dir, "ls")) == [("programs", "a2" * 8), ("executables", "e1" * 8)]


def test_clear_keeps_the_cache_secret(cache_dir: Path) -> None:
    assert "removed 3 blobs" in _cache(cache_dir, "clear")
    assert _kinds(_cache(cache_dir, "ls")) == []
    assert (cache_dir / "cache-secret").is_file()


def test_the_cache_commands_do_not_import_jax(cache_dir: Path) -> None:
    script = ("import sys; from jitserve.service.cli import main\n"
              f"for args in (['ls', '--meta'], ['stats'], ['prune', '--max-bytes', '1G']):\n"
              f"    assert main(['cache', *args, '--cache-dir', {str(cache_dir)!r}]) == 0\n"
              "assert 'jax' not in sys.modules, 'the cache commands imported jax'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "jitserve.service", "cache", "stats",
                           "--cache-dir", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "nope is not a directory" in done.stderr


def test_the_server_passes_its_disk_bound_to_the_compiler(tmp_path: Path) -> None:
    from jitserve.service.app import make_compiler
    from jitserve.service.settings import Settings

    compiler = make_compiler(Settings(cache_dir=tmp_path, disk_cache_max_bytes=12345))
    try:
        assert compiler.config.disk_max_bytes == 12345
    finally:
        compiler.close()
