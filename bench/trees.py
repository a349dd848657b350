"""Two trees of jitserve side by side: P1, P2 and P4 of each, in one run, taking turns.

    python bench/trees.py d166028          # that commit (a) against the checkout (b)
    python bench/trees.py d166028 HEAD     # two commits; --only P1 P2 P4 is the default
    python bench/trees.py d166028 HEAD --only P1 --rounds 3000
    python bench/trees.py d166028 HEAD --p4-sizes 1 16 --p4-reps 3
    python bench/trees.py . --b-env JITSERVE_X=1   # the checkout, with a setting against without

On this machine the speed drifts by 30% and more within minutes, so two trees
measured one after the other are hard to compare. Here both servers run at once
(each a real ``jitserve serve`` with its runtimes) beside the baseline app
(``bench/_baseline_app.py``), and every part takes turns between them, round
after round, every other round in the other order, so that drift hits both alike.

- P1, a cached call's round trip (``--rounds``; ``bench/service.py:
  interleaved_ms``, one call per target per round): ``execute?wait`` of
  ``sin(x) * 2 + 1`` on 1024 float32 as a raw msgpack REST body. The median ms of
  each tree, of the baseline app and of the supervised baseline (the same
  endpoint, its work in a child process), and each server's CPU ms per call (its
  API process and its runtimes, from ``/proc``).
- P2, throughput with 64 calls in flight (``service.py: throughput``; a turn is
  ``--p2-calls`` calls to one target, a round one turn of each, ``--p2-rounds``
  rounds, one more untimed first). Each tree driven by the SDK's AsyncClient (as
  ``service.py: p2``) and by aiohttp on the REST route with ``keep=false``
  (fast enough that the server, not the client, bounds the rate; kept, a run's
  futures would reach the server's limit); the baseline app driven by httpx with
  the SDK's connection pool and by aiohttp, and the supervised baseline by
  aiohttp. The median calls/s of each over the rounds, b/a of those medians and,
  round by round, b/a's median and range; each server's CPU ms per call over its
  turns (``throughput``'s warm-up calls counted). p2's baseline through httpx's
  own pool is left out: it runs near 100 calls/s at 64 in flight, which would
  make a round ten times longer, and it measures httpx, not a server.
- P4, upload (execute's POST, until its 202) and download (``result``) GB/s of
  one float32 array through the SDK at each of ``--p4-sizes`` MiB (``service.py:
  round_trip``): an untimed round trip to each tree, then ``--p4-reps`` to each
  taking turns. The median rates of each tree and b/a (in the JSON also b/a rep by
  rep: its median and range), and the highest peak RSS growth, over the payload,
  of its API process and of this client during a timed round trip.

The SDK that drives both servers is the checkout's (the one running this
script); only the servers import the other tree, so what is compared is the
server's side of the routes (``/v1/programs/{id}/execute``, ``/v1/futures/...``;
not ``/v1/arrays``: P4 sends its array in execute's body, as ``service.py`` does).
The commits are checked out into temporary git worktrees. Each server imports
``jitserve`` from its tree: a directory whose ``jitserve/`` maps the packages as
``pyproject.toml`` does, put first on ``PYTHONPATH``.

How far one run can be trusted, on the 2-CPU machine shared with other work.
For the checkout against itself (``python bench/trees.py .``), P1's b/a read
0.986-0.996, leaning to b, the server started second (started first, it read
1.013-1.021); P2's read 0.84-1.21 from one run to the next (its CPU per call
moves less); P4's at 256 MiB 0.96-1.05. For two trees run six times, both ways
round, P4's at 256 MiB read 0.83-1.20, either tree ahead by turns, and 20 round
trips did not narrow it: within a run the b/a of each
pair of round trips mostly kept one side, so a server seems to keep its speed for
its life, and only runs on fresh servers average it out. So: run several times,
swapping the trees (``trees.py B A``) every other time, and read a change as
real only where it keeps its sign.

Printed as a table (a, b and b/a for each figure, the baselines under each part)
and written in full to ``bench/results/trees.json``: the trees' names and
commits, the settings, each round's figures, the medians, the ratios and the
load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _servers import baseline, cpu_seconds, free_port, process, write_results

from jitserve.client import AsyncClient, Client
from jitserve.client._transport import async_transport
from service import (
    MSGPACK,
    AsyncCall,
    MiB,
    aiohttp_post,
    baseline_body,
    execute_url,
    export,
    f,
    httpx_post,
    interleaved_ms,
    round_trip,
    sdk_execute,
    throughput,
    transfer_program,
    transfer_row,
)

ROOT = Path(__file__).resolve().parent.parent
# pyproject.toml's package-dir: jitserve.<name> -> <folder>
PACKAGES = {"client": "client", "compiler": "compiler", "service": "service",
            "wire": "client/wire"}
PARTS = ("P1", "P2", "P4")
IN_FLIGHT = 64  # P2's calls in flight, as bench/service.py's
TREES = ("a", "b")
# P1's order in a round. A call runs faster right after one to the same server, and
# every other round goes the other way, so the first and the last target of a round
# call twice in a row. Those are the two trees, alike: with the baselines first,
# b alone did, and runs of a tree against itself read b/a 0.969, 0.988 and 0.978
# (0.986, 0.996 and 0.986 in this order).
ORDER = ("a", "base", "supervised", "b")
# P2's: a turn is hundreds of calls, so what ran before it matters little, but the
# load of the machine moves by a third from one turn to the next; a's turn and b's
# follow each other, and each round's b/a is a figure of its own.
# P2's REST calls keep no future: kept, as p2's are, a run's ten thousand and more
# outlive their turns (600 s) and reach the server's max_live_futures (429s). The
# SDK's calls keep theirs and release them; the baselines keep nothing either.
REST_KEEP = "&keep=false"
P2_ORDER = ("a", "b", "a_rest_aiohttp", "b_rest_aiohttp", "baseline_httpx_sdk_pool",
            "baseline_aiohttp", "supervised_baseline_aiohttp")


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


@dataclass(frozen=True)
class Targets:
    """What every part measures, all running at once."""

    urls: dict[str, str]  # "a", "b": each tree's server
    pids: dict[str, int]  # "a", "b": each server's API process (its runtimes are its children)
    base: str  # the baseline app (bench/_baseline_app.py)


@contextlib.contextmanager
def targets(commits: dict[str, str | None], b_env: dict[str, str]) -> Iterator[Targets]:
    """Both trees' servers (``commits``: ``None`` is the checkout; ``b_env`` for b's
    only) and the baseline app."""
    extra = {"a": {}, "b": b_env}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        scratch = Path(tmp)
        servers = {k: stack.enter_context(server(
                       {**stack.enter_context(tree(commits[k], scratch)), **extra[k]}, scratch))
                   for k in TREES}
        base = stack.enter_context(baseline())
        yield Targets({k: url for k, (url, _) in servers.items()},
                      {k: pid for k, (_, pid) in servers.items()}, base)


def tree_names(a: str | None, b: str | None, b_env: dict[str, str]) -> dict[str, str]:
    """How the report names each tree: its commit as given, and b's settings."""
    names = {"a": a or "checkout", "b": b or "checkout"}
    if b_env:
        names["b"] += " " + " ".join(f"{k}={v}" for k, v in b_env.items())
    if names["a"] == names["b"]:  # the same tree twice: tell them apart
        names = {k: f"{name} ({k})" for k, name in names.items()}
    return names


def resolved(commit: str | None) -> str:
    """The full hash of ``commit`` (``None``: the checkout's HEAD, with ``+changes``
    when its tracked files differ from it)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", commit or "HEAD"],
                         check=True, capture_output=True, text=True).stdout.strip()
    if commit is None and subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"],
                                         check=False).returncode:
        sha += "+changes"
    return sha


def cpu_per_call(before: tuple[float, float], after: tuple[float, float],
                 calls: int) -> dict[str, float]:
    """CPU ms per call of a server's API process and of its runtimes."""
    return {"api_ms": (after[0] - before[0]) / calls * 1e3,
            "runtimes_ms": (after[1] - before[1]) / calls * 1e3}


def p1(t: Targets, rounds: int) -> dict[str, Any]:
    """A cached call's round trip: each tree, the baseline app, the supervised
    baseline, one call each per round (``interleaved_ms``), after 20 rounds untimed."""
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    body = baseline_body(x)
    with httpx.Client(timeout=60) as client:
        urls = {"base": f"{t.base}/run", "supervised": f"{t.base}/run_child"}
        for key, url in t.urls.items():
            program = client.post(f"{url}/v1/programs", content=export(f, x),
                                  headers={"content-type": "application/octet-stream"})
            program.raise_for_status()
            urls[key] = f"{url}/v1/programs/{program.json()['program_id']}/execute?wait=10000"

        def call(target: str) -> Callable[[], None]:
            def one() -> None:
                r = client.post(target, content=body, headers=MSGPACK)
                assert r.status_code == 200, r.text
            return one

        calls = {key: call(urls[key]) for key in ORDER}
        for _ in range(20):
            for one in calls.values():
                one()
        before = {k: cpu_seconds(pid) for k, pid in t.pids.items()}
        ms = interleaved_ms(calls, rounds, warmup=0)
        after = {k: cpu_seconds(pid) for k, pid in t.pids.items()}
    return {"rounds": rounds, "median_ms": ms,
            "ratio_b_vs_a": ms["b"] / ms["a"], "ratio_a_vs_baseline": ms["a"] / ms["base"],
            "ratio_b_vs_baseline": ms["b"] / ms["base"],
            "ratio_supervised_vs_baseline": ms["supervised"] / ms["base"],
            "cpu_per_call": {k: cpu_per_call(before[k], after[k], rounds) for k in TREES}}


Turn = Callable[[], contextlib.AbstractAsyncContextManager[AsyncCall]]


def sdk_turn(url: str, program: str, x: np.ndarray) -> Turn:
    """P2's SDK call (``sdk_execute``) on a fresh AsyncClient for each turn.

    Every turn opens its own connections (in ``throughput``'s untimed warm-up) and
    closes them: kept between turns, they idled past the servers' keep-alive (5 s)
    and a server closing one as the next turn reused it failed that turn's calls.
    Closing the client also sends the releases of its futures within the turn,
    not into the next target's."""
    @contextlib.asynccontextmanager
    async def turn() -> AsyncIterator[AsyncCall]:
        async with AsyncClient(url) as ac:
            yield sdk_execute(ac, program, x)
    return turn


def httpx_pool_turn(target: str, body: bytes) -> Turn:
    """P2's baseline through httpx with the SDK's connection pool, fresh each turn."""
    @contextlib.asynccontextmanager
    async def turn() -> AsyncIterator[AsyncCall]:
        async with httpx.AsyncClient(transport=async_transport()) as h:
            yield httpx_post(h, target, body)
    return turn


def aiohttp_turn(target: str, body: bytes) -> Turn:
    """A POST through aiohttp (``aiohttp_post``), on a fresh session each turn."""
    import aiohttp

    @contextlib.asynccontextmanager
    async def turn() -> AsyncIterator[AsyncCall]:
        connector = aiohttp.TCPConnector(limit=IN_FLIGHT)
        async with aiohttp.ClientSession(connector=connector) as session:
            yield aiohttp_post(session, target, body)
    return turn


async def one_turn(turn: Turn, total: int, pid: int | None) -> tuple[float, tuple[float, float]]:
    """A turn's calls/s (``throughput``) and the CPU seconds that server ``pid``'s
    API process and runtimes spent in it (zeros without a ``pid``)."""
    before = cpu_seconds(pid) if pid else (0.0, 0.0)
    async with turn() as call:
        rate = await throughput(call, total, IN_FLIGHT)
    after = cpu_seconds(pid) if pid else (0.0, 0.0)
    return rate, (after[0] - before[0], after[1] - before[1])


async def interleaved_rates(turns: dict[str, Turn], rounds: int, total: int,
                            pids: dict[str, int]) -> tuple[dict[str, list[float]],
                                                           dict[str, dict[str, float]]]:
    """Calls/s of each of ``turns`` in each of ``rounds`` rounds (``one_turn``:
    ``total`` calls, ``IN_FLIGHT`` at a time), taking turns, every other round in
    the other order; and the CPU per call, over its timed turns, of the server
    ``pids`` names for a turn. One round goes untimed first, as P1's first 20
    calls do: in a trial run the first round's SDK turn read 40% below the next."""
    for turn in turns.values():
        await one_turn(turn, total, None)
    rates: dict[str, list[float]] = {name: [] for name in turns}
    cpu = {name: (0.0, 0.0) for name in pids}
    order = list(turns.items())
    for i in range(rounds):
        for name, turn in (order if i % 2 == 0 else order[::-1]):
            try:
                rate, spent = await one_turn(turn, total, pids.get(name))
            except Exception as e:
                raise RuntimeError(f"P2: {name}'s turn in round {i} failed") from e
            rates[name].append(rate)
            if name in pids:
                cpu[name] = (cpu[name][0] + spent[0], cpu[name][1] + spent[1])
    calls_made = rounds * (total + IN_FLIGHT)  # throughput's warm-up calls count
    return rates, {name: cpu_per_call((0.0, 0.0), spent, calls_made)
                   for name, spent in cpu.items()}


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """The median, lowest and highest of b/a taken round by round (P2) or rep by
    rep (P4): each round's a and b ran close together, so that drift moves their
    ratio less than either."""
    ratios = sorted(y / x for x, y in zip(a, b))
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


async def upload(url: str, x: np.ndarray) -> str:
    """P2's program (``f``), uploaded to the server at ``url``."""
    async with AsyncClient(url) as ac:
        return (await ac.upload(export(f, x))).program_id


async def p2(t: Targets, rounds: int, total: int) -> dict[str, Any]:
    """Throughput at 64 in flight: each tree through the SDK and through aiohttp
    on REST, and the baselines, in turns (``interleaved_rates``, in ``P2_ORDER``)."""
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    body = baseline_body(x)
    turns: dict[str, Turn] = {
        "baseline_httpx_sdk_pool": httpx_pool_turn(f"{t.base}/run", body),
        "baseline_aiohttp": aiohttp_turn(f"{t.base}/run", body),
        "supervised_baseline_aiohttp": aiohttp_turn(f"{t.base}/run_child", body)}
    pids: dict[str, int] = {}
    for k in TREES:
        program = await upload(t.urls[k], x)
        turns[k] = sdk_turn(t.urls[k], program, x)
        turns[f"{k}_rest_aiohttp"] = aiohttp_turn(execute_url(t.urls[k], program) + REST_KEEP,
                                                  body)
        pids[k] = pids[f"{k}_rest_aiohttp"] = t.pids[k]
    rates, cpu = await interleaved_rates({name: turns[name] for name in P2_ORDER},
                                         rounds, total, pids)
    cps = {name: statistics.median(each) for name, each in rates.items()}
    return {"rounds": rounds, "calls_per_round": total, "in_flight": IN_FLIGHT,
            "rest_call": f"POST execute?wait=30000{REST_KEEP}, msgpack, by aiohttp",
            "calls_per_s": cps, "ratio_b_vs_a": cps["b"] / cps["a"],
            "ratio_rest_b_vs_a": cps["b_rest_aiohttp"] / cps["a_rest_aiohttp"],
            "ratio_b_vs_a_per_round": paired(rates["a"], rates["b"]),
            "ratio_rest_b_vs_a_per_round": paired(rates["a_rest_aiohttp"], rates["b_rest_aiohttp"]),
            **{f"ratio_{k}_vs_baseline_sdk_pool": cps[k] / cps["baseline_httpx_sdk_pool"]
               for k in TREES},
            **{f"ratio_rest_{k}_vs_baseline_aiohttp":
               cps[f"{k}_rest_aiohttp"] / cps["baseline_aiohttp"] for k in TREES},
            "cpu_per_call": cpu, "each_round": rates}


def p4_size(clients: dict[str, Client], pids: dict[str, int], mib: int,
            reps: int) -> dict[str, Any]:
    """P4 at one size: an untimed round trip per tree, then ``reps`` each in turns
    (every other rep in the other order); ``transfer_row`` of each tree."""
    x = np.ones(mib * MiB // 4, np.float32)
    programs = {k: transfer_program(c, x) for k, c in clients.items()}

    def trip(k: str) -> dict[str, float]:
        return round_trip(clients[k], programs[k], x, pids[k])

    first = {k: trip(k) for k in TREES}
    timed: dict[str, list[dict[str, float]]] = {k: [] for k in TREES}
    for rep in range(reps):
        for k in (TREES if rep % 2 == 0 else TREES[::-1]):
            timed[k].append(trip(k))
    rows = {k: {**transfer_row(mib, first[k], timed[k]),
                "each_upload_gb_s": [r["upload_gb_s"] for r in timed[k]],
                "each_download_gb_s": [r["download_gb_s"] for r in timed[k]]} for k in TREES}
    return {"mib": mib, **rows,
            "ratio_upload_b_vs_a": rows["b"]["upload_gb_s"] / rows["a"]["upload_gb_s"],
            "ratio_download_b_vs_a": rows["b"]["download_gb_s"] / rows["a"]["download_gb_s"],
            **{f"ratio_{way}_b_vs_a_per_rep": paired(rows["a"][f"each_{way}_gb_s"],
                                                     rows["b"][f"each_{way}_gb_s"])
               for way in ("upload", "download")}}


def p4(t: Targets, sizes_mib: list[int], reps: int) -> dict[str, Any]:
    """Upload and download through the SDK at each size, the trees taking turns."""
    with contextlib.ExitStack() as stack:
        clients = {k: stack.enter_context(Client(t.urls[k], timeout=600)) for k in TREES}
        rows = [p4_size(clients, t.pids, mib, reps) for mib in sizes_mib]
    return {"reps": reps, "sizes_mib": sizes_mib, "rows": rows}


def row(label: str, a: float, b: float, digits: int = 3, ratio: bool = True) -> str:
    """One line of the table: a, b and b/a (``-`` where a is 0 or ``ratio`` is false:
    memory growths near 0 make ratios that mean nothing)."""
    ratio_text = f"{b / a:8.3f}" if a and ratio else f"{'-':>8}"
    return f"  {label:<40}{a:>10.{digits}f}{b:>10.{digits}f}{ratio_text}"


def p1_lines(r: dict[str, Any]) -> list[str]:
    ms, cpu = r["median_ms"], r["cpu_per_call"]
    return [f"P1  a cached call's round trip, raw msgpack REST, {r['rounds']} rounds (median)",
            row("ms per call", ms["a"], ms["b"]),
            row("API process CPU ms per call", cpu["a"]["api_ms"], cpu["b"]["api_ms"]),
            row("runtimes CPU ms per call", cpu["a"]["runtimes_ms"], cpu["b"]["runtimes_ms"]),
            f"  baseline app {ms['base']:.3f} ms, supervised {ms['supervised']:.3f} ms: "
            f"a {r['ratio_a_vs_baseline']:.3f}x, b {r['ratio_b_vs_baseline']:.3f}x the baseline"]


def p2_lines(r: dict[str, Any]) -> list[str]:
    cps, cpu = r["calls_per_s"], r["cpu_per_call"]
    lines = [f"P2  calls/s, {r['in_flight']} in flight, median of {r['rounds']} rounds "
             f"of {r['calls_per_round']}",
             row("SDK AsyncClient", cps["a"], cps["b"], 1),
             row("REST via aiohttp, keep=false", cps["a_rest_aiohttp"], cps["b_rest_aiohttp"], 1)]
    for key, how in (("", "SDK"), ("_rest_aiohttp", "REST")):
        lines += [row(f"API process CPU ms per call, {how}", cpu[f"a{key}"]["api_ms"],
                      cpu[f"b{key}"]["api_ms"]),
                  row(f"runtimes CPU ms per call, {how}", cpu[f"a{key}"]["runtimes_ms"],
                      cpu[f"b{key}"]["runtimes_ms"])]
    each, rest = r["ratio_b_vs_a_per_round"], r["ratio_rest_b_vs_a_per_round"]
    return lines + [
        f"  b/a round by round: SDK {each['median']:.3f} ({each['min']:.3f}-{each['max']:.3f}),"
        f" REST {rest['median']:.3f} ({rest['min']:.3f}-{rest['max']:.3f})",
        f"  baseline app: httpx with the SDK's pool {cps['baseline_httpx_sdk_pool']:.0f}/s "
        f"(SDK a {r['ratio_a_vs_baseline_sdk_pool']:.3f}x, b {r['ratio_b_vs_baseline_sdk_pool']:.3f}x),"
        f" aiohttp {cps['baseline_aiohttp']:.0f}/s (REST a {r['ratio_rest_a_vs_baseline_aiohttp']:.3f}x,"
        f" b {r['ratio_rest_b_vs_baseline_aiohttp']:.3f}x); supervised, aiohttp "
        f"{cps['supervised_baseline_aiohttp']:.0f}/s"]


def p4_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"P4  through the SDK, median of {r['reps']} round trips; RSS growth: the "
             "highest, over the payload"]
    for size in r["rows"]:
        a, b, mib = size["a"], size["b"], size["mib"]
        lines += [row(f"upload GB/s, {mib} MiB", a["upload_gb_s"], b["upload_gb_s"]),
                  row(f"download GB/s, {mib} MiB", a["download_gb_s"], b["download_gb_s"]),
                  row(f"server RSS growth, {mib} MiB", a["server_rss_growth_x_payload"],
                      b["server_rss_growth_x_payload"], ratio=False),
                  row(f"client RSS growth, {mib} MiB", a["client_rss_growth_x_payload"],
                      b["client_rss_growth_x_payload"], ratio=False)]
    return lines


def report(results: dict[str, Any]) -> str:
    """The table printed at the end: a line per figure, a part after another."""
    names, commits = results["trees"], results["commits"]
    lines = [f"a = {names['a']} ({commits['a'][:10]}), b = {names['b']} ({commits['b'][:10]})",
             f"{'':<42}{'a':>10}{'b':>10}{'b/a':>8}"]
    for part, lines_of in (("P1", p1_lines), ("P2", p2_lines), ("P4", p4_lines)):
        if part in results:
            lines += lines_of(results[part])
    load = results["machine"]
    lines.append(f"load average (1 min) {load['loadavg_before'][0]:.2f} before, "
                 f"{load['loadavg_after'][0]:.2f} after, on {load['cpus']} CPUs")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The parts ``args.only`` names, on one set of servers, P1 first."""
    b_env = dict(item.split("=", 1) for item in args.b_env)
    commits = {k: None if c in (".", None) else c for k, c in (("a", args.a), ("b", args.b))}
    results: dict[str, Any] = {
        "trees": tree_names(commits["a"], commits["b"], b_env),
        "commits": {k: resolved(c) for k, c in commits.items()},
        "machine": {"cpus": len(os.sched_getaffinity(0)), "loadavg_before": os.getloadavg()}}
    with targets(commits, b_env) as t:
        if "P1" in args.only:
            results["P1"] = p1(t, args.rounds)
        if "P2" in args.only:
            results["P2"] = asyncio.run(p2(t, args.p2_rounds, args.p2_calls))
        if "P4" in args.only:
            results["P4"] = p4(t, args.p4_sizes, args.p4_reps)
    results["machine"]["loadavg_after"] = os.getloadavg()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="a commit (the one to compare against); '.': the checkout")
    parser.add_argument("b", nargs="?", help="another commit; omitted or '.': the checkout")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS),
                        help="run these parts only (default: all)")
    parser.add_argument("--rounds", type=int, default=1000, help="P1's rounds")
    parser.add_argument("--p2-rounds", type=int, default=20, help="P2's rounds")
    parser.add_argument("--p2-calls", type=int, default=512,
                        help="P2's calls per target per round")
    parser.add_argument("--p4-sizes", type=int, nargs="+", default=[1, 16, 256],
                        metavar="MIB", help="P4's array sizes in MiB")
    parser.add_argument("--p4-reps", type=int, default=10,
                        help="P4's timed round trips per tree and size")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for b's server only (repeatable)")
    results = run(parser.parse_args())
    write_results("trees", results)
    print(report(results))


if __name__ == "__main__":
    main()
