"""Unmodified JAX programs through the IFRT proxy (docs/ifrt.md), against local jax in the same run.

  I1  a small jitted call with ``block_until_ready``: median seconds through the proxy,
      against local ``jax.jit`` and against ``Client.jit`` on the same server.
  I2  the docs' CNN training loop (flax, optax), unmodified: steps per second through
      the proxy against local ``jax.jit``, at batch 64 and 256 (target: 0.8x local at 256);
      the ratio of the medians, and each round's proxy run over the local run beside it.
  I3  ``jax.device_put`` and ``np.asarray`` of 256 MiB: GB/s each way (target: 1 GB/s),
      the first of a process (fresh memory) and the third in a row (reusing the first's).

Each measurement runs in a fresh process (``bench/_ifrt_worker.py``): with
``JAX_PLATFORMS=jitserve`` against one ``jitserve serve --ifrt-port`` started here, or
with ``JAX_PLATFORMS=cpu`` as the baseline, taking turns. Through the proxy, the worker
also reports the CPU its own process, the server's API process and its runtimes spent
(``/proc``): per step in I2, with the fastest step those sums allow on this machine's
cores; per transfer in I3. Results go to bench/results/ifrt.json.

Run: ``.venv/bin/python bench/ifrt.py [--only I1 I2 I3] [--rounds N] [--steps 30]
[--mib 256]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file

from _servers import free_port, jitserve, write_results  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_ifrt_worker.py"


def measure(scenario: str, *args: int, target: str | None, server: int | None = None
            ) -> dict[str, Any]:
    """One run of ``scenario`` in a fresh process: through the proxy at ``target``, or
    locally (``None``); ``server``: the server's pid, whose CPU the worker reports too."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "JITSERVE_", "BENCH_"))}
    if target is None:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.update(JAX_PLATFORMS="jitserve", JITSERVE_IFRT_TARGET=target)
    if server is not None:
        env["BENCH_SERVER_PID"] = str(server)
    done = subprocess.run([sys.executable, str(WORKER), scenario, *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{scenario} {args} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def client_jit_small(url: str, calls: int = 300) -> float:
    """I1's call through ``Client.jit`` on the same server: median seconds."""
    import numpy as np
    from _ifrt_worker import median_call_s

    from jitserve.client import Client

    with Client(url, timeout=120) as client:
        f = client.jit(lambda x: x * 2.0 + 1.0)
        return median_call_s(f, np.arange(16, dtype=np.float32), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["I1", "I2", "I3"])
    parser.add_argument("--rounds", type=int, default=2, help="turns of proxy and local each")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30,
                        help="timed steps of each I2 run (after two warm-up steps)")
    args = parser.parse_args()
    port = free_port()
    results: dict[str, Any] = {"rounds": args.rounds}
    with jitserve(JITSERVE_IFRT_PORT=str(port), JITSERVE_RUNTIMES="1",
                  JITSERVE_MAX_BODY_BYTES=str((args.mib + 64) << 20)) as (url, proc):
        target = f"127.0.0.1:{port}"
        measure("small", target=target)  # compile once: later rounds hit the cache
        if "I1" in args.only:
            proxy, local = [], []
            for _ in range(args.rounds):
                proxy.append(measure("small", target=target)["median_s"])
                local.append(measure("small", target=None)["median_s"])
            sdk = client_jit_small(url)
            p, lo = statistics.median(proxy), statistics.median(local)
            results["I1_small_call"] = {"proxy_s": p, "local_s": lo, "client_jit_s": sdk,
                                        "proxy_over_local": p / lo, "proxy_over_client_jit": p / sdk}
            print(f"I1 small jitted call: proxy {p * 1e6:.0f} us, local jax.jit {lo * 1e6:.0f} us "
                  f"({p / lo:.1f}x), Client.jit {sdk * 1e6:.0f} us ({p / sdk:.2f}x of it)")
        if "I2" in args.only:
            for batch in (64, 256):
                measure("cnn", batch, 2, target=target)  # compile the step once
                proxy, local, cpu = [], [], []
                for r in range(args.rounds):  # every other round local first: drift hits both
                    if r % 2:
                        local.append(measure("cnn", batch, args.steps, target=None)["steps_per_s"])
                    run = measure("cnn", batch, args.steps, target=target, server=proc.pid)
                    proxy.append(run["steps_per_s"])
                    cpu.append(run["cpu_ms_per_step"])
                    if not r % 2:
                        local.append(measure("cnn", batch, args.steps, target=None)["steps_per_s"])
                p, lo = statistics.median(proxy), statistics.median(local)
                # Each round's proxy run over the local run beside it: this machine's speed
                # drifts within minutes, so pairs close in time say more than the medians.
                paired = sorted(a / b for a, b in zip(proxy, local))
                # CPU ms per step of the client, the API process and the runtimes (mean of
                # the rounds): sharing the machine's cores, a step cannot take less than
                # their sum over the cores, whatever overlaps.
                per = {k: round(statistics.mean(c[k] for c in cpu), 2) for k in cpu[0]}
                bound = sum(per.values()) / len(os.sched_getaffinity(0))
                results[f"I2_cnn_batch_{batch}"] = {
                    "proxy_steps_per_s": p, "local_steps_per_s": lo, "ratio": p / lo,
                    "steps": args.steps, "paired_ratios": paired,
                    "proxy_cpu_ms_per_step": per, "cpu_bound_ms_per_step": round(bound, 2),
                    "bound_ratio": 1e3 / lo / bound}
                print(f"I2 CNN batch {batch}: proxy {p:.1f} steps/s, local {lo:.1f} steps/s "
                      f"({p / lo:.2f}x local); CPU ms/step client {per['client']:.1f}, API "
                      f"{per['api']:.1f}, runtimes {per['runtimes']:.1f}: at best {bound:.1f} "
                      f"ms/step ({1e3 / lo / bound:.2f}x)")
                print(f"   round by round: {statistics.median(paired):.2f}x local (median of "
                      f"{len(paired)}, {paired[0]:.2f}-{paired[-1]:.2f})")
        if "I3" in args.only:
            runs = [measure("transfer", args.mib, target=target, server=proc.pid)
                    for _ in range(args.rounds)]
            local = measure("transfer", args.mib, target=None)
            figures = {name: statistics.median(r[name] for r in runs) for name in (
                "put_gb_s", "get_gb_s", "put_again_gb_s", "get_again_gb_s")}
            results["I3_transfer"] = {"mib": args.mib, **figures,
                                      **{f"local_{k}": local[k] for k in figures},
                                      "cpu_ms": [{k: v for k, v in r.items() if k.endswith("cpu_ms")}
                                                 for r in runs]}
            for again, what in (("", "first of a process"), ("_again", "third in a row")):
                print(f"I3 {args.mib} MiB, {what}: device_put {figures[f'put{again}_gb_s']:.2f} "
                      f"GB/s, np.asarray {figures[f'get{again}_gb_s']:.2f} GB/s (local: "
                      f"{local[f'put{again}_gb_s']:.1f} and {local[f'get{again}_gb_s']:.1f} GB/s)")
                for way in ("put", "get"):
                    print(f"   CPU ms of each {way}, client / API / runtimes: " + "; ".join(
                        f"{r[f'{way}{again}_cpu_ms']['client']:.0f} / "
                        f"{r[f'{way}{again}_cpu_ms']['api']:.0f} / "
                        f"{r[f'{way}{again}_cpu_ms']['runtimes']:.0f}" for r in runs))
    write_results("ifrt", results)


if __name__ == "__main__":
    main()
