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
import threading
import time
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

from jitserve import wire
from jitserve.client import AsyncClient, Client
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


async def test_an_async_training_loop_runs_ahead_with_local_losses(server_url: str) -> None:
    train_step, params, opt_state, x, y = _training()
    local = _losses(jax.jit(train_step, donate_argnums=(0, 1)),
                    *jax.device_put((params, opt_state)), x, y)
    for run_ahead in (0, 4):
        async with AsyncClient(server_url, run_ahead=run_ahead) as c:
            step = c.jit(train_step, donate_argnums=(0, 1))
            state = await c.device_put((params, opt_state))
            losses, most = [], 0
            for i in range(12):
                *state, loss = await step(*state, x, y)
                most = max(most, c._ahead.pending if c._ahead else 0)
                if i % 3 == 2:
                    losses.append(float(await loss))
            assert most <= run_ahead
        np.testing.assert_allclose(losses, local, rtol=1e-5, err_msg=f"run_ahead={run_ahead}")


async def test_an_async_refused_call_raises_on_the_first_use_of_its_outputs(
        server_url: str) -> None:
    async with AsyncClient(server_url, run_ahead=8) as c:
        f = c.jit(lambda v: v * 2.0 + 1.0)
        a = np.arange(4, dtype=np.float32)
        first = await f(a)
        np.testing.assert_array_equal(await first, a * 2 + 1)
        await c.delete(first.future_id)  # the server loses the input behind the client's back
        refused = await f(first)  # returns at once: nothing raises yet
        chained = await f(refused)
        with pytest.raises(RuntimeError, match="still on its way"):
            refused.future_id  # noqa: B018 - would block the loop its sender runs in
        with pytest.raises(NotFound, match="call of <lambda>"):
            await refused
        with pytest.raises(NotFound):
            await refused.block_until_ready()
        with pytest.raises(FutureFailed, match="was refused"):
            await chained
        # A signature's first call waits for the server, and first for its inputs' calls.
        g = c.jit(lambda v: v - 1.0)
        with pytest.raises(NotFound, match="call of <lambda>"):
            await g(refused)
        queued = await f(a)
        np.testing.assert_array_equal(await (await g(queued)), a * 2)


def test_a_refused_call_raises_on_the_first_use_of_its_outputs(server_url: str) -> None:
    with Client(server_url, run_ahead=16) as c:
        f = c.jit(lambda v: v * 2.0 + 1.0)
        a = np.arange(4, dtype=np.float32)
        first, kept = f(a), f(a)
        np.testing.assert_array_equal(np.asarray(first), a * 2 + 1)
        # The server loses an input; the client, which still holds it, runs ahead anyway.
        assert httpx.delete(f"{server_url}/v1/futures/{first.future_id}",
                            timeout=30).status_code == 200
        refused = f(first)  # returns at once: nothing raises yet
        chained = f(refused)
        assert refused.shape == (4,) and chained.shape == (4,)
        with pytest.raises(NotFound, match="call of <lambda>"):
            np.asarray(refused)
        with pytest.raises(NotFound):  # every use raises the same error
            refused.block_until_ready()
        with pytest.raises(FutureFailed, match="was refused"):  # here, or by the server
            np.asarray(chained)
        np.testing.assert_array_equal(np.asarray(kept), a * 2 + 1)  # the other call stands


@pytest.mark.parametrize("where", ["server", "client"])
def test_what_a_refused_call_donated_is_released_on_the_server(server_url: str,
                                                               where: str) -> None:
    """A call running ahead takes its donated inputs when it is queued, as jax's
    dispatch deletes a donated array whatever becomes of its computation. Refused
    (by the server, or here for an input of a refused call), it never runs, so no run
    releases them: the client does (they stayed on the server until their TTL)."""
    with Client(server_url, run_ahead=16) as c:
        f = c.jit(lambda v, s: v * 2.0 + s, donate_argnums=(1,))
        a = np.arange(4, dtype=np.float32)
        first = f(a, a)
        np.testing.assert_array_equal(np.asarray(first), a * 3)
        assert httpx.delete(f"{server_url}/v1/futures/{first.future_id}",
                            timeout=30).status_code == 200
        state = c.device_put(a)
        held = state.future_id
        if where == "server":
            out = f(first, state)  # refused there: its first input is gone
        else:
            refused = f(first, a)
            with pytest.raises(NotFound):  # known here before the next call goes
                refused.block_until_ready()
            out = f(refused, state)  # refused here: its first input's call was
        with pytest.raises((NotFound, FutureFailed)):
            out.block_until_ready()
        assert state.is_deleted()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server_url}/v1/futures/{held}", timeout=30).status_code != 404:
            assert time.monotonic() < deadline, "the donated input was never released"
            time.sleep(0.05)


def test_a_long_chain_on_a_refused_call_names_the_refusal_once(server_url: str) -> None:
    """A loop that goes on after a refusal, as a training loop that reads nothing for
    a while does: every later call raises the refusal that began the chain, in a
    message that does not grow with the chain (it nested each link's before)."""
    with Client(server_url, run_ahead=16) as c:
        f = c.jit(lambda v: v * 2.0 + 1.0)
        first = f(np.arange(4, dtype=np.float32))
        first.block_until_ready()
        assert httpx.delete(f"{server_url}/v1/futures/{first.future_id}",
                            timeout=30).status_code == 200
        y = f(first)  # refused by the server: its input is gone
        with pytest.raises(NotFound):  # known here before the chain goes, so the SDK
            y.block_until_ready()  # refuses every call of it (not the server, in a batch)
        chain = []
        for _ in range(300):
            y = f(y)
            chain.append(y)
        errors = []
        for out in (chain[0], chain[1], chain[-1]):
            with pytest.raises(FutureFailed) as raised:
                out.block_until_ready()
            errors.append(str(raised.value))
        assert "call of <lambda>" in errors[-1] and first.future_id in errors[-1], errors[-1]
        assert len(errors[-1]) == len(errors[1]) < 2 * len(errors[0]), errors


def test_calls_whose_program_the_server_lost_go_again_after_an_upload(server_url: str) -> None:
    """A restart loses programs the client still knows: the calls on their way are
    refused ``not_found``; the client uploads the program again and sends them again,
    in order, with the calls that take their outputs."""
    with Client(server_url, run_ahead=16) as c:
        f = c.jit(lambda v: v * 2.0 + 1.0)
        a = np.arange(4, dtype=np.float32)
        first = f(a)
        np.testing.assert_array_equal(np.asarray(first), a * 2 + 1)
        [program_id] = [p.program_id for p in f._cache.values()]
        assert httpx.delete(f"{server_url}/v1/programs/{program_id}", timeout=30).status_code == 200
        second = f(first)
        third = f(second)
        np.testing.assert_array_equal(np.asarray(third), a * 8 + 7)
        np.testing.assert_array_equal(np.asarray(second), a * 4 + 3)
        assert httpx.get(f"{server_url}/v1/programs/{program_id}", timeout=30).status_code == 200


class _Counting(httpx.HTTPTransport):
    """A real HTTP transport that remembers each request's method and path."""

    def __init__(self, releases: bool = False) -> None:
        super().__init__()
        self.seen: list[str] = []
        self._releases = releases  # whether to count POST /v1/futures/release too

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._releases or request.url.path != "/v1/futures/release":
            self.seen.append(f"{request.method} {request.url.path}")
        return super().handle_request(request)


def test_a_quick_call_s_values_come_with_its_batch_s_answer(server_url: str) -> None:
    """``np.asarray(f(x))`` running ahead costs one request, as it does waiting: the
    batch's answer waits for a call with small outputs and carries them."""
    counting = _Counting()
    with Client(server_url, run_ahead=8, transport=counting) as c:
        f = c.jit(lambda v: (v + 1.0, v.sum()))
        a = np.arange(4, dtype=np.float32)
        # The first call compiles, missing the hold: the next two do not ask (``_Hold``).
        for _ in range(3):
            np.asarray(f(a)[0])
        counting.seen.clear()
        for k in range(5):
            out, total = f(a + k)
            np.testing.assert_array_equal(np.asarray(out), a + k + 1)
            assert float(total) == float((a + k).sum())
        assert counting.seen == ["POST /v1/calls"] * 5, counting.seen


def test_a_loss_awaited_while_its_call_is_queued_comes_with_the_batch_s_answer(
        server_url: str) -> None:
    """Reading a step's loss beside a model too big to come along costs the call's
    request only: a reader that waits before the batch is sent makes the batch ask
    for the answer to carry it (``_FutureState.awaited``), however long the run."""
    counting = _Counting()
    n = wire.INLINE_OUTPUTS_BYTES // 4 + 1  # float32: one element past the limit
    with Client(server_url, run_ahead=8, transport=counting) as c:
        step = c.jit(lambda w, x: (w - 0.1 * x, jnp.sum(w * x)), donate_argnums=0)
        x = np.full(n, 0.5, np.float32)
        local = jax.jit(lambda w, x: (w - 0.1 * x, jnp.sum(w * x)))
        w, mine = c.device_put(np.ones(n, np.float32)), jnp.ones(n, np.float32)
        w, loss = step(w, x)  # the signature's first call waits for the server
        mine, expected = local(mine, x)
        assert float(loss) == pytest.approx(float(expected), rel=1e-6)
        counting.seen.clear()
        for _ in range(3):
            got: list[float] = []
            with c._ahead._cv:  # the sender takes the call only once the reader waits
                w, loss = step(w, x)
                state = loss._future
                reader = threading.Thread(target=lambda out=got, y=loss: out.append(float(y)))
                reader.start()
                deadline = time.monotonic() + 60
                while state.awaited is None and time.monotonic() < deadline:
                    time.sleep(0.001)
            reader.join(60)
            mine, expected = local(mine, x)
            assert got == [pytest.approx(float(expected), rel=1e-6)]
        assert counting.seen == ["POST /v1/calls"] * 3, counting.seen
        np.testing.assert_allclose(np.asarray(w), np.asarray(mine), rtol=1e-6)


def test_releases_of_dropped_outputs_ride_on_the_next_batch(server_url: str) -> None:
    """An output dropped while calls wait to go is released by their batch
    (``release`` of ``POST /v1/calls``), not by a request of its own."""
    counting = _Counting(releases=True)
    with Client(server_url, run_ahead=8, transport=counting) as c:
        f = c.jit(lambda v: (v * 2.0, v.sum()))
        a = np.arange(4, dtype=np.float32)
        y, total = f(a)  # the signature's first call waits for the server
        kept = f(a)  # a batch: its answer says releases ride (and nothing is dropped yet)
        assert float(kept[1]) == float(a.sum())
        assert c._ahead is not None and c._ahead.flush(30) and c._ahead.takes_release
        future_id = y.future_id
        with c._ahead._cv:  # the sender takes nothing meanwhile: the call waits to go
            z, z_total = f(a + 1)  # both kept: nothing else is dropped
            del y  # its release is queued, and offered to the batch after ``interval``
            deadline = time.monotonic() + 60
            while not c._ahead._releases and time.monotonic() < deadline:
                time.sleep(0.001)
            assert c._ahead._releases == [(future_id, 0)]
        assert c._ahead.flush(30)
        r = httpx.get(f"{server_url}/v1/futures/{future_id}/result", params={"outputs": "0"},
                      timeout=30)
        assert r.status_code == 404, r.text  # released by the batch
        assert float(total) == float(a.sum())  # its sibling stays
        np.testing.assert_array_equal(np.asarray(z), (a + 1) * 2.0)
        assert float(z_total) == float((a + 1).sum())
        assert "POST /v1/futures/release" not in counting.seen, counting.seen


def test_a_queued_call_sees_its_numpy_inputs_as_they_were(server_url: str) -> None:
    with Client(server_url, run_ahead=64) as c:
        f = c.jit(lambda v: v * 2.0)
        a = np.ones(256, np.float32)
        outs = []
        for k in range(20):
            a[:] = k
            outs.append(f(a))
        for k, out in enumerate(outs):
            np.testing.assert_array_equal(np.asarray(out), np.full(256, 2.0 * k, np.float32))


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
        assert out.is_ready()  # ready to raise, as a failed computation is
        with pytest.raises(TransportError):
            out.block_until_ready()


async def test_async_calls_on_their_way_when_the_server_dies_raise_naming_the_call(
        doomed: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, proc = doomed
    async with AsyncClient(url, run_ahead=64, timeout=20) as c:
        def slow_step(v: Any) -> Any:
            return jnp.tanh(v @ v) * 0.5

        f = c.jit(slow_step)
        v = np.full((128, 128), 0.01, np.float32)
        await (await f(v))  # compiled and known
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        outs = [await f(v) for _ in range(3)]  # each returns at once
        for out in outs:
            with pytest.raises(TransportError, match="call of slow_step"):
                await out
            assert await out.is_ready()  # ready to raise, as a failed computation is
            with pytest.raises(TransportError):
                await out.block_until_ready()


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
