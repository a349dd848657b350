"""``jitserve cache prune`` and ``clear`` while a real server uses the same directory.

The server keeps one executable in memory (``JITSERVE_L1_MAX_ENTRIES=1``), so two
functions called in turn go to the disk each time; once the disk is emptied under
it, the server misses, recompiles and still answers right.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from jitserve.client import Client

pytestmark = pytest.mark.timeout(240)


def _compilations(url: str) -> float:
    found = re.search(r"^jitserve_compilations_total\s+([0-9.e+]+)$",
                      httpx.get(f"{url}/metrics").text, flags=re.M)
    return float(found.group(1)) if found else 0.0


def _cache(cache_dir: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "jitserve.service", "cache", *args,
                    "--cache-dir", str(cache_dir)], check=True, capture_output=True, timeout=60)


@pytest.mark.parametrize("command", [("prune", "--max-bytes", "0"), ("clear",)],
                         ids=["prune", "clear"])
def test_the_server_recompiles_what_the_command_removed(
        start_server: Callable[..., str], tmp_path: Path, command: tuple[str, ...]) -> None:
    url = start_server({"JITSERVE_L1_MAX_ENTRIES": "1"}, "server")
    cache_dir = tmp_path / "server" / "cache"
    x = np.arange(6.0, dtype=np.float32)
    with Client(url, timeout=120) as client:
        double, shift = client.jit(lambda v: v * 2), client.jit(lambda v: v + 1)

        def call_both() -> None:
            np.testing.assert_allclose(np.asarray(double(x)), x * 2)
            np.testing.assert_allclose(np.asarray(shift(x)), x + 1)

        call_both()
        assert any((cache_dir / "executables").rglob("*"))
        before = _compilations(url)
        _cache(cache_dir, *command)
        assert not [p for p in (cache_dir / "executables").rglob("*") if p.is_file()]
        call_both()  # each misses L1 and the emptied disk: compiled again
        assert _compilations(url) >= before + 2
    assert (cache_dir / "cache-secret").is_file()
