"""Where a big transfer's time goes, stage by stage, on this host's first device.

Issue 38 asks for 2 GB/s each way through jitserve on a GPU; an H100 measured 0.71 up
and 0.70 down (local ``jax.device_put`` 6.3, fetch 1.8). A transfer through jitserve
is a chain of stages. Each is timed here alone, in one run, on the same bytes, then
the whole chain through a real ``jitserve serve`` on this host:

  up    ``copy_in``: the API process writes the body into a shared-memory segment;
        ``put_segment``: the runtime gives a view of that segment to ``device_put``;
        against ``put``: local ``jax.device_put`` of a numpy array.
  down  ``get``: the runtime's ``np.asarray`` of the device array (local jax's fetch);
        ``copy_out``: its copy of the host array into the API's segment.
  sdk   ``sdk_put``: ``Client.device_put`` + ``block_until_ready``; ``sdk_get``:
        ``np.asarray`` of a fresh ``RemoteArray``, through the server.

A stage far below ``put`` (or ``get``) is where the chain loses it: on a GPU,
``put_segment`` against ``put`` tells whether CUDA copies from a shared mapping more
slowly than from the process's own memory, ``get`` + ``copy_out`` whether the fetch
pays twice, and the sdk figures against the stages what HTTP and the API process add.
The server runs on the platform jax picks here (``JAX_PLATFORMS=cpu`` for the CPU).

Prints GB/s (best of ``--rounds``) and writes bench/results/transfers.json.

Run: ``.venv/bin/python bench/transfers.py [--mib 256] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file

from _servers import jitserve, write_results  # noqa: E402

from jitserve.client import Client  # noqa: E402
from jitserve.service.runtimes import frames  # noqa: E402

MiB = 1 << 20


def best_gb_s(nbytes: int, rounds: int, run: Callable[[], Any],
              before: Callable[[], Any] | None = None) -> float:
    """``nbytes`` over the shortest of ``rounds`` runs of ``run`` (``before`` untimed)."""
    times = []
    for _ in range(rounds):
        if before is not None:
            before()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def stages(host: np.ndarray, rounds: int) -> dict[str, float]:
    """The local stages, in GB/s: what jax does alone, and what a runtime does around it."""
    device = jax.devices()[0]
    n = host.nbytes
    segment = frames.Segment.create(f"jitserve-{'b' * 8}", n)
    try:
        view = np.ndarray(host.shape, host.dtype, buffer=segment.map)
        out: dict[str, float] = {}
        out["put"] = best_gb_s(n, rounds, lambda: jax.device_put(host, device).block_until_ready())
        out["copy_in"] = best_gb_s(n, rounds, lambda: np.copyto(view, host))
        out["put_segment"] = best_gb_s(
            n, rounds, lambda: jax.device_put(view, device).block_until_ready())
        x = jax.device_put(host, device)
        fresh: list[Any] = []  # a new device array each round: np.asarray keeps its host copy

        def make() -> None:
            fresh[:] = [(x + 1).block_until_ready()]

        out["get"] = best_gb_s(n, rounds, lambda: np.asarray(fresh[0]), make)
        back = np.asarray(x)
        out["copy_out"] = best_gb_s(n, rounds, lambda: np.copyto(view, back))
        return out
    finally:
        segment.destroy()  # the mapping goes with the last view of it


def through_server(host: np.ndarray, rounds: int) -> dict[str, float]:
    """``Client.device_put`` and ``np.asarray`` of a ``RemoteArray`` through a real server."""
    n = host.nbytes
    with jitserve(JITSERVE_RUNTIMES="1", JITSERVE_MAX_BODY_BYTES=str(2 * n + MiB)) as (url, _), \
            Client(url, timeout=600, run_ahead=0) as c:
        plus_one = c.jit(lambda v: v + 1)
        x = c.device_put(host)
        x.block_until_ready()
        np.asarray(plus_one(x))  # compiled, and a first fetch made
        out = {"sdk_put": best_gb_s(n, rounds, lambda: c.device_put(host).block_until_ready())}
        fresh: list[Any] = []

        def make() -> None:
            fresh[:] = [plus_one(x)]
            fresh[0].block_until_ready()

        out["sdk_get"] = best_gb_s(n, rounds, lambda: np.asarray(fresh[0]), make)
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    host = np.random.default_rng(0).random(args.mib * MiB // 4, dtype=np.float32)
    device = jax.devices()[0]
    results: dict[str, Any] = {"mib": args.mib, "rounds": args.rounds,
                               "platform": device.platform, "device_kind": device.device_kind,
                               "gb_s": {**stages(host, args.rounds),
                                        **through_server(host, args.rounds)}}
    rates = results["gb_s"]
    print(f"{args.mib} MiB on {device.platform} ({device.device_kind}), GB/s, best of "
          f"{args.rounds}:")
    for name, base in (("copy_in", "put"), ("put_segment", "put"), ("sdk_put", "put"),
                       ("copy_out", "get"), ("sdk_get", "get")):
        print(f"  {name:>12}: {rates[name]:7.2f}  ({rates[name] / rates[base]:.2f}x local {base} "
              f"{rates[base]:.2f})")
    if device.platform == "cpu":
        print("  (on the CPU, jax may keep a view of an aligned host array, and np.asarray "
              "gives one: put and get can be views, and the ratios mean little)")
    write_results("transfers", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
