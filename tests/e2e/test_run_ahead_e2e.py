"""``Client(run_ahead=N)``: jitted calls return at once and go in order, in batches
(``POST /v1/calls``), as jax's asynchronous dispatch runs ahead (issue 38).

Against real ``jitserve serve`` processes: a flax + optax training loop gives the
losses of local jax with running ahead on and off; a refused call raises on the
first use of its outputs, not before, and so do the calls on them; no more than N
calls are ever on their way; and a server killed mid-loop makes the calls on their
way raise within the client's timeout, naming the call.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from e2e.conftest import _free_port
from flax import linen as nn

from jitserve.client import Client
from jitserve.client.errors import FutureFailed, NotFound, TransportError

pytestmark = pytest.mark.timeout(240)


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))


def _training() -> tuple[Any, Any, Any, np.ndarray, np.ndarray]:
    model, optimizer = _MLP(), optax.adamw(1e-2)

    def train_step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        def loss_fn(p: Any) -> Any:
            return optax.softmax_cross_entropy_with_integer_labels(
                model.apply({"params": p}, x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.integers(0, 4, 16).astype(np.int32)
    params = model.init(jax.random.key(0), x)["params"]
    # numpy copies: the local loop donates its jax arrays
    return train_step, *jax.tree.map(np.asarray, (params, optimizer.init(params))), x, y


def _losses(step: Any, params: Any, opt_state: Any, x: Any, y: Any) -> list[float]:
    losses = []
    for i in range(12):
        params, opt_state, loss = step(params, opt_state, x, y)
        if i % 3 == 2:
            losses.append(float(loss))
    return losses


def test_a_training_loop_runs_ahead_with_local_losses(server_url: str) -> None:
    train_step, params, opt_state, x, y = _training()
    local = _losses(jax.jit(train_step, donate_argnums=(0, 1)),
                    *jax.device_put((params, opt_state)), x, y)
    for run_ahead in (0, 8):
        with Client(server_url, run_ahead=run_ahead) as c:
            state = c.device_put((params, opt_state))
            remote = _losses(c.jit(train_step, donate_argnums=(0, 1)), *state, x, y)
        np.testing.assert_allclose(remote, local, rtol=1e-5, err_msg=f"run_ahead={run_ahead}")


def test_a_refused_call_raises_on_the_first_use_of_its_outputs(server_url: str) -> None:
    with Client(server_url, run_ahead=16) as c:
        f = c.jit(lambda v: v * 2.0 + 1.0)
        a = np.arange(4, dtype=np.float32)
        first = f(a)
        np.testing.assert_array_equal(np.asarray(first), a * 2 + 1)
        # The server loses the program; the client, which knows it, runs ahead anyway.
        [program_id] = [p.program_id for p in f._cache.values()]
        assert httpx.delete(f"{server_url}/v1/programs/{program_id}", timeout=30).status_code == 200
        refused = f(first)  # returns at once: nothing raises yet
        chained = f(refused)
        assert refused.shape == (4,) and chained.shape == (4,)
        with pytest.raises(NotFound, match="call of <lambda>"):
            np.asarray(refused)
        with pytest.raises(NotFound):  # every use raises the same error
            refused.block_until_ready()
        with pytest.raises(FutureFailed, match="was refused"):  # here, or by the server
            np.asarray(chained)
        np.testing.assert_array_equal(np.asarray(first), a * 2 + 1)  # the earlier call stands


def test_no_more_than_run_ahead_calls_are_on_their_way(server_url: str) -> None:
    with Client(server_url, run_ahead=3) as c:
        f = c.jit(lambda v: jnp.sin(v) @ v.T)
        v = np.ones((128, 128), np.float32)
        most = 0
        outs = []
        for _ in range(30):
            outs.append(f(v))
            most = max(most, c._ahead.pending)
        assert 1 <= most <= 3
        assert c._ahead.flush(60)
        for out in outs:
            out.block_until_ready()


@pytest.fixture
def doomed(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A server of this test's own, to be killed."""
    from e2e.conftest import E2E_ENV, SERVER_PYTHON, _wait_healthy

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITSERVE_")}
    env.update(E2E_ENV)
    with (tmp_path / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            [SERVER_PYTHON, "-m", "jitserve.service", "serve", "--host", "127.0.0.1",
             "--port", str(port), "--cache-dir", str(tmp_path / "cache")],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_healthy(url, proc, tmp_path / "server.log", timeout_s=90)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_calls_on_their_way_when_the_server_dies_raise_naming_the_call(
        doomed: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, proc = doomed
    with Client(url, run_ahead=64, timeout=20) as c:
        def slow_step(v: Any) -> Any:
            return jnp.tanh(v @ v) * 0.5

        f = c.jit(slow_step)
        v = np.full((128, 128), 0.01, np.float32)
        np.asarray(f(v))  # compiled and known
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        out = f(v)  # returns at once
        with pytest.raises(TransportError, match="call of slow_step"):
            np.asarray(out)


def test_batches_the_server_finds_too_big_go_again_smaller(server_url: str) -> None:
    """The e2e server takes bodies of 256 KiB: calls of 64 KiB each, queued faster
    than they are answered, make batches over that; each goes back to the queue and
    out again in smaller ones, and every call gives its value."""
    with Client(server_url, run_ahead=16) as c:
        f = c.jit(lambda v, k: v * k)
        v = np.ones((128, 128), np.float32)
        outs = [f(v, np.float32(k)) for k in range(40)]
        for k, out in enumerate(outs):
            np.testing.assert_array_equal(np.asarray(out), v * k)
