"""JAX's own test files through jitserve's IFRT proxy, whole, against local runs (docs/ifrt.md).

For each of ``lax_numpy_test.py``, ``api_test.py``, ``lax_autodiff_test.py``,
``lax_control_flow_test.py``, ``random_test.py``, and, on 8 simulated devices,
``pjit_test.py`` and ``shard_map_test.py`` (``../shared/jax-tests``): the tests that pass
on the local CPU, the share of them that pass through a real
``jitserve serve --ifrt-port``, and every other one, which must be on
``tests/ifrt_conformance/expected_failures.txt``. Also: the server's ``/healthz`` after
each file, and requests it answered INTERNAL (target: none). CI runs a fixed share of
each file (``tests/e2e/test_ifrt_conformance.py``); this runs them whole.

Run: ``.venv/bin/python bench/conformance.py [--files ...] [--share N]``; writes
bench/results/conformance.json and exits 1 on a difference not on the list.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _servers, beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # ifrt_conformance

from _servers import free_port, jitserve, write_results  # noqa: E402
from ifrt_conformance.runner import DEVICES, FILES, compare, expected_failures, run_file  # noqa: E402


def internal_answers(url: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("jitserve_ifrt_requests_total{") and 'status="INTERNAL"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", default=list(FILES))
    parser.add_argument("--share", type=int, default=1, help="run 1/N of each file (1: all)")
    args = parser.parse_args()
    expected = expected_failures()
    results: dict[str, object] = {"share": args.share}
    failed = False
    internal = 0.0
    # One server per device count: the files of DEVICES run on runtimes of that many.
    for devices in sorted({DEVICES.get(name, 1) for name in args.files}):
        names = [name for name in args.files if DEVICES.get(name, 1) == devices]
        port = free_port()
        with jitserve(JITSERVE_IFRT_PORT=str(port), JITSERVE_RUNTIMES="1",
                      JITSERVE_CPU_DEVICES=str(devices)) as (url, _), \
                tempfile.TemporaryDirectory() as tmp:
            for name in names:
                local = run_file(name, Path(tmp) / f"local-{name}.xml", target=None,
                                 share=args.share)
                remote = run_file(name, Path(tmp) / f"remote-{name}.xml",
                                  target=f"127.0.0.1:{port}", share=args.share)
                c = compare(name, local, remote, expected)
                healthy = httpx.get(f"{url}/healthz", timeout=10).status_code == 200
                results[name] = {**c.to_json(), "healthz_200": healthy, "devices": devices}
                print(f"{name} ({devices} device{'s' * (devices > 1)}): {c.remote_passed}/"
                      f"{c.local_passed} of the locally passing tests pass through jitserve "
                      f"({100 * c.share_passing:.1f}%), {len(c.expected)} expected failures, "
                      f"{len(c.new)} new, {len(c.stale)} listed but passing; /healthz "
                      f"{'200' if healthy else 'NOT 200'}")
                for test in c.new:
                    print(f"  NEW  {test}")
                failed |= bool(c.new) or not healthy
            internal += internal_answers(url)
    results["internal_answers"] = internal
    print(f"requests answered INTERNAL over the run: {internal:g}")
    write_results("conformance", results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
