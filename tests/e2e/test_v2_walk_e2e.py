"""The Open Inference Protocol with runtimes killed under it: every inference ends, and says how.

Threads send inferences through tritonclient's gRPC client and over REST to a real
server with two runtimes, some to a model whose run takes tens of milliseconds, while
another thread SIGKILLs a runtime at random, again and again. For each inference:

- it answers within its client's timeout (nothing waits forever);
- an answer is the right one (``jax.jit``'s, on this side);
- a refusal names the runtime that crashed under it: ``runtime_crashed`` (gRPC
  UNAVAILABLE, REST its HTTP status) for a run that had begun (one that had not goes
  again), or, for a lookup (a runtime compiles or loads a model on its first
  inference) that lost its runtime twice, ``compile_failed``: the server takes a
  request that crashes two processes for the cause (``Runtime.request``'s retry);
- afterwards the server is healthy and ready, and holds no future of any of them.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tritonclient.grpc as triton
from e2e.conftest import _free_port, _serve, metric_total, wait_ready
from e2e.v2_programs import upload
from jax import export
from tritonclient.utils import InferenceServerException

from jitserve.service.v2.errors import GRPC_STATUS
from jitserve.wire import ErrorCode

pytestmark = pytest.mark.timeout(300)

# How a refusal names the loss: the crash, or a request written as the process died.
CRASHED = re.compile(r"runtime \d+ (crashed with SIGKILL|exited before it took the request)")


def slow(x: jax.Array) -> jax.Array:
    """A tenth of a second or so of matrix products: runs a kill lands in."""
    return jax.lax.fori_loop(0, 600, lambda _, a: jnp.tanh(a @ a) * 0.5, x)


def quick(x: jax.Array) -> jax.Array:
    return x * 2 + 1


MODELS = {"slow": (slow, (128, 128)), "quick": (quick, (2, 3))}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    port = _free_port()
    tmp: Path = tmp_path_factory.mktemp("v2-walk")
    for url in _serve(tmp, {"JITSERVE_GRPC_PORT": str(port), "JITSERVE_RUNTIMES": "2",
                          "JITSERVE_MAX_BODY_BYTES": str(4 << 20)}):
        for name, (fn, shape) in MODELS.items():
            spec = jax.ShapeDtypeStruct(shape, np.float32)
            upload(url, bytes(export.export(jax.jit(fn))(spec).serialize()), name)
        wait_ready(url)
        yield url, port


def _one(rng: random.Random, url: str, grpc: triton.InferenceServerClient | None
         ) -> tuple[str, str]:
    """One inference at random: ``("ok", "")``, or the refusal's ``(kind, message)``."""
    name = rng.choice(list(MODELS))
    fn, shape = MODELS[name]
    x = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(shape).astype(np.float32)
    want = np.asarray(jax.jit(fn)(x))
    if grpc is not None:
        tensor = triton.InferInput("input_0", list(shape), "FP32")
        tensor.set_data_from_numpy(x)
        try:
            got = grpc.infer(name, [tensor], client_timeout=60).as_numpy("output_0")
        except InferenceServerException as e:
            return str(e.status()), str(e.message())
    else:
        body = {"inputs": [{"name": "input_0", "shape": list(shape), "datatype": "FP32",
                            "data": x.ravel().tolist()}]}
        r = httpx.post(f"{url}/v2/models/{name}/infer", json=body, timeout=60)
        if r.status_code != 200:
            return str(r.status_code), r.text
        out = r.json()["outputs"][0]
        got = np.asarray(out["data"], np.float32).reshape(out["shape"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    return "ok", ""


def test_every_inference_ends_right_or_naming_the_crash_under_it(
        server: tuple[str, int]) -> None:
    url, port = server
    futures_before = metric_total(url, "jitserve_futures")
    stop = threading.Event()
    seen: list[tuple[str, str]] = []
    failures: list[BaseException] = []

    def send(seed: int, over_grpc: bool) -> None:
        rng = random.Random(seed)
        client = triton.InferenceServerClient(f"127.0.0.1:{port}") if over_grpc else None
        try:
            while not stop.is_set():
                seen.append(_one(rng, url, client))
        except BaseException as e:  # noqa: BLE001 - judged below, on the test's thread
            failures.append(e)
        finally:
            if client is not None:
                client.close()

    senders = [threading.Thread(target=send, args=(i, i != 2)) for i in range(3)]
    for t in senders:
        t.start()
    rng = random.Random(0)
    kills = 0
    try:
        # Each once the last one killed is back, a moment later; at least five, and on
        # until one lands on a run that had begun (a kill between runs loses nothing:
        # what was queued there goes again), at most twenty.
        while kills < 5 or (kills < 20 and all(kind == "ok" for kind, _ in list(seen))):
            victim = rng.choice(wait_ready(url))
            time.sleep(rng.uniform(0.3, 1.0))
            os.kill(victim["pid"], signal.SIGKILL)
            kills += 1
            deadline = time.monotonic() + 60
            while any(r["index"] == victim["index"] and r["pid"] == victim["pid"]
                      for r in wait_ready(url)):
                assert time.monotonic() < deadline, "the runtime killed never came back"
                time.sleep(0.05)
        time.sleep(1)
    finally:
        stop.set()
        for t in senders:
            t.join(120)
    assert not failures, failures[0]
    assert not any(t.is_alive() for t in senders)  # every inference answered
    refused = [(kind, message) for kind, message in seen if kind != "ok"]
    for kind, message in refused:
        assert CRASHED.search(message), (kind, message)
        code = ErrorCode.COMPILE_FAILED if "compiling" in message else ErrorCode.RUNTIME_CRASHED
        assert kind in (f"StatusCode.{GRPC_STATUS[code]}", str(code.status)), (kind, message)
    assert len(seen) > len(refused) > 0, (len(seen), refused[:3])
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    wait_ready(url)
    deadline = time.monotonic() + 30
    while metric_total(url, "jitserve_futures") != futures_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_total(url, "jitserve_futures") == futures_before
