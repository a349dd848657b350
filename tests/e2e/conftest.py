"""End-to-end fixtures: real ``jitserve serve`` processes on free local ports.

``server_url`` is one server for the whole session; ``auth_server_url`` a second
one started only if a test asks for it, with API keys configured; ``start_server``
starts more for one test (e.g. several processes sharing one Redis). Each runs with
its own cache directory and logs to a file that is printed if it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

AUTH_KEYS = ("e2e-alice-key-0123456789", "e2e-bob-key-0123456789")
E2E_ENV = {
    # Small enough that the bad-input tests can exceed it cheaply.
    "JITSERVE_MAX_BODY_BYTES": str(256 * 1024),
    "JITSERVE_FUTURE_TTL_S": "120",
    "JITSERVE_EXECUTOR_THREADS": "2",
    "JITSERVE_LOG_LEVEL": "warning",
    # One runtime process each (tests that need more say so): this machine has 2 cores.
    "JITSERVE_RUNTIMES": "1",
    # Replicas (with Redis) keep unfetched results for this long after SIGTERM; the
    # tests that drain say how long they want.
    "JITSERVE_DRAIN_TIMEOUT_S": "1",
}


# The server's interpreter: this one, or (for the SDK's tests on another jax, .ci/jax-range)
# the project's own venv with the server's pinned jax.
SERVER_PYTHON = os.environ.get("JITSERVE_TEST_SERVER_PYTHON") or sys.executable


#: Debian's chromium (apt-get install chromium), for the pages' browser checks.
CHROMIUM = (os.environ.get("JITSERVE_TEST_CHROMIUM") or shutil.which("chromium")
            or shutil.which("chromium-browser"))


def chromium(tmp_path: Path, *args: str, budget_ms: int = 20000,
             window: str = "1280,3000") -> subprocess.CompletedProcess[str]:
    """Headless Chromium on ``args`` (``--dump-dom URL``, ``--screenshot=F URL``): it
    resolves no host but 127.0.0.1, so a page that reached elsewhere would show it."""
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
           "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
           f"--user-data-dir={tmp_path / 'profile'}", "--proxy-server=direct://",
           "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
           f"--virtual-time-budget={budget_ms}", f"--window-size={window}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"jitserve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"jitserve did not become healthy in {timeout_s} s:\n{log.read_text()[-4000:]}")


def _serve(tmp: Path, extra_env: dict[str, str], args: Sequence[str] = ()) -> Iterator[str]:
    with server_process(tmp, extra_env, args) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(tmp: Path, extra_env: dict[str, str], args: Sequence[str] = (),
                   wrapper: Sequence[str] = ()) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A healthy ``jitserve serve`` (its log in ``tmp/server.log``): its url and process.
    SIGTERMed (a drain) at the end, and SIGKILLed if it has not exited 20 s later.
    ``wrapper``: a command that runs the server's (its arguments), and becomes it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("JITSERVE_") and k != "REDIS_URL"}
    env.update(E2E_ENV, **extra_env)
    cmd = [*wrapper, SERVER_PYTHON, "-m", "jitserve.service", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--cache-dir", str(tmp / "cache"), *args]
    log = tmp / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(url, proc, log, timeout_s=90)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def wait_ready(url: str, within_s: float = 60) -> list[dict[str, Any]]:
    """``/readyz``'s runtimes once it answers 200; fails the test if not within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/readyz", timeout=10)
        if r.status_code == 200:
            return r.json()["runtimes"]
        time.sleep(0.1)
    pytest.fail(f"not ready again within {within_s} s: {r.text}")


def api_loads_jax(url: str) -> list[str]:
    """The jax and jaxlib files mapped into the API process of the server at ``url``:
    none, since it never decodes, lowers, compiles or runs a program (``compiler.records``).
    Found as the parent of its runtimes, whose pids ``/readyz`` lists."""
    runtime = wait_ready(url)[0]["pid"]
    api = Path(f"/proc/{runtime}/stat").read_text().rpartition(")")[2].split()[1]
    maps = Path(f"/proc/{api}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if "/jax" in line})


def metric_total(url: str, name: str) -> float:
    """The sum of the samples of ``name`` on ``/metrics``, over all its labels."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name or key.startswith(name + "{"):
            total += float(value)
    return total


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real jitserve process without auth."""
    yield from _serve(tmp_path_factory.mktemp("jitserve"), {})


@pytest.fixture(scope="session")
def auth_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real jitserve process that requires one of ``AUTH_KEYS``."""
    yield from _serve(tmp_path_factory.mktemp("jitserve-auth"),
                      {"JITSERVE_API_KEYS": ",".join(AUTH_KEYS)})


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """A factory of extra jitserve processes for one test: ``start(env, name)`` -> base URL.

    Each has its own cache directory under ``tmp_path / name``; all are stopped
    at the end of the test.
    """
    with contextlib.ExitStack() as stack:
        def start(env: dict[str, str], name: str = "server") -> str:
            (tmp_path / name).mkdir()
            return stack.enter_context(contextlib.contextmanager(_serve)(tmp_path / name, env))

        yield start


@pytest.fixture
def http(server_url: str) -> Iterator[httpx.Client]:
    """A plain httpx client on the server."""
    with httpx.Client(base_url=server_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def auth_keys() -> tuple[str, ...]:
    """The API keys ``auth_server_url`` accepts."""
    return AUTH_KEYS
