"""Devices benchmarks (issue 37): calls spread over device groups, and sharded fetches.

Every figure is printed beside a baseline measured in the same run, and written
to bench/results/devices.json:

  spread  single-device calls per second, 64 in flight from the AsyncClient,
          against servers whose host has 1, 2 and 4 simulated CPU devices in
          groups of one (``JITSERVE_RUNTIME_DEVICES=each``: a runtime per
          device), as a ratio to the 1-device server. Placement spreads the
          calls over the runtimes; on a machine with fewer cores than runtimes
          no speedup is expected, only no loss.
  fetch   seconds to fetch a 256 MiB output sharded over 4 devices (assembled
          shard by shard in the shared-memory segment) against the same bytes
          from a single-device output, on the same server: ``np.asarray`` of a
          remote array through the SDK, median of runs.

Run: ``.venv/bin/python bench/devices.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, service, beside this file

from _servers import jitserve, write_results  # noqa: E402

from jitserve.client import AsyncClient, Client  # noqa: E402
from service import sdk_execute, throughput  # noqa: E402

MiB = 1 << 20


async def _calls_per_s(url: str, total: int) -> float:
    x = np.arange(1000, dtype=np.float32)
    async with AsyncClient(url, timeout=120) as ac:
        exported = jax.export.export(jax.jit(lambda v: v * 2.0 + 1.0))(
            jax.ShapeDtypeStruct(x.shape, x.dtype))
        program = (await ac.upload(exported.serialize())).program_id
        return await throughput(sdk_execute(ac, program, x), total, 64)


def spread(total: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for devices in (1, 2, 4):
        with jitserve(JITSERVE_CPU_DEVICES=str(devices), JITSERVE_RUNTIME_DEVICES="each",
                      JITSERVE_RUNTIMES="1") as (url, _):
            out[f"{devices}_devices_calls_per_s"] = asyncio.run(_calls_per_s(url, total))
    base = out["1_devices_calls_per_s"]
    for devices in (2, 4):
        out[f"{devices}_devices_ratio"] = out[f"{devices}_devices_calls_per_s"] / base
    return out


def fetch(runs: int, mib: int) -> dict[str, Any]:
    n = mib * MiB // 4
    with jitserve(JITSERVE_CPU_DEVICES="4", JITSERVE_RUNTIMES="1") as (url, _), \
            Client(url, timeout=300) as c:
        mesh = c.mesh((4,), ("x",))

        def make(scale: jax.Array) -> jax.Array:
            return jnp.arange(n, dtype=jnp.float32).reshape(-1, 1024) * scale

        single = c.jit(make)
        sharded = c.jit(make, in_shardings=NamedSharding(mesh, P()),
                        out_shardings=NamedSharding(mesh, P("x")))
        times: dict[str, list[float]] = {"single": [], "sharded": []}
        for i in range(runs + 1):  # the first of each compiles: untimed
            for name, f in (("single", single), ("sharded", sharded)):
                out = f(np.float32(i + 1))
                out.block_until_ready()
                t = time.perf_counter()
                value = np.asarray(out)
                if i:
                    times[name].append(time.perf_counter() - t)
                assert value[-1, -1] == (n - 1) * (i + 1)
                del out, value
    single_s, sharded_s = (statistics.median(times[k]) for k in ("single", "sharded"))
    return {"mib": mib, "single_device_s": single_s, "sharded_s": sharded_s,
            "ratio": sharded_s / single_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    results = {"spread": spread(400 if args.quick else 2000),
               "fetch": fetch(3 if args.quick else 7, 256)}
    s = results["spread"]
    print(f"spread: {s['1_devices_calls_per_s']:.0f} calls/s on 1 device; "
          f"{s['2_devices_ratio']:.2f}x on 2 runtimes of 1, {s['4_devices_ratio']:.2f}x on 4")
    f = results["fetch"]
    print(f"fetch {f['mib']} MiB: single device {f['single_device_s'] * 1e3:.0f} ms, sharded over 4 "
          f"{f['sharded_s'] * 1e3:.0f} ms: {f['ratio']:.2f}x")
    write_results("devices", results)


if __name__ == "__main__":
    main()
