"""The bounded disk tier: past ``disk_max_bytes`` the least recently used blobs go.

A real ``Compiler`` with a bound of three and a half entries: a disk hit marks an
entry used, the fourth put evicts the oldest one, and a lookup of that one
recompiles. ``compiler.disk`` alone (no jax) is checked on plain files.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

from jitserve.compiler import Compiler, Program
from jitserve.compiler.disk import DiskBudget, prune, scan

pytestmark = pytest.mark.timeout(180)

MakeCompiler = Callable[..., Compiler]
X = np.arange(4, dtype=np.float32)


def _program_bytes(k: int) -> bytes:
    spec = jax.ShapeDtypeStruct(X.shape, X.dtype)
    return bytes(jax.export.export(jax.jit(lambda x: x * 2.0 + k))(spec).serialize())


@pytest.fixture(scope="module")
def programs() -> list[bytes]:
    return [_program_bytes(k) for k in range(4)]


def _run(c: Compiler, program: Program, k: int) -> str:
    lookup = c.lookup(program)
    (out,) = lookup.executable.run([jax.device_put(X, c.device)])
    np.testing.assert_allclose(np.asarray(out), X * 2.0 + k)
    return lookup.tier


def _exe(root: Path, key: str) -> Path:
    return root / "executables" / key[:2] / key


def test_a_full_disk_tier_evicts_the_least_recently_used(
        make_compiler: MakeCompiler, tmp_path: Path, programs: list[bytes]) -> None:
    first = make_compiler(tmp_path, l1_max_entries=1)
    p0 = first.decode(programs[0])
    assert _run(first, p0, 0) == "compiled"
    size = _exe(tmp_path, first.executable_id(p0)).stat().st_size
    # Room for three entries and a half; L1 holds one, so lookups go to the disk.
    c = make_compiler(tmp_path, l1_max_entries=1, disk_max_bytes=int(size * 3.5))
    progs = [c.decode(data) for data in programs]
    keys = [c.executable_id(p) for p in progs]
    assert [_run(c, progs[k], k) for k in (1, 2)] == ["compiled", "compiled"]
    now = time.time()
    for age, key in zip((300, 200, 100), keys[:3]):  # p0 oldest, then p1, then p2
        os.utime(_exe(tmp_path, key), (now - age, now - age))
    assert _run(c, progs[0], 0) == "disk"  # a hit: p0 is now the most recent
    assert _run(c, progs[3], 3) == "compiled"  # over the bound: p1, least recent, goes
    assert [_exe(tmp_path, key).exists() for key in keys] == [True, False, True, True]
    compilations = c.stats()["compilations"]
    assert _run(c, progs[1], 1) == "compiled"  # a lookup after eviction recompiles
    assert c.stats()["compilations"] == compilations + 1
    assert sum(e.size for e in scan(tmp_path)) <= size * 3.5


def _blob(root: Path, kind: str, n: int, size: int, age: float) -> Path:
    key = f"{n:064x}"
    path = root / kind / key[:2] / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_scan_and_prune_go_least_recently_used_first(tmp_path: Path) -> None:
    paths = [_blob(tmp_path, kind, n, 100, age)
             for n, (kind, age) in enumerate([("executables", 10), ("programs", 30),
                                              ("executables", 20)])]
    (tmp_path / "executables" / "00" / ".tmp-abc").write_bytes(b"partial")  # a write in progress
    assert [e.path for e in scan(tmp_path)] == [paths[1], paths[2], paths[0]]
    assert prune(tmp_path, 150) == (100, 2)
    assert [p.exists() for p in paths] == [True, False, False]


def test_a_budget_counts_at_start_and_evicts_below_its_bound(tmp_path: Path) -> None:
    for n in range(5):
        _blob(tmp_path, "executables", n, 100, age=100 - n)
    budget = DiskBudget(tmp_path, max_bytes=600, low_water=0.5)
    assert budget.total == 500
    budget.added(200)  # another blob written: 700 > 600, evict down to 300
    assert budget.total == 300 and budget.evictions == 2
    assert [e.key[-1] for e in scan(tmp_path)] == ["2", "3", "4"]


def test_a_budget_refuses_a_bound_of_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        DiskBudget(tmp_path, max_bytes=0)
