"""Open Inference Protocol benchmark (issue 15): jitserve vs MLServer through tritonclient.

The same tiny model, ``sin(x) * 2 + 1`` on float32[1, 1024], is served by jitserve
(a ``jax.export`` program uploaded with ``?name=tiny``) and by MLServer (a numpy
``MLModel``, bench/_mlserver_model.py), both up in one run on the same machine, each
with its defaults, and driven by the same tritonclient code in rounds that take
turns between the servers (3 rounds; their samples are pooled):

  latency      p50 and p99 of one request at a time (concurrency 1)
  throughput   requests per second with 16 in flight (tritonclient's asyncio clients)

over REST with JSON tensors (MLServer does not read the binary tensor extension)
and over gRPC with raw tensor contents. Every figure is printed beside MLServer's
and as a ratio (jitserve / MLServer: below 1 is faster for latency, above 1 is
faster for throughput), and written to bench/results/v2_protocol.json. jitserve's
REST with binary tensors is measured too, without a counterpart.

MLServer is not a dependency of jitserve: it runs from its own venv
(``--mlserver-venv``, default ~/.cache/jitserve-bench/mlserver-venv), which this
script creates with ``pip install mlserver 'uvloop<0.22'`` when it is missing
(``--no-install`` refuses instead and says the command).

Run: ``.venv/bin/python bench/v2_protocol.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
import tritonclient.http.aio as thttp_aio

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file

from _servers import free_port, jitserve  # noqa: E402

BENCH = Path(__file__).resolve().parent
MODEL = "tiny"
SHAPE = (1, 1024)
DEFAULT_VENV = Path.home() / ".cache" / "jitserve-bench" / "mlserver-venv"
# MLServer 1.7.1's inference workers fail to start with uvloop 0.22+ ("There is no
# current event loop", SeldonIO/MLServer#2286); the older uvloop keeps its defaults.
MLSERVER_PACKAGES = ("mlserver", "uvloop<0.22")
# tritonclient's asyncio client sends no Content-Type, which MLServer refuses (422). A
# fresh copy each call: tritonclient adds Inference-Header-Content-Length to the dict.
JSON = {"Content-Type": "application/json"}


def tiny(x):  # noqa: ANN001, ANN201 - the same function as bench/_mlserver_model.py
    return jnp.sin(x) * 2.0 + 1.0


def export_tiny() -> bytes:
    spec = jax.ShapeDtypeStruct(SHAPE, np.float32)
    return bytes(jax.export.export(jax.jit(tiny))(spec).serialize())


# -- servers -------------------------------------------------------------------------

def mlserver_venv(path: Path, install: bool) -> Path:
    """The ``mlserver`` command of the venv at ``path``, installing it there if allowed."""
    command = path / "bin" / "mlserver"
    if command.exists():
        return command
    how = f"python3 -m venv {path} && {path}/bin/pip install {' '.join(MLSERVER_PACKAGES)}"
    if not install:
        sys.exit(f"MLServer is not installed in {path}; install it with:\n    {how}")
    print(f"installing MLServer into {path} ({how}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([str(path / "bin" / "pip"), "install", "-q", *MLSERVER_PACKAGES], check=True)
    return command


@contextlib.contextmanager
def mlserver(command: Path) -> Iterator[tuple[str, int]]:
    """MLServer serving the numpy model on free ports: ``(base URL, gRPC port)``."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root)
        (folder / "settings.json").write_text(json.dumps({
            "http_port": http_port, "grpc_port": grpc_port, "metrics_port": metrics_port,
            "host": "127.0.0.1", "debug": False}))
        (folder / "model-settings.json").write_text(json.dumps({
            "name": MODEL, "implementation": "_mlserver_model.TinyModel"}))
        env = {**os.environ, "PYTHONPATH": str(BENCH)}
        log = (folder / "mlserver.log").open("wb")
        proc = subprocess.Popen([str(command), "start", str(folder)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{http_port}"
        try:
            _wait_ready(url, proc, folder / "mlserver.log")
            yield url, grpc_port
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path,
                timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"MLServer exited with {proc.returncode}:\n"
                               f"{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v2/models/{MODEL}/ready", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"MLServer did not get ready:\n{log.read_text()[-3000:]}")


# -- measurements ----------------------------------------------------------------------

def _http_inputs(module: Any, x: np.ndarray, binary: bool) -> tuple[list[Any], list[Any]]:
    tensor = module.InferInput("input_0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return [tensor], [module.InferRequestedOutput("output_0", binary_data=binary)]


def _grpc_inputs(module: Any, x: np.ndarray) -> tuple[list[Any], list[Any]]:
    tensor = module.InferInput("input_0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return [tensor], [module.InferRequestedOutput("output_0")]


def latency(call: Callable[[], np.ndarray], n: int, want: np.ndarray) -> list[float]:
    """Seconds of each of ``n`` calls made one at a time (after a checked warm-up)."""
    for _ in range(max(10, n // 10)):
        np.testing.assert_allclose(call(), want, rtol=1e-5, atol=1e-5)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return times


async def throughput(call: Callable[[], Awaitable[Any]], total: int, in_flight: int) -> float:
    """Requests per second with ``in_flight`` at once, ``total`` in all (after a warm-up)."""
    async def worker(count: int) -> None:
        for _ in range(count):
            await call()

    await asyncio.gather(*(worker(2) for _ in range(in_flight)))
    t = time.perf_counter()
    share, extra = divmod(total, in_flight)
    await asyncio.gather(*(worker(share + (i < extra)) for i in range(in_flight)))
    return total / (time.perf_counter() - t)


def measure_http(host: str, x: np.ndarray, want: np.ndarray, n: int, total: int,
                 binary: bool = False) -> tuple[list[float], float]:
    with thttp.InferenceServerClient(host, concurrency=1) as c:
        inputs, outputs = _http_inputs(thttp, x, binary)
        times = latency(lambda: c.infer(MODEL, inputs, outputs=outputs, headers=dict(JSON))
                        .as_numpy("output_0"), n, want)

    async def run() -> float:
        async with thttp_aio.InferenceServerClient(host, conn_limit=16) as ac:
            inputs, outputs = _http_inputs(thttp_aio, x, binary)
            return await throughput(lambda: ac.infer(MODEL, inputs, outputs=outputs,
                                                     headers=dict(JSON)), total, 16)

    return times, asyncio.run(run())


def measure_grpc(target: str, x: np.ndarray, want: np.ndarray, n: int,
                 total: int) -> tuple[list[float], float]:
    with tgrpc.InferenceServerClient(target) as c:
        inputs, outputs = _grpc_inputs(tgrpc, x)
        times = latency(lambda: c.infer(MODEL, inputs, outputs=outputs).as_numpy("output_0"),
                        n, want)

    async def run() -> float:
        async with tgrpc_aio.InferenceServerClient(target) as ac:
            inputs, outputs = _grpc_inputs(tgrpc_aio, x)
            return await throughput(lambda: ac.infer(MODEL, inputs, outputs=outputs), total, 16)

    return times, asyncio.run(run())


class Samples:
    """Latencies and throughputs of one server and protocol, pooled over rounds."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.rps: list[float] = []

    def add(self, measured: tuple[list[float], float]) -> None:
        self.times += measured[0]
        self.rps.append(measured[1])

    def summary(self) -> dict[str, float]:
        q = statistics.quantiles(self.times, n=100)
        return {"p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
                "rps_16": statistics.median(self.rps)}


def rounds(servers: dict[str, tuple[str, int]], n: int, total: int,
           repeat: int) -> dict[str, dict[str, dict[str, float]]]:
    """Each server and protocol measured ``repeat`` times, servers taking turns, so that
    a noisy neighbour on the machine weighs on both alike."""
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    want = np.asarray(jax.jit(tiny)(x))
    samples: dict[str, dict[str, Samples]] = {}
    for r in range(repeat):
        for name, (url, grpc_port) in servers.items():
            mine = samples.setdefault(name, {})
            host = url.removeprefix("http://")
            mine.setdefault("rest_json", Samples()).add(measure_http(host, x, want, n, total))
            mine.setdefault("grpc", Samples()).add(
                measure_grpc(f"127.0.0.1:{grpc_port}", x, want, n, total))
            if name == "jitserve":  # MLServer does not read binary tensors
                mine.setdefault("rest_binary", Samples()).add(
                    measure_http(host, x, want, n, total, binary=True))
            print(f"round {r + 1}/{repeat}: {name} done", flush=True)
    return {name: {proto: s.summary() for proto, s in mine.items()}
            for name, mine in samples.items()}


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    return {proto: {k: ours[proto][k] / theirs[proto][k] for k in theirs[proto]}
            for proto in theirs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer requests, one round")
    parser.add_argument("--mlserver-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--no-install", action="store_true",
                        help="do not install MLServer; say how instead")
    args = parser.parse_args()
    n, total, repeat = (200, 800, 1) if args.quick else (500, 2000, 3)
    command = mlserver_venv(args.mlserver_venv, install=not args.no_install)
    results: dict[str, Any] = {"machine": {"cpus": len(os.sched_getaffinity(0))},
                               "model": f"sin(x) * 2 + 1 on float32{list(SHAPE)}",
                               "requests_per_round": {"latency": n, "throughput": total},
                               "rounds": repeat}
    grpc_port = free_port()
    with jitserve(JITSERVE_GRPC_PORT=str(grpc_port)) as (url, _), mlserver(command) as ml:
        r = httpx.post(f"{url}/v1/programs", params={"name": MODEL}, content=export_tiny(),
                       timeout=60)
        r.raise_for_status()
        results["mlserver_version"] = httpx.get(f"{ml[0]}/v2", timeout=10).json().get("version")
        results.update(rounds({"jitserve": (url, grpc_port), "mlserver": ml}, n, total, repeat))
    results["ratio_jitserve_over_mlserver"] = ratios(results["jitserve"], results["mlserver"])
    for key in ("jitserve", "mlserver", "ratio_jitserve_over_mlserver"):
        print(key, json.dumps(results[key], indent=1))
    out = BENCH / "results" / "v2_protocol.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
