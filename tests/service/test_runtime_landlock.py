"""Runtimes may change files only where they must: Landlock (``service/runtimes/landlock``).

``confine`` is checked in a fresh interpreter (a Landlock ruleset cannot be
lifted, and would bind this test process for good); the runtime test checks that
the session's real runtime process runs confined and still serves programs.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jitserve import wire
from jitserve.service.runtimes import RuntimePool, landlock, platform_kind

pytestmark = pytest.mark.timeout(120)

_SCRIPT = r"""
import os, sys
from pathlib import Path
from jitserve.service.runtimes.landlock import confine

allowed, other, outside = map(Path, sys.argv[1:])
where = confine([allowed])
assert where and str(allowed) in where, where

(allowed / "new").write_text("made")  # creating and writing where allowed works
(allowed / "new").unlink()

def denied(what, fn):
    try:
        fn()
    except PermissionError:
        return
    raise AssertionError(f"{what} was allowed")

denied("creating a file elsewhere", lambda: (other / "new").write_text("x"))
denied("writing a file outside", lambda: open(outside, "r+b"))
denied("appending to a file outside", lambda: open(outside, "ab"))
denied("removing a file outside", lambda: outside.unlink())
denied("making a directory outside", lambda: (other / "dir").mkdir())
assert outside.read_text() == "outside", "reading outside must still work"
assert sorted(os.listdir(other)) == [outside.name]
print("confined:", where)
"""


def test_confine_allows_writes_only_beneath_the_given_directories(tmp_path: Path) -> None:
    if landlock.abi_version() == 0:
        pytest.skip("the kernel has no Landlock (Linux 5.13+ with landlock in lsm=)")
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    outside = other / "file"
    outside.write_text("outside")
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(allowed), str(other), str(outside)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("confined: Landlock ABI"), done.stdout
    # Nothing the confined process tried outside happened.
    assert outside.read_text() == "outside"
    assert sorted(p.name for p in other.iterdir()) == ["file"]


async def test_runtimes_run_confined_and_still_serve(runtimes: RuntimePool, api, x) -> None:
    if landlock.abi_version() == 0:
        pytest.skip("the kernel has no Landlock (Linux 5.13+ with landlock in lsm=)")
    if platform_kind() != "cpu":
        pytest.skip("runtimes are confined on CPU only")
    (runtime,) = runtimes.describe()
    status = Path(f"/proc/{runtime['pid']}/status").read_text()
    assert "NoNewPrivs:\t1" in status
    # A compile (into the disk tier) and a run with outputs big enough for a /dev/shm
    # segment: both directories the runtime may write to are in use.
    pid = await api.upload("big")
    big = np.arange(1 << 18, dtype=np.float32)
    r = await api.execute(pid, [big], wait=60_000)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], big + 1)
    r = await api.execute(await api.upload("add_mul"), [x, x], wait=60_000)
    assert r.status_code == 200, r.text
    cache_dir = Path(runtimes.child_config(0)["settings"]["cache_dir"])
    deadline = time.monotonic() + 10
    while not any(p.is_file() and p.name != "cache-secret" for p in cache_dir.rglob("*")):
        assert time.monotonic() < deadline, "the runtime wrote nothing into its disk tier"
        await asyncio.sleep(0.1)
