"""Start and stop server processes for benchmarks: jitserve, and a minimal baseline."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"server at {url} did not become healthy")


@contextlib.contextmanager
def process(argv: list[str], url: str,
            env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def jitserve(**env: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``jitserve serve`` on a free loopback port with a fresh cache dir."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as cache:
        argv = [sys.executable, "-m", "jitserve.service", "serve", "--host", "127.0.0.1",
                "--port", str(port), "--cache-dir", cache, "--log-level", "warning"]
        with process(argv, url, env) as proc:
            yield url, proc


@contextlib.contextmanager
def baseline(app: str = "app", **env: str) -> Iterator[str]:
    """The hand-written minimal FastAPI endpoint (bench/_baseline_app.py) under uvicorn;
    ``app="asgi_app"``: the same endpoints as plain ASGI, without FastAPI."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "uvicorn", f"_baseline_app:{app}", "--app-dir", str(BENCH),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with process(argv, url, env):
        yield url


def write_results(name: str, results: object) -> Path:
    """Write ``results`` to ``bench/results/<name>.json`` and say so."""
    out = BENCH / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return out


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0



def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid``, and of its children alive now
    (a jitserve server's runtimes)."""
    def of(p: int) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    # each thread lists the children it started (jitserve's runtimes: their supervisors)
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    return of(pid), sum(of(c) for c in children)


def requests_by_route(url: str) -> dict[str, float]:
    """Requests the server at ``url`` has answered, by route template (all statuses;
    ``/metrics`` itself left out), from ``jitserve_requests_total`` on ``/metrics``."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith('jitserve_requests_total{route="'):
            route = line.split('"', 2)[1]
            if route != "/metrics":
                counts[route] = counts.get(route, 0.0) + float(line.rpartition(" ")[2])
    return counts
