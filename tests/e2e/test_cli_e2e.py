"""The ``jitserve`` command against real processes: ``serve --config --warm``, ``warm``, ``bench``.

The module's server reads a config file, flags and the environment, and warms a
manifest whose program is a FIFO: warming cannot end before the test writes the
program's bytes into it, so ``/readyz`` is seen answering 503 ``warming`` first,
whatever the machine's speed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import _serve, wait_ready

pytestmark = pytest.mark.timeout(240)

JITSERVE = [sys.executable, "-m", "jitserve.service"]


@functools.cache  # an export carries its call stack's locations: one export, one program id
def _program() -> bytes:
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b,), np.float32)
    return bytes(jax.export.export(jax.jit(lambda x: jnp.tanh(x) + 1))(spec).serialize())


def _manifest(directory: Path, program_file: str) -> Path:
    manifest = directory / "warm.toml"
    manifest.write_text(f'[[programs]]\nfile = "{program_file}"\n'
                        'signatures = [["float32[8]"], ["float32[16]"]]\n')
    return manifest


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("JITSERVE_") and k != "REDIS_URL"}
    return {**env, "JITSERVE_RUNTIMES": "1", **extra}


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server that warmed a manifest; its ``/readyz`` before and after the warming.

    Its settings come from the environment (``E2E_ENV``: 256 KiB bodies, 120 s
    futures, warning logs), a config file over it, and flags over the file.
    """
    tmp = tmp_path_factory.mktemp("cli")
    os.mkfifo(tmp / "program.fifo")
    manifest = _manifest(tmp, "program.fifo")
    config = tmp / "jitserve.toml"
    config.write_text(f'future_ttl_s = 22\nmax_body_bytes = "16M"\nlog_level = "info"\n'
                      f'warm = "{manifest.name}"\n')
    flags = ["--config", str(config), "--max-body-bytes", "32M"]
    with contextlib.contextmanager(_serve)(tmp, {}, flags) as url:
        before = httpx.get(f"{url}/readyz", timeout=30)
        (tmp / "program.fifo").write_bytes(_program())  # blocks until the server reads it
        wait_ready(url, within_s=120)
        after = httpx.get(f"{url}/readyz", timeout=30)
        yield {"url": url, "log": tmp / "server.log", "before": before, "after": after}


def test_readyz_says_warming_until_the_manifest_compiled(warmed: dict[str, Any]) -> None:
    before, after = warmed["before"], warmed["after"]
    assert before.status_code == 503
    error = before.json()["error"]
    assert error["code"] == "not_ready" and error["message"] == "not ready: warming"
    assert error["checks"]["warming"] is False
    assert error["warming"] == {"done": 0, "total": 2, "failed": 0, "finished": False}
    assert after.status_code == 200
    assert after.json()["warming"] == {"done": 2, "total": 2, "failed": 0, "finished": True}
    with httpx.Client(base_url=warmed["url"], timeout=60) as http:
        pid = http.post("/v1/programs", content=_program()).json()["program_id"]
        r = http.post(f"/v1/programs/{pid}/compile",
                      json={"in_avals": [{"shape": [16], "dtype": "float32"}]})
    assert r.status_code == 200 and r.json()["tier"] == "memory"  # warmed: no compile
    assert "warmed 2 executables" in warmed["log"].read_text()


def test_flags_beat_the_file_which_beats_the_environment(warmed: dict[str, Any]) -> None:
    log = warmed["log"].read_text()
    assert "future_ttl_s=22.0" in log  # the file's, not the environment's 120
    assert f"max_body_bytes={32 << 20}" in log  # the flag's, not the file's 16M
    assert "jitserve ready" in log  # info, the file's level, not the environment's warning


def test_warm_fills_the_disk_tier(tmp_path: Path) -> None:
    (tmp_path / "p.export").write_bytes(_program())
    cache = tmp_path / "cache"
    manifest = _manifest(tmp_path, "p.export")
    fast = {"xla_cpu_enable_fast_math": True}  # calls that give these find their own
    manifest.write_text(manifest.read_text() + '[[programs]]\nfile = "p.export"\n'
                        'signatures = [["float32[16]"]]\n'
                        'compiler_options = {xla_cpu_enable_fast_math = true}\n')
    run = subprocess.run([*JITSERVE, "warm", str(manifest), "--cache-dir", str(cache)],
                         capture_output=True, text=True, env=_env(), timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count(" compiled ") == 3 and "warmed 3 of 3 executables" in run.stdout
    listed = subprocess.run([*JITSERVE, "cache", "ls", "--cache-dir", str(cache)],
                            capture_output=True, text=True, env=_env(), timeout=60).stdout
    assert sum(line.startswith("executables") for line in listed.splitlines()) == 3
    # With API keys, each key's executables are its own; those the operator warmed
    # serve every key (they say nothing about another key's calls).
    key = "warm-test-key-0123456789"
    with contextlib.contextmanager(_serve)(tmp_path, {"JITSERVE_API_KEYS": key}) as url, \
            httpx.Client(base_url=url, timeout=60,
                         headers={"authorization": f"Bearer {key}"}) as http:
        pid = http.post("/v1/programs", content=_program()).json()["program_id"]
        r = http.post(f"/v1/programs/{pid}/compile",
                      json={"in_avals": [{"shape": [16], "dtype": "float32"}]})
        assert r.status_code == 200 and r.json()["tier"] == "disk", r.text
        r = http.post(f"/v1/programs/{pid}/compile",
                      json={"in_avals": [{"shape": [16], "dtype": "float32"}],
                            "compiler_options": fast})
        assert r.status_code == 200 and r.json()["tier"] == "disk", r.text


def test_warm_refuses_a_bad_manifest_before_starting(tmp_path: Path) -> None:
    run = subprocess.run([*JITSERVE, "warm", str(_manifest(tmp_path, "absent.export")),
                          "--cache-dir", str(tmp_path / "cache")], capture_output=True,
                         text=True, env=_env(), timeout=60)
    assert run.returncode == 2 and "no program file" in run.stderr


def test_bench_measures_latency_and_transfer(warmed: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([*JITSERVE, "bench", warmed["url"], "--calls", "20", "--in-flight", "8",
                          "--mib", "4", "--repeat", "2", "--json", str(out)], capture_output=True,
                         text=True, env=_env(), timeout=180)
    assert run.returncode == 0, run.stderr
    for line in ("P1 cached call, msgpack", "P1 baseline, GET /healthz", "P2 20 calls, 8 in flight",
                 "P4 download 4 MiB", "cache (local)", "bench/redis_cache.py"):
        assert line in run.stdout, run.stdout
    figures = json.loads(out.read_text())
    baseline = figures["P1"]["baseline"]
    assert baseline["endpoint"] == "GET /healthz" and 0 < baseline["p50_ms"] <= baseline["p99_ms"]
    for encoding in ("msgpack", "json"):
        p1 = figures["P1"][encoding]
        assert p1["calls"] == 20 and 0 < p1["p50_ms"] <= p1["p99_ms"]
        assert p1["over_baseline_p50"] == pytest.approx(p1["p50_ms"] / baseline["p50_ms"])
    p2 = figures["P2"]
    assert (p2["in_flight"], p2["calls"]) == (8, 20)
    assert p2["calls_per_s"] > 0 and p2["sequential_calls_per_s"] > 0
    assert p2["over_sequential"] == pytest.approx(p2["calls_per_s"] / p2["sequential_calls_per_s"])
    assert p2["over_baseline"] == pytest.approx(p2["calls_per_s"] / p2["baseline"]["calls_per_s"])
    cache = figures["cache"]
    assert cache["mode"] == "local" and cache["misses"] >= 1  # the bench program compiled once
    assert cache["hits"]["memory"] >= 2 * 20 + 20 and set(cache["hits"]) >= {"memory", "disk"}
    p4 = figures["P4"]
    assert p4["bytes"] == 4 << 20
    assert p4["upload_gbps"]["best"] > 0 and p4["download_gbps"]["best"] > 0
