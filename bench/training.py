"""Training loops through ``Client.jit`` against the same loops under local ``jax.jit``.

Three loops, as a user writes them (docs/client.md's training example): flax +
optax adamw, parameters and optimizer state put on the server once and donated
each step, the loss fetched every ``--fetch-every`` steps (and at the end):

- ``mlp``: a 784-512-512-512-10 MLP, batch 64 (25 state leaves: where per-leaf
  and per-call costs show);
- ``cnn64`` and ``cnn256``: docs/client.md's CNN at batch 64 and 256.

The remote loops run through four clients: over loopback and through a delay relay
(``bench/_delay_relay.py``, ``--rtt-ms`` of round trip, half each way), each with
``Client(run_ahead=--run-ahead)`` and without. Each loop runs ``--rounds`` times
each way, local and every client taking turns (this machine's speed drifts within
minutes), ``--steps`` steps a round after warm-up steps that compile. Per loop and
client: the median ms per step, its speed ÷ local speed (the issue's figure: 1.0 is
local speed), CPU ms per step of this client, of the server's API process and of
its runtimes (``/proc``), the requests per step by route (the server's
``/metrics``), and, through the relay, its speed ÷ the same client's over loopback
(the issue's run-ahead target: at least 0.8 at 10 ms).

Run: ``.venv/bin/python bench/training.py [--loops mlp cnn64] [--steps 200]
[--rtt-ms 10] [--run-ahead 32]``; writes bench/results/training.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import linen as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file

from _servers import (  # noqa: E402
    cpu_seconds,
    free_port,
    jitserve,
    requests_by_route,
    write_results,
)

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
    # numpy copies: each loop puts its own (the local one donates its jax arrays)
    return train_step, *jax.tree.map(np.asarray, (params, optimizer.init(params))), images, labels


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


def bench_loop(name: str, clients: dict[str, Client], server: tuple[str, int],
               args: argparse.Namespace) -> dict[str, Any]:
    """Local jax.jit against each of ``clients`` (a label each), taking turns."""
    train_step, params, opt_state, images, labels = make_loop(name)
    local_step = jax.jit(train_step, donate_argnums=(0, 1))
    local = (jax.device_put(params), jax.device_put(opt_state))
    local, _, local_losses = run_steps(local_step, local, images, labels, args.warmup, 1)
    remote: dict[str, Any] = {}
    for label, c in clients.items():
        step = c.jit(train_step, donate_argnums=(0, 1))
        state, _, losses = run_steps(step, c.device_put((params, opt_state)), images, labels,
                                     args.warmup, 1)
        np.testing.assert_allclose(losses, local_losses, rtol=1e-4)  # the same training
        remote[label] = {"step": step, "state": state, "ms": [], "requests": {},
                         "cpu": {"client": 0.0, "api": 0.0, "runtimes": 0.0}}
    url, server_pid = server
    local_ms = []
    local_cpu = 0.0
    for _ in range(args.rounds):
        cpu0 = time.process_time()
        local, seconds, _ = run_steps(local_step, local, images, labels, args.steps, args.fetch_every)
        local_cpu += time.process_time() - cpu0
        local_ms.append(1e3 * seconds / args.steps)
        for r in remote.values():
            requests0 = requests_by_route(url)
            client0, (api0, runtimes0) = time.process_time(), cpu_seconds(server_pid)
            r["state"], seconds, _ = run_steps(r["step"], r["state"], images, labels, args.steps,
                                               args.fetch_every)
            r["ms"].append(1e3 * seconds / args.steps)
            api1, runtimes1 = cpu_seconds(server_pid)
            for route, n in requests_by_route(url).items():
                r["requests"][route] = r["requests"].get(route, 0.0) + n - requests0.get(route, 0.0)
            r["cpu"]["client"] += time.process_time() - client0
            r["cpu"]["api"] += api1 - api0
            r["cpu"]["runtimes"] += runtimes1 - runtimes0
    total = args.rounds * args.steps
    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {"local_ms_per_step": statistics.median(local_ms),
                           "local_cpu_ms_per_step": round(1e3 * local_cpu / total, 3),
                           "cores": cores,
                           "leaves": len(jax.tree.leaves((params, opt_state))),
                           "local_ms_rounds": local_ms}
    for label, r in remote.items():
        ms = statistics.median(r["ms"])
        cpu = {k: round(1e3 * v / total, 3) for k, v in r["cpu"].items()}
        # The three processes share the machine's cores: a step cannot take less than
        # their CPU over the cores, whatever overlaps.
        bound = sum(cpu.values()) / cores
        out[label] = {"ms_per_step": ms, "ms_rounds": r["ms"],
                      "requests_per_step": {route: round(n / total, 3)
                                            for route, n in r["requests"].items() if n},
                      "speed_over_local": out["local_ms_per_step"] / ms,
                      "cpu_ms_per_step": cpu, "cpu_bound_ms_per_step": round(bound, 3),
                      "bound_speed_over_local": out["local_ms_per_step"] / bound}
    return out


@contextlib.contextmanager
def delay_relay(target_url: str, delay_ms: float) -> Iterator[str]:
    """``bench/_delay_relay.py`` in front of ``target_url``: its url."""
    port = free_port()
    target = int(target_url.rsplit(":", 1)[1])
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_delay_relay.py")),
                             str(port), str(target), str(delay_ms)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", nargs="*", default=list(LOOPS), choices=list(LOOPS))
    parser.add_argument("--steps", type=int, default=200, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds each way")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles)")
    parser.add_argument("--fetch-every", type=int, default=10, help="read the loss every N steps")
    parser.add_argument("--runtimes", default="1", help="JITSERVE_RUNTIMES of the server")
    parser.add_argument("--run-ahead", type=int, default=32,
                        help="Client(run_ahead=N) of the run-ahead clients (0: none of them)")
    parser.add_argument("--rtt-ms", type=float, default=10.0,
                        help="round trip of the delay relay (0: no relay)")
    args = parser.parse_args()
    results: dict[str, Any] = {"config": vars(args)}
    with contextlib.ExitStack() as stack:
        url, proc = stack.enter_context(jitserve(JITSERVE_RUNTIMES=args.runtimes))
        urls = {"loopback": url}
        if args.rtt_ms:
            urls[f"rtt{args.rtt_ms:g}ms"] = stack.enter_context(delay_relay(url, args.rtt_ms / 2))
        clients = {}
        for where, target in urls.items():
            clients[where] = stack.enter_context(Client(target, timeout=300, run_ahead=0))
            if args.run_ahead:
                clients[f"{where}+ahead"] = stack.enter_context(
                    Client(target, timeout=300, run_ahead=args.run_ahead))
        for name in args.loops:
            r = results[name] = bench_loop(name, clients, (url, proc.pid), args)
            print(f"{name} ({r['leaves']} state leaves): local {r['local_ms_per_step']:.2f} ms/step, "
                  f"{r['local_cpu_ms_per_step']:.2f} ms of CPU ({r['cores']} cores)")
            for label in clients:
                x = r[label]
                cpu = x["cpu_ms_per_step"]
                print(f"  {label:>20}: {x['ms_per_step']:7.2f} ms/step, {x['speed_over_local']:.2f}x "
                      f"local speed; CPU ms/step client {cpu['client']:.2f}, API {cpu['api']:.2f}, "
                      f"runtimes {cpu['runtimes']:.2f}: at best {x['cpu_bound_ms_per_step']:.2f} "
                      f"ms/step ({x['bound_speed_over_local']:.2f}x)")
                print(f"  {'':>20}  requests/step: " + ", ".join(
                    f"{route} {n:.2f}" for route, n in sorted(x["requests_per_step"].items())))
            for label in clients:
                if label.startswith("rtt"):
                    base = r[label.replace(f"rtt{args.rtt_ms:g}ms", "loopback")]["ms_per_step"]
                    r[label]["speed_over_loopback"] = ratio = base / r[label]["ms_per_step"]
                    print(f"  {label}: {ratio:.2f}x the speed of the same client over loopback")
    write_results("training", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
