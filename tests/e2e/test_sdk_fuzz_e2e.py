"""The SDK used at random, as a program uses jax, with runtimes killed under it.

One real ``jitserve serve`` (two runtimes) and ``Client(run_ahead=8)``: arrays put,
jitted calls running ahead on them, state donated, values read, references dropped,
and now and then a runtime SIGKILLed, as the OOM killer or another caller's crashing
program would. The checks:

- a value read is numpy's, or the read raises the SDK's error for a lost runtime
  (``runtime_crashed``, ``runtime_stopped``) or for a call on such an output
  (``future_failed``), within the client's timeout: never a wrong value, a hang, or
  an error of another kind;
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
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import _serve, metric_total

from jitserve.client import Client
from jitserve.client.errors import APIError

pytestmark = pytest.mark.timeout(300)

# What a read may raise when a runtime was killed under the walk: the loss itself, or
# a call on an output that was lost.
_LOST = {"runtime_crashed", "runtime_stopped", "future_failed"}


def sdk_walk(c: Client, seed: int, steps: int, crash: Callable[[], None] | None = None) -> int:
    """``steps`` random steps of a program using ``c``; ``crash`` (if given) kills a
    runtime, one step in about 40. Reads what it holds at the end, then drops all
    it made; how many reads raised for a lost runtime."""
    rng = np.random.default_rng(seed)
    mean = c.jit(lambda x, y: (x + y) * 0.5)  # values stay bounded however long it walks
    step = c.jit(lambda s, x: (s * 0.5 + x, jnp.tanh((s * x).sum())), donate_argnums=(0,))
    held: list[tuple[Any, np.ndarray]] = []  # each array with its value
    lost = 0

    def read(i: int) -> None:
        nonlocal lost
        a, value = held[i]
        try:
            got = np.asarray(a)
        except APIError as e:
            assert crash is not None and e.code in _LOST, repr(e)
            lost += 1
            held.pop(i)  # as a program would, once it raised
            return
        np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-4)

    ops = ["put", "mean", "step", "read", "drop", "crash"]
    weights = np.array([.2, .3, .2, .15, .15, .025 if crash else 0])
    for _ in range(steps):
        op = rng.choice(ops, p=weights / weights.sum())
        if op == "crash":
            assert crash is not None
            crash()
        elif op == "put" or len(held) < 2:
            value = rng.standard_normal(8).astype(np.float32)
            with refused(crash):  # a runtime lost twice under it, in a row
                held.append((c.device_put(value), value))
        elif op == "mean":
            (a, va), (b, vb) = (held[i] for i in rng.choice(len(held), 2))
            with refused(crash):
                held.append((mean(a, b), (va + vb) * np.float32(0.5)))
        elif op == "step":  # a training step: the state is donated, as jax deletes it
            s, vs = held.pop(int(rng.integers(len(held))))
            x, vx = held[int(rng.integers(len(held)))]
            with refused(crash):
                new, total = step(s, x)
                held += [(new, vs * 0.5 + vx), (total, np.tanh((vs * vx).sum()))]
        elif op == "read":
            read(int(rng.integers(len(held))))
        else:
            held.pop(int(rng.integers(len(held))))
    while held:
        read(len(held) - 1)
        if held:
            held.pop()
    return lost  # what it made is garbage from here on


@contextlib.contextmanager
def refused(crash: Callable[[], None] | None) -> Iterator[None]:
    """A call whose signature's first call it is waits for the server to take it, so
    one on an output of a lost runtime may raise at once (the server refuses it,
    naming the loss), where a later one raises at the first use of its outputs."""
    try:
        yield
    except APIError as e:
        assert crash is not None and e.code in _LOST, repr(e)


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
        up = [r for r in httpx.get(f"{url}/readyz", timeout=30).json().get("runtimes", ())
              if r.get("pid")]
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
        lost = sdk_walk(c, seed, 400, _crash(url, np.random.default_rng(seed)))
        assert lost > 0, "no read met a lost runtime: the walk did not reach a crash"
        wait_back_to(lambda: metric_total(url, "jitserve_futures"), before)
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200
