"""Training loops through ``Client.jit`` against the same loops under local ``jax.jit``.

Three loops, as a user writes them (docs/client.md's training example): flax +
optax adamw, parameters and optimizer state put on the server once and donated
each step, the loss fetched every ``--fetch-every`` steps (and at the end):

- ``mlp``: a 784-512-512-512-10 MLP, batch 64 (25 state leaves: where per-leaf
  and per-call costs show);
- ``cnn64`` and ``cnn256``: docs/client.md's CNN at batch 64 and 256.

Each loop runs ``--rounds`` times each way, local and remote taking turns (this
machine's speed drifts within minutes), ``--steps`` steps a round after warm-up
steps that compile. Per loop: the median ms per step of each, remote speed ÷
local speed (the issue's figure: 1.0 is local speed), and CPU ms per remote step
of this client, of the server's API process and of its runtimes (``/proc``).

Run: ``.venv/bin/python bench/training.py [--loops mlp cnn64] [--steps 200]``;
writes bench/results/training.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import linen as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file

from _servers import cpu_seconds, jitserve, write_results  # noqa: E402

from jitserve.client import Client  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = x.reshape((x.shape[0], -1))
        for _ in range(3):
            x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):
    """docs/client.md's: a small LeNet-style classifier of 28x28 grey images."""

    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = nn.avg_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(64)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(x)


LOOPS = {"mlp": (MLP, 64), "cnn64": (CNN, 64), "cnn256": (CNN, 256)}


def make_loop(name: str) -> tuple[Callable[..., Any], Any, Any, np.ndarray, np.ndarray]:
    """The loop's train step, initial parameters and optimizer state, and one batch."""
    module, batch = LOOPS[name]
    model, optimizer = module(), optax.adamw(1e-3)

    def train_step(params: Any, opt_state: Any, images: Any, labels: Any) -> Any:
        def loss_fn(p: Any) -> Any:
            logits = model.apply({"params": p}, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(0)
    images = rng.random((batch, 28, 28, 1), dtype=np.float32)
    labels = rng.integers(0, 10, size=batch).astype(np.int32)
    params = model.init(jax.random.key(0), images[:1])["params"]
    return train_step, params, optimizer.init(params), images, labels


def run_steps(step: Callable[..., Any], state: tuple[Any, Any], images: Any, labels: Any,
              steps: int, fetch_every: int) -> tuple[tuple[Any, Any], float, list[float]]:
    """``steps`` steps from ``state``; the new state, the seconds they took, the losses read."""
    params, opt_state = state
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, images, labels)
        if (i + 1) % fetch_every == 0 or i == steps - 1:
            losses.append(float(loss))
    return (params, opt_state), time.perf_counter() - start, losses


def bench_loop(name: str, c: Client, server_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    train_step, params, opt_state, images, labels = make_loop(name)
    local_step = jax.jit(train_step, donate_argnums=(0, 1))
    remote_step = c.jit(train_step, donate_argnums=(0, 1))
    local = (jax.device_put(params), jax.device_put(opt_state))
    remote = c.device_put((params, opt_state))
    local, _, local_losses = run_steps(local_step, local, images, labels, args.warmup, 1)
    remote, _, remote_losses = run_steps(remote_step, remote, images, labels, args.warmup, 1)
    np.testing.assert_allclose(remote_losses, local_losses, rtol=1e-4)  # the same training
    local_ms, remote_ms, cpu = [], [], {"client": 0.0, "api": 0.0, "runtimes": 0.0}
    for _ in range(args.rounds):
        local, seconds, _ = run_steps(local_step, local, images, labels, args.steps, args.fetch_every)
        local_ms.append(1e3 * seconds / args.steps)
        client0, (api0, runtimes0) = time.process_time(), cpu_seconds(server_pid)
        remote, seconds, _ = run_steps(remote_step, remote, images, labels, args.steps,
                                       args.fetch_every)
        remote_ms.append(1e3 * seconds / args.steps)
        api1, runtimes1 = cpu_seconds(server_pid)
        cpu["client"] += time.process_time() - client0
        cpu["api"] += api1 - api0
        cpu["runtimes"] += runtimes1 - runtimes0
    total = args.rounds * args.steps
    out = {"local_ms_per_step": statistics.median(local_ms),
           "remote_ms_per_step": statistics.median(remote_ms),
           "leaves": len(jax.tree.leaves((params, opt_state))),
           "cpu_ms_per_remote_step": {k: round(1e3 * v / total, 3) for k, v in cpu.items()},
           "local_ms_rounds": local_ms, "remote_ms_rounds": remote_ms}
    out["remote_speed_over_local"] = out["local_ms_per_step"] / out["remote_ms_per_step"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", nargs="*", default=list(LOOPS), choices=list(LOOPS))
    parser.add_argument("--steps", type=int, default=200, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds each way")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles)")
    parser.add_argument("--fetch-every", type=int, default=10, help="read the loss every N steps")
    parser.add_argument("--runtimes", default="1", help="JITSERVE_RUNTIMES of the server")
    args = parser.parse_args()
    results: dict[str, Any] = {"config": vars(args)}
    with jitserve(JITSERVE_RUNTIMES=args.runtimes) as (url, proc), Client(url, timeout=300) as c:
        for name in args.loops:
            r = results[name] = bench_loop(name, c, proc.pid, args)
            cpu = r["cpu_ms_per_remote_step"]
            print(f"{name} ({r['leaves']} state leaves): local {r['local_ms_per_step']:.2f} ms/step, "
                  f"Client.jit {r['remote_ms_per_step']:.2f} ms/step, remote ÷ local speed "
                  f"{r['remote_speed_over_local']:.2f}; CPU ms per remote step: client "
                  f"{cpu['client']:.2f}, API process {cpu['api']:.2f}, runtimes {cpu['runtimes']:.2f}")
    write_results("training", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
