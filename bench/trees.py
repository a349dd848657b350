"""Two trees of jitserve side by side: a cached call's time and each process's CPU.

    python bench/trees.py b5fa5ed          # that commit against the checkout
    python bench/trees.py b5fa5ed HEAD~2   # two commits
    python bench/trees.py . --b-env JITSERVE_X=1   # the checkout, with a setting against without

On this machine the speed drifts by 30% and more within minutes, so two trees
measured one after the other are hard to compare. Here both servers run at once
(each a real ``jitserve serve`` with its runtimes) beside the baseline app
(``bench/_baseline_app.py``). One call goes to each target in turn, round after
round, so that drift hits them all alike. The call is P1's: ``execute?wait`` of
``sin(x) * 2 + 1`` on 1024 float32, as a raw msgpack REST body.

The commits are checked out into temporary git worktrees. Each server imports
``jitserve`` from its tree: a directory whose ``jitserve/`` maps the
packages as ``pyproject.toml`` does, put first on ``PYTHONPATH``. Printed and
written to ``bench/results/trees.json``:
- median wall time per call for each target, and their ratios;
- CPU per call of each server's API process and of its runtimes, read from
  ``/proc``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
from _servers import baseline, cpu_seconds, free_port, process, write_results

from service import baseline_body, export, f, interleaved_ms

ROOT = Path(__file__).resolve().parent.parent
# pyproject.toml's package-dir: jitserve.<name> -> <folder>
PACKAGES = {"client": "client", "compiler": "compiler", "service": "service",
            "wire": "client/wire"}


@contextlib.contextmanager
def tree(commit: str | None, scratch: Path) -> Iterator[dict[str, str]]:
    """The environment a server needs to import jitserve from ``commit``
    (``None``: the checkout, as installed)."""
    if commit is None:
        yield {}
        return
    checkout = scratch / f"tree-{commit.replace('/', '_')}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f",
                    str(checkout), commit], check=True, capture_output=True)
    try:
        package = scratch / f"path-{checkout.name}" / "jitserve"
        package.mkdir(parents=True)
        for name, folder in PACKAGES.items():
            (package / name).symlink_to(checkout / folder)
        yield {"PYTHONPATH": str(package.parent)}
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(checkout)], check=False, capture_output=True)


@contextlib.contextmanager
def server(env: dict[str, str], scratch: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cache = tempfile.mkdtemp(dir=scratch)
    argv = [sys.executable, "-m", "jitserve.service", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--cache-dir", cache, "--log-level", "warning"]
    with process(argv, url, env) as proc:
        yield url, proc.pid


def compare(a: str | None, b: str | None, rounds: int,
            b_env: dict[str, str] | None = None) -> dict[str, object]:
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    body = baseline_body(x)
    names = {"a": a or "checkout", "b": b or "checkout"}
    if b_env:
        names["b"] += " " + " ".join(f"{k}={v}" for k, v in b_env.items())
    if names["a"] == names["b"]:  # the same tree twice: each server's CPU under its own name
        names = {k: f"{name} ({k})" for k, name in names.items()}
    extra = {"a": {}, "b": b_env or {}}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        scratch = Path(tmp)
        servers = {k: stack.enter_context(server(
                       {**stack.enter_context(tree(c, scratch)), **extra[k]}, scratch))
                   for k, c in (("a", a), ("b", b))}
        base = stack.enter_context(baseline())
        client = stack.enter_context(httpx.Client(timeout=60))
        targets = {"base": f"{base}/run", "supervised": f"{base}/run_child"}
        for key, (url, _) in servers.items():
            program = client.post(f"{url}/v1/programs", content=export(f, x),
                                  headers={"content-type": "application/octet-stream"})
            program.raise_for_status()
            targets[key] = f"{url}/v1/programs/{program.json()['program_id']}/execute?wait=10000"
        headers = {"content-type": "application/msgpack"}

        def call(target: str) -> Callable[[], None]:
            def one() -> None:
                r = client.post(target, content=body, headers=headers)
                assert r.status_code == 200, r.text
            return one

        calls = {key: call(target) for key, target in targets.items()}
        for _ in range(20):
            for one in calls.values():
                one()
        before = {k: cpu_seconds(pid) for k, (_, pid) in servers.items()}
        ms = interleaved_ms(calls, rounds, warmup=0)
        after = {k: cpu_seconds(pid) for k, (_, pid) in servers.items()}
    cpu = {names[k]: {"api_ms": (after[k][0] - before[k][0]) / rounds * 1e3,
                      "runtimes_ms": (after[k][1] - before[k][1]) / rounds * 1e3}
           for k in servers}
    return {"trees": names, "rounds": rounds, "median_ms": ms,
            "ratio_b_vs_a": ms["b"] / ms["a"], "ratio_a_vs_baseline": ms["a"] / ms["base"],
            "ratio_b_vs_baseline": ms["b"] / ms["base"],
            "ratio_supervised_vs_baseline": ms["supervised"] / ms["base"],
            "cpu_per_call": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="a commit (the one to compare against); '.': the checkout")
    parser.add_argument("b", nargs="?", help="another commit; omitted: the checkout")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for b's server only (repeatable)")
    args = parser.parse_args()
    b_env = dict(item.split("=", 1) for item in args.b_env)
    results = compare(None if args.a == "." else args.a, args.b, args.rounds, b_env)
    print(json.dumps(results, indent=1))
    write_results("trees", results)


if __name__ == "__main__":
    main()
