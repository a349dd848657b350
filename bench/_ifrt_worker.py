"""One measurement of bench/ifrt.py, in a process of its own (jax's backend is per process).

Run as ``python bench/_ifrt_worker.py SCENARIO [ARG]`` with ``JAX_PLATFORMS=jitserve`` (and
``JITSERVE_IFRT_TARGET``) or ``JAX_PLATFORMS=cpu``; prints one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MiB = 1 << 20


def cpu() -> dict[str, float]:
    """CPU seconds so far of this process and, when ``BENCH_SERVER_PID`` names a
    jitserve server, of its API process and its runtimes (``/proc``)."""
    out = {"client": time.process_time()}
    pid = os.environ.get("BENCH_SERVER_PID")
    if pid:
        from _servers import cpu_seconds

        out["api"], out["runtimes"] = cpu_seconds(int(pid))
    return out


def cpu_since(start: dict[str, float], per: float = 1.0) -> dict[str, float]:
    """CPU each process spent since ``start`` (``cpu()``), in ms per ``per`` (1: in all)."""
    return {k: round(1e3 * (v - start[k]) / per, 2) for k, v in cpu().items()}


def median_call_s(f: Any, x: Any, calls: int) -> float:
    """Median seconds of ``f(x).block_until_ready()``, after 20 warm-up calls."""
    for _ in range(20):
        f(x).block_until_ready()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def small(calls: int = 300) -> dict[str, Any]:
    f = jax.jit(lambda x: x * 2.0 + 1.0)
    return {"median_s": median_call_s(f, jnp.arange(16, dtype=jnp.float32), calls), "calls": calls}


def cnn(batch: int, steps: int = 12) -> dict[str, Any]:
    """The training loop of docs/ifrt.md, timed after two warm-up steps."""
    import optax
    from flax import linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = nn.relu(nn.Conv(features=16, kernel_size=(3, 3))(x))
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
            x = nn.relu(nn.Conv(features=32, kernel_size=(3, 3))(x))
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
            x = x.reshape((x.shape[0], -1))
            x = nn.relu(nn.Dense(features=64)(x))
            return nn.Dense(features=10)(x)

    rng = np.random.default_rng(0)
    images = rng.normal(size=(steps + 2, batch, 28, 28, 1)).astype(np.float32)
    labels = rng.integers(0, 10, size=(steps + 2, batch))
    model = CNN()
    params = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        def loss_fn(p: Any) -> Any:
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for step in range(2):
        params, opt_state, loss = train_step(params, opt_state, images[step], labels[step])
    float(loss)
    t0, cpu0 = time.perf_counter(), cpu()
    for step in range(2, steps + 2):
        params, opt_state, loss = train_step(params, opt_state, images[step], labels[step])
        last = float(loss)  # as the docs' loop does: the loss comes back every step
    seconds = time.perf_counter() - t0
    return {"steps_per_s": steps / seconds, "batch": batch, "steps": steps, "last_loss": last,
            "cpu_ms_per_step": cpu_since(cpu0, steps)}


def transfer(mib: int) -> dict[str, Any]:
    """``jax.device_put`` and ``np.asarray`` of ``mib`` MiB, three times in a row, the
    figures of the first and the third: the first of a process touches fresh memory;
    the third reuses what the first freed (the second's read needs new memory, since
    the program still holds the first's, as it would)."""
    host = np.random.default_rng(0).random(mib * MiB // 4, dtype=np.float32)
    jax.device_put(host[:1024]).block_until_ready()  # the session and its first compile
    out: dict[str, Any] = {"mib": mib}
    for again in ("", None, "_again"):
        t0, cpu0 = time.perf_counter(), cpu()
        x = jax.device_put(host)
        x.block_until_ready()
        put_s, put_cpu = time.perf_counter() - t0, cpu_since(cpu0)
        y = x + 1  # a fresh array: np.asarray of x might be served from the host copy jax keeps
        y.block_until_ready()
        t0, cpu0 = time.perf_counter(), cpu()
        back = np.asarray(y)
        get_s, get_cpu = time.perf_counter() - t0, cpu_since(cpu0)
        assert back[0] == host[0] + 1
        if again is not None:
            out.update({f"put{again}_gb_s": host.nbytes / put_s / 1e9, f"put{again}_cpu_ms": put_cpu,
                        f"get{again}_gb_s": host.nbytes / get_s / 1e9, f"get{again}_cpu_ms": get_cpu})
        del x, y  # ``back`` stays, as a program keeps what it read
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    scenario, *args = sys.argv[1:]
    result = {"small": small, "cnn": cnn, "transfer": transfer}[scenario](*map(int, args))
    result["platform"] = jax.devices()[0].platform
    print(json.dumps(result))
