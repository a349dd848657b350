"""The SDK used at random, as a program uses jax, with runtimes killed under it, or runs
stopped at their deadline.

One real ``jitserve serve`` (two runtimes) and ``Client(run_ahead=8)``: arrays put,
jitted calls running ahead on them, state donated, values read, references dropped,
and now and then a runtime SIGKILLed, as the OOM killer or another caller's crashing
program would. Against a second server with a 2 s execution deadline, calls of a
program that never ends run ahead among the others. The checks:

- a value read is numpy's, or the read raises the SDK's error for a lost runtime
  (``runtime_crashed``, ``runtime_stopped``) or for a call on such an output
  (``future_failed``), within the client's timeout: never a wrong value, a hang, or
  an error of another kind;
- an output of the endless program, or of a call on one, raises
  ``execution_timeout`` (or ``future_failed`` naming it, or its input's loss), and
  only those do;
- once the program drops everything it holds, the server holds again what it held
  before: failed futures are released as done ones are.

``sdk_walk`` is also what ``test_replicas_e2e`` runs through a balancer.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import _serve, metric_total
from jax import lax

from jitserve.client import Client
from jitserve.client.errors import APIError

pytestmark = pytest.mark.timeout(300)

# What a read may raise when a runtime was killed under the walk: the loss itself, or
# a call on an output that was lost.
_LOST = {"runtime_crashed", "runtime_stopped", "future_failed"}
# ... when a run passed its deadline: the server stopped its runtime, so what else that
# runtime held or ran is lost with it, and calls on any of that fail.
_STOPPED = {"runtime_stopped", "future_failed"}


def sdk_walk(c: Client, seed: int, steps: int, crash: Callable[[], None] | None = None,
             spin: bool = False, lose: Collection[str] = _LOST) -> tuple[int, int]:
    """``steps`` random steps of a program using ``c``; ``crash`` (if given) kills a
    runtime, one step in about 40, after which reads may raise the codes of ``lose``;
    ``spin`` calls, one step in about 50, a program that never ends, which the server's
    deadline must stop. Reads what it holds at the end, then drops all it made. Returns
    how many reads raised for a loss, and how many for a passed deadline."""
    rng = np.random.default_rng(seed)
    mean = c.jit(lambda x, y: (x + y) * 0.5)  # values stay bounded however long it walks
    step = c.jit(lambda s, x: (s * 0.5 + x, jnp.tanh((s * x).sum())), donate_argnums=(0,))
    endless = c.jit(lambda x: lax.while_loop(lambda v: v.sum() >= 0, lambda v: v + 1.0, x * 0))
    # each array with its value, or ``None``: an output of the endless program, or of a
    # call on one, whose read must raise
    held: list[tuple[Any, np.ndarray | None]] = []
    lost = timeouts = 0
    may_lose = (set(lose) if crash else set()) | (_STOPPED if spin else set())

    def loss(e: APIError) -> bool:
        """Whether ``e`` is a loss the walk may meet. A lookup (the signature's
        compile, or its load into a restarted runtime) that lost its runtime twice is
        taken for the cause (``Runtime.request``): ``compile_failed``, naming the loss."""
        return e.code in may_lose or (crash is not None and e.code == "compile_failed"
                                      and "stopped its runtime" in str(e))

    def read(i: int) -> None:
        nonlocal lost, timeouts
        a, value = held[i]
        try:
            got = np.asarray(a)
        except APIError as e:
            # A read of a failed future names its failure (``cause``), a call refused at
            # once the chain's first (``root``): either way, what began it.
            cause = e.details.get("cause") or e.details
            root = (cause.get("root") or cause).get("code") if e.code == "future_failed" else e.code
            if root == "execution_timeout":
                assert value is None, f"a call with an end passed its deadline: {e!r}"
                timeouts += 1
            else:
                assert loss(e), repr(e)
                lost += 1
            held.pop(i)  # as a program would, once it raised
            return
        assert value is not None, f"the endless program, or a call on it, gave {got}"
        np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-4)

    ops = ["put", "mean", "step", "read", "drop", "crash", "spin"]
    weights = np.array([.2, .3, .2, .15, .15, .025 if crash else 0, .02 if spin else 0])
    for _ in range(steps):
        op = rng.choice(ops, p=weights / weights.sum())
        if op == "crash":
            assert crash is not None
            crash()
        elif op == "put" or len(held) < 2:
            value = rng.standard_normal(8).astype(np.float32)
            with refused(loss):  # a runtime lost twice under it, in a row
                held.append((c.device_put(value), value))
        elif op == "spin":
            a, _ = held[int(rng.integers(len(held)))]
            with refused(loss):
                held.append((endless(a), None))
        elif op == "mean":
            (a, va), (b, vb) = (held[i] for i in rng.choice(len(held), 2))
            with refused(loss):
                held.append((mean(a, b), None if va is None or vb is None
                             else (va + vb) * np.float32(0.5)))
        elif op == "step":  # a training step: the state is donated, as jax deletes it
            s, vs = held.pop(int(rng.integers(len(held))))
            x, vx = held[int(rng.integers(len(held)))]
            with refused(loss):
                new, total = step(s, x)
                if vs is None or vx is None:
                    held += [(new, None), (total, None)]
                else:
                    held += [(new, vs * 0.5 + vx), (total, np.tanh((vs * vx).sum()))]
        elif op == "read":
            read(int(rng.integers(len(held))))
        else:
            held.pop(int(rng.integers(len(held))))
    while held:
        read(len(held) - 1)
        if held:
            held.pop()
    # One for certain, whatever the walk drew. An endless run whose outputs the walk
    # dropped may still be running beside it, on the same runtime, until its own
    # deadline stops the runtime: this one then ends as that stop's collateral
    # (runtime_stopped, a loss), so it is called again; each stop ends what ran there.
    for _ in range(4 if spin else 0):
        held.append((endless(c.device_put(np.ones(8, np.float32))), None))
        read(0)
        if timeouts:
            break
    return lost, timeouts  # what it made is garbage from here on


@contextlib.contextmanager
def refused(loss: Callable[[APIError], bool]) -> Iterator[None]:
    """A call whose signature's first call it is waits for the server to take it, so
    one on an output of a lost runtime may raise at once (the server refuses it,
    naming the loss), where a later one raises at the first use of its outputs."""
    try:
        yield
    except APIError as e:
        assert loss(e), repr(e)


def wait_back_to(count: Callable[[], float], before: float, within_s: float = 60) -> None:
    """Until ``count()`` is back to ``before``: a walk's futures all released."""
    gc.collect()
    deadline = time.monotonic() + within_s
    while (now := count()) > before:
        assert time.monotonic() < deadline, f"{now - before:g} futures left of the walk"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(tmp_path_factory.mktemp("sdk-fuzz"), {"JITSERVE_RUNTIMES": "2"})


def _crash(url: str, rng: np.random.Generator) -> Callable[[], None]:
    def crash() -> None:
        # While one restarts, /readyz answers 503 and lists them in its error: the
        # other is still there to kill.
        ready = httpx.get(f"{url}/readyz", timeout=30).json()
        runtimes = ready.get("runtimes") or ready.get("error", {}).get("runtimes", ())
        up = [r for r in runtimes if r.get("state") == "up" and r.get("pid")]
        if up:
            try:
                os.kill(up[int(rng.integers(len(up)))]["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    return crash


@pytest.mark.parametrize("seed", [0, 1])
def test_the_sdk_at_random_with_runtimes_killed_under_it(url: str, seed: int) -> None:
    before = metric_total(url, "jitserve_futures")
    with Client(url, run_ahead=8, timeout=120, progress=False) as c:
        lost, _ = sdk_walk(c, seed, 400, _crash(url, np.random.default_rng(seed)))
        assert lost > 0, "no read met a lost runtime: the walk did not reach a crash"
        wait_back_to(lambda: metric_total(url, "jitserve_futures"), before)
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def deadline_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(tmp_path_factory.mktemp("sdk-deadline"),
                      {"JITSERVE_RUNTIMES": "2", "JITSERVE_EXECUTION_TIMEOUT_S": "2"})


@pytest.mark.parametrize("seed", [2, 3])
def test_the_sdk_at_random_with_runs_past_their_deadline(deadline_url: str, seed: int) -> None:
    """Now and then a call that never ends, running ahead like any other: its outputs,
    and those of calls on them, raise ``execution_timeout`` (or ``future_failed`` naming
    it) at their first use; what its stopped runtime held raises ``runtime_stopped``;
    every other value is right, and nothing the walk dropped stays on the server."""
    url = deadline_url
    before = metric_total(url, "jitserve_futures")
    with Client(url, run_ahead=8, timeout=120, progress=False) as c:
        _, timeouts = sdk_walk(c, seed, 300, spin=True)
        assert timeouts > 0
        wait_back_to(lambda: metric_total(url, "jitserve_futures"), before)
    stops = [line for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
             if line.startswith('jitserve_runtime_restarts_total{reason="timeout"}')]
    assert stops and float(stops[0].rpartition(" ")[2]) >= 1, stops  # the deadline's doing
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200
