"""P1 of ``bench/service.py`` on two revisions in one run: does a change cost a cached call?

Starts a server of git revision REF (checked out into a temporary worktree and
installed into a folder of its own, put first on that server's ``PYTHONPATH``), a
server of the working tree, and the hand-written FastAPI baseline; uploads P1's
small program to both servers, then calls the three in turn with
``service.interleaved_ms``: one call at a time, then 50 at a time, for REST
(msgpack) and for the SDK. Each pass is run twice, the servers started in one
order and then the other, since the one started first can fare better. It prints
after/before ratios (and each against the baseline), and writes them to
``bench/results/before_after.json``.

Run: ``.venv/bin/python bench/before_after.py REF [--calls N]`` (REF: ``HEAD~1``,
a commit, a branch; the working tree is "after"). Run it with ``HEAD`` as REF too:
the same code on both sides gives the noise floor the ratios must stand out of (on
the 2-core machine, ratios of 0.96-1.06, REST slightly above 1: the installed copy
serves a little faster than the editable one).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # _servers and service, beside this file

from _servers import baseline, jitserve, write_results  # noqa: E402

import service  # noqa: E402
from jitserve.client import Client  # noqa: E402

MSGPACK = {"content-type": "application/msgpack"}


@contextlib.contextmanager
def installed(ref: str) -> Iterator[Path]:
    """A folder holding the ``jitserve`` of git revision ``ref`` (its dependencies are
    this venv's)."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=BENCH, text=True,
                               capture_output=True, check=True).stdout.strip())
    with tempfile.TemporaryDirectory(prefix="jitserve-before-") as tmp:
        src, pkg = Path(tmp) / "src", Path(tmp) / "pkg"
        subprocess.run(["git", "worktree", "add", "--detach", str(src), ref], cwd=root,
                       check=True, capture_output=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                            "--target", str(pkg), str(src)], check=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(src)], cwd=root,
                           check=True)
        yield pkg


def one_run(pkg: Path, calls: int, before_first: bool) -> dict[str, float]:
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    body = service.baseline_body(x)
    program = service.export(service.f, x)
    start_before = jitserve(PYTHONPATH=str(pkg))
    start_after = jitserve()
    with contextlib.ExitStack() as stack:
        servers = [start_before, start_after] if before_first else [start_after, start_before]
        started = [stack.enter_context(s)[0] for s in servers]
        before, after = started if before_first else started[::-1]
        base = stack.enter_context(baseline())
        http = stack.enter_context(httpx.Client())
        fns = {}
        for name, url in (("before", before), ("after", after)):
            client = stack.enter_context(Client(url))
            pid = client.upload(program).program_id
            target = f"{url}/v1/programs/{pid}/execute?wait=10000"

            def rest(target: str = target) -> None:
                r = http.post(target, content=body, headers=MSGPACK)
                assert r.status_code == 200, r.text

            def sdk(client: Client = client, pid: str = pid) -> None:
                client.execute(pid, [x], wait=10)[0].result()

            fns[f"rest_{name}"], fns[f"sdk_{name}"] = rest, sdk

        def plain() -> None:
            assert http.post(f"{base}/run", content=body, headers=MSGPACK).status_code == 200

        fns["baseline"] = plain
        out: dict[str, float] = {}
        for block in (1, 50):
            ms = service.interleaved_ms(fns, calls, block=block)
            for kind in ("rest", "sdk"):
                out[f"{kind}_after_over_before_block{block}"] = (
                    ms[f"{kind}_after"] / ms[f"{kind}_before"])
                for name in ("before", "after"):
                    out[f"{kind}_{name}_ms_block{block}"] = ms[f"{kind}_{name}"]
                    out[f"{kind}_{name}_over_baseline_block{block}"] = (
                        ms[f"{kind}_{name}"] / ms["baseline"])
            out[f"baseline_ms_block{block}"] = ms["baseline"]
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ref", help="the revision before (the working tree is after)")
    parser.add_argument("--calls", type=int, default=1000, help="calls of each, per pass")
    args = parser.parse_args()
    with installed(args.ref) as pkg:
        runs = [one_run(pkg, args.calls, before_first) for before_first in (True, False)]
    ratios = [v for run in runs for k, v in run.items() if "_after_over_before_" in k]
    for first, run in zip(("before", "after"), runs):
        print(f"started first: {first}")
        for key, value in run.items():
            if "_over_" in key:
                print(f"  {key:36} {value:.3f}")
    print(f"after/before over {len(ratios)} ratios: mean {statistics.mean(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    write_results("before_after", {"ref": args.ref, "calls": args.calls, "runs": runs,
                                   "after_over_before": ratios})


if __name__ == "__main__":
    main()
