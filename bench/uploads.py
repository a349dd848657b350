"""Memory of uploaded programs (issue 40): what each process holds per uploaded byte.

Uploads ``--count`` distinct programs of ``--mib`` MiB each (``jax.export`` of a
function with a constant that big) to a real ``jitserve serve`` with two runtimes,
and reads the resident memory of the API process and of each runtime after each
upload. Printed per process: the growth over the uploads after the first (the
first also pays for the buffers every later upload reuses), in copies of the
programs (growth / bytes uploaded); and the first upload's growth. The baseline,
measured in the same run: a minimal FastAPI endpoint (bench/_baseline_app.py
``/keep``) that keeps each body it gets, once: what holding an upload costs a
plain Python server. Written to bench/results/uploads.json.

Run: ``.venv/bin/python bench/uploads.py [--quick] [--mib N] [--count N]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import jax
import numpy as np
from jax import export

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file

from _servers import baseline, jitserve, rss_bytes, write_results  # noqa: E402

MiB = 1 << 20


def program(seed: int, mib: int) -> bytes:
    """A ``jax.export`` artifact of about ``mib`` MiB: ``x + c`` with a random ``c``."""
    c = np.random.default_rng(seed).standard_normal(mib * MiB // 4).astype(np.float32)
    spec = jax.ShapeDtypeStruct(c.shape, np.float32)
    return bytes(export.export(jax.jit(lambda x: x + c))(spec).serialize())


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (a server's runtimes and their supervisors)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *descendants(int(child))]
    return out


def growth(upload: Callable[[bytes], None], pids: Callable[[], dict[str, list[int]]],
           programs: list[bytes]) -> dict[str, dict[str, float]]:
    """RSS growth per process group over ``programs``' uploads: of the first, and of the rest in
    copies of the bytes uploaded."""
    def rss() -> dict[str, int]:
        return {name: sum(rss_bytes(p) for p in group) for name, group in pids().items()}

    start = rss()
    upload(programs[0])
    after_first = rss()
    for data in programs[1:]:
        upload(data)
    end = rss()
    rest = sum(len(p) for p in programs[1:])
    return {name: {"first_mib": (after_first[name] - start[name]) / MiB,
                   "rest_mib": (end[name] - after_first[name]) / MiB,
                   "copies": (end[name] - after_first[name]) / rest}
            for name in start}


def settle(url: str, seconds: float = 2.0) -> None:
    """Let a fresh server finish starting (its runtimes' imports) before a reading."""
    time.sleep(seconds)
    httpx.get(f"{url}/healthz", timeout=30).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 programs of 8 MiB")
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--count", type=int, default=6)
    args = parser.parse_args()
    mib, count = (8, 4) if args.quick else (args.mib, args.count)
    programs = [program(seed, mib) for seed in range(count)]
    print(f"{count} programs of {len(programs[0]) / MiB:.1f} MiB")

    with jitserve(JITSERVE_RUNTIMES="2") as (url, proc):
        settle(url)
        http = httpx.Client(base_url=url, timeout=300)

        def upload(data: bytes) -> None:
            r = http.post("/v1/programs", content=data,
                          headers={"content-type": "application/octet-stream"})
            r.raise_for_status()

        children = descendants(proc.pid)
        server = growth(upload, lambda: {"api": [proc.pid], "runtimes": children}, programs)

    with baseline() as url:
        settle(url, 0.5)
        pid = int(next(p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _serves(
            p, url)))
        http = httpx.Client(base_url=url, timeout=300)
        plain = growth(lambda data: http.post("/keep", content=data).raise_for_status() and None,
                       lambda: {"baseline": [pid]}, programs)

    results = {"program_mib": len(programs[0]) / MiB, "count": count, **server, **plain}
    keep = plain["baseline"]["copies"]
    for name in ("api", "runtimes", "baseline"):
        r = results[name]
        print(f"{name:>9}: first upload +{r['first_mib']:6.1f} MiB, then +{r['rest_mib']:6.1f} MiB "
              f"over {count - 1}: {r['copies']:.2f} copies per upload "
              f"({r['copies'] / keep:.2f}x the baseline's)")
    write_results("uploads", results)


def _serves(proc: Path, url: str) -> bool:
    try:
        args = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"--port" in args and url.rsplit(":", 1)[1].encode() in args and b"uvicorn" in args


if __name__ == "__main__":
    main()
