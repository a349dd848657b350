"""Dynamic batching against one real ``jitserve serve`` (with API keys) for the module.

Batching is proven by the server's own counters (``jitserve_batch_calls``, and
``jitserve_compilations_total`` for the buckets), never by timing; results are
compared with a local ``jax.jit`` of the same function, call by call.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import AUTH_KEYS, _serve, metric_total
from jax import export

from jitserve.client import AsyncClient, Client
from jitserve.client.errors import JitserveError

ALICE, BOB = AUTH_KEYS
RNG = np.random.default_rng(14)
W1 = RNG.standard_normal((8, 16))
W2 = RNG.standard_normal((16, 3))


def mlp(x: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    h = jnp.tanh(x @ W1) * scale[:, None]
    return h @ W2, x.sum(axis=1)


def _export(fn: Callable[..., Any], *shapes: tuple[Any, ...]) -> bytes:
    structs = [jax.ShapeDtypeStruct(s, jnp.float64) for s in shapes]
    return export.export(jax.jit(fn), platforms=["cpu"])(*structs).serialize()


@functools.cache  # exports are not byte-for-byte repeatable: one per function
def _poly(fn: Callable[..., Any]) -> bytes:
    (b,) = export.symbolic_shape("b")
    return _export(fn, (b, 8), (b,))


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(Path(tmp_path_factory.mktemp("batching")),
                      {"JITSERVE_API_KEYS": ",".join(AUTH_KEYS)})


@pytest.fixture(scope="module")
def alice(url: str) -> Iterator[Client]:
    with Client(url, api_key=ALICE) as c:
        yield c


def _headers(key: str = ALICE) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _upload(client: Client, fn: Callable[..., Any], max_batch_size: int = 64,
            max_delay_ms: float = 300) -> str:
    pid = client.upload(_poly(fn)).program_id
    client.set_batching(pid, max_batch_size=max_batch_size, max_delay_ms=max_delay_ms)
    return pid


def _inputs(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 8)), rng.uniform(0.5, 2.0, rows)


def _check(got: list[np.ndarray], x: np.ndarray, s: np.ndarray,
           fn: Callable[..., Any] = mlp) -> None:
    want = jax.jit(fn)(x, s)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-13, atol=1e-13)


def _batches(url: str) -> tuple[float, float]:
    """Batched runs so far, and the calls they took."""
    return metric_total(url, "jitserve_batch_calls_count"), metric_total(url,
                                                                         "jitserve_batch_calls_sum")


async def test_concurrent_sdk_calls_are_batched_and_equal_unbatched(url: str,
                                                                     alice: Client) -> None:
    pid = _upload(alice, mlp)
    inputs = [_inputs(1 + i % 4, i) for i in range(48)]  # mixed leading dims
    runs0, calls0 = _batches(url)
    async with AsyncClient(url, api_key=ALICE) as ac:
        assert (await ac.get_batching(pid))["max_batch_size"] == 64
        futures = await asyncio.gather(*(ac.execute(pid, [x, s]) for x, s in inputs))
        results = await asyncio.gather(*(asyncio.gather(*(o.result() for o in outs))
                                         for outs in futures))
    for (x, s), got in zip(inputs, results):
        _check([np.asarray(g) for g in got], x, s)
    runs, calls = _batches(url)
    assert calls - calls0 == 48  # every call went through a batch
    assert runs - runs0 < 48  # and some batches held several calls


async def test_raw_http_calls_are_batched(url: str, alice: Client) -> None:
    pid = _upload(alice, mlp)
    inputs = [_inputs(2, 100 + i) for i in range(12)]
    runs0, calls0 = _batches(url)

    async def call(http: httpx.AsyncClient, x: np.ndarray, s: np.ndarray) -> list[np.ndarray]:
        body = {"args": [{"dtype": "float64", "shape": list(a.shape), "data": a.tolist()}
                         for a in (x, s)]}
        r = await http.post(f"/v1/programs/{pid}/execute", json=body, params={"wait": 30000},
                            headers={**_headers(), "Accept": "application/json"})
        assert r.status_code == 200, r.text
        return [np.asarray(o["data"], dtype=np.float64).reshape(o["shape"])
                for o in r.json()["outputs"]]

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        results = await asyncio.gather(*(call(http, x, s) for x, s in inputs))
    for (x, s), got in zip(inputs, results):
        _check(got, x, s)
    runs, calls = _batches(url)
    assert calls - calls0 == 12 and runs - runs0 < 12


def test_a_bucket_compiles_once(url: str, alice: Client) -> None:
    def fn(x: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.sin(x) * s[:, None], s * 2

    # A full batch (8 rows) runs at once, so these pairs batch without waiting.
    pid = _upload(alice, fn, max_batch_size=8, max_delay_ms=1000)

    def pair(rows: tuple[int, int], seed: int) -> None:
        inputs = [_inputs(n, seed + i) for i, n in enumerate(rows)]
        with Client(url, api_key=ALICE) as c1, Client(url, api_key=ALICE) as c2:
            outs = [c.execute(pid, [x, s]) for c, (x, s) in zip((c1, c2), inputs)]
            for (x, s), o in zip(inputs, outs):
                _check([np.asarray(a) for a in o], x, s, fn)

    compiled0 = metric_total(url, "jitserve_compilations_total")
    runs0, _ = _batches(url)
    pair((4, 4), 1)
    assert metric_total(url, "jitserve_compilations_total") == compiled0 + 1  # bucket 8
    pair((4, 4), 2)
    pair((5, 3), 3)
    assert metric_total(url, "jitserve_compilations_total") == compiled0 + 1
    assert _batches(url)[0] - runs0 == 3


@pytest.mark.parametrize(("body", "names"), [
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"max_batch_size": 100000}, "max_batch_size"),
    ({"max_batch_size": "64"}, "max_batch_size"),
    ({"max_batch_size": 8, "max_delay_ms": -1}, "max_delay_ms"),
    ({"max_batch_size": 8, "max_delay_ms": 5000}, "max_delay_ms"),
    ({"max_batch_size": 8, "delay": 1}, "delay"),
    ({}, "max_batch_size"),
])
def test_bad_configuration_is_a_4xx_naming_it(url: str, alice: Client, body: dict[str, Any],
                                              names: str) -> None:
    pid = alice.upload(_poly(mlp)).program_id
    r = httpx.put(f"{url}/v1/programs/{pid}/batching", json=body, headers=_headers())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_request" and names in error["message"]


def test_unknown_and_other_keys_programs_are_not_found(url: str, alice: Client) -> None:
    pid = alice.upload(_poly(mlp)).program_id
    body = {"max_batch_size": 8}
    r = httpx.put(f"{url}/v1/programs/{'0' * 64}/batching", json=body, headers=_headers())
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.put(f"{url}/v1/programs/{pid}/batching", json=body, headers=_headers(BOB))
    assert r.status_code == 404
    r = httpx.put(f"{url}/v1/programs/{pid}/batching", json=body)
    assert r.status_code == 401


def test_the_configuration_is_per_api_key(url: str, alice: Client) -> None:
    pid = _upload(alice, mlp, max_batch_size=16)
    with Client(url, api_key=BOB) as bob:
        assert bob.upload(_poly(mlp)).program_id == pid
        assert bob.get_batching(pid) == {"program_id": pid, "enabled": False,
                                         "max_batch_size": None, "max_delay_ms": None,
                                         "batch_dimension": None}
        _, calls0 = _batches(url)
        x, s = _inputs(3, 7)
        _check([np.asarray(a) for a in bob.execute(pid, [x, s])], x, s)
        assert _batches(url)[1] == calls0  # Bob's call ran unbatched
    info = alice.get_batching(pid)
    assert info["enabled"] and info["max_batch_size"] == 16 and info["batch_dimension"] == "b"
    assert alice.clear_batching(pid)["enabled"] is False
    assert alice.get_batching(pid)["enabled"] is False
    _, calls0 = _batches(url)
    x, s = _inputs(3, 8)
    _check([np.asarray(a) for a in alice.execute(pid, [x, s])], x, s)
    assert _batches(url)[1] == calls0


@pytest.mark.parametrize(("program", "why"), [
    (lambda: _export(mlp, (4, 8), (4,)), "input 0"),
    (lambda: _poly(_sum_rows), "output 0"),
    (lambda: _export(lambda x, s: (x[:, 0] + s[0],), *_two_dims()), "input 1"),
])
def test_programs_that_cannot_batch_are_refused(url: str, alice: Client,
                                                program: Callable[[], bytes], why: str) -> None:
    pid = alice.upload(program()).program_id
    r = httpx.put(f"{url}/v1/programs/{pid}/batching", json={"max_batch_size": 8},
                  headers=_headers())
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "not_batchable" and why in error["message"]


def _sum_rows(x: jax.Array, s: jax.Array) -> tuple[jax.Array]:
    return (x.sum(axis=0) + s.sum(),)


def _two_dims() -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    b, n = export.symbolic_shape("b, n")
    return (b, 8), (n,)


async def test_members_that_leave_or_do_not_fit_lose_nobody(url: str, alice: Client) -> None:
    pid = _upload(alice, mlp, max_batch_size=64, max_delay_ms=1000)
    inputs = [_inputs(2, 200 + i) for i in range(4)]
    async with AsyncClient(url, api_key=ALICE) as ac:
        outs = [await ac.execute(pid, [x, s]) for x, s in inputs]
        # Deleted while queued: left out of the batch; the others still run.
        assert (await ac.delete(outs[1][0].future_id)) == "cancelled"
        # Arguments that do not fit run unbatched, and fail on their own.
        with pytest.raises(JitserveError, match="float64"):
            bad = await ac.execute(pid, [inputs[0][0].astype(np.float32), inputs[0][1]])
            await bad[0].result()
        for i in (0, 2, 3):
            x, s = inputs[i]
            _check([np.asarray(await o.result()) for o in outs[i]], x, s)
    assert metric_total(url, 'jitserve_batch_rows_bucket{le="8.0"}') >= 1


async def test_batched_outputs_chain_and_release(url: str, alice: Client) -> None:
    def step(x: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
        return x * 2.0, s + 1.0

    pid = _upload(alice, step, max_delay_ms=50)
    x, s = _inputs(3, 300)
    async with AsyncClient(url, api_key=ALICE) as ac:
        first = await asyncio.gather(*(ac.execute(pid, [x, s]) for _ in range(2)))
        again = await ac.execute(pid, first[0])  # future references: unbatched, on the device
        got = [np.asarray(await o.result()) for o in again]
        np.testing.assert_array_equal(got[0], x * 4.0)
        np.testing.assert_array_equal(got[1], s + 2.0)
        assert await ac.release([(o.future_id, o.index) for o in first[1]]) == 2
        np.testing.assert_array_equal(np.asarray(await first[0][0].result()), x * 2.0)


def test_replicas_share_the_configuration(start_server: Callable[..., str], redis_url: str,
                                          redis_prefix: str) -> None:
    """Set on one replica (through Redis), the next call on another batches."""
    env = {"REDIS_URL": redis_url, "JITSERVE_REDIS_PREFIX": redis_prefix,
           "JITSERVE_CACHE_SECRET": "batching-e2e-cache-secret-" + "7e2a" * 8,
           "JITSERVE_API_KEYS": ",".join(AUTH_KEYS)}
    one, two = start_server(env, "one"), start_server(env, "two")
    with Client(one, api_key=ALICE) as a, Client(two, api_key=ALICE) as b:
        pid = a.upload(_poly(mlp)).program_id
        a.set_batching(pid, max_batch_size=8, max_delay_ms=1)
        assert b.get_batching(pid)["max_batch_size"] == 8
        x, s = _inputs(2, 400)
        _check([np.asarray(o) for o in b.execute(pid, [x, s])], x, s)
        assert _batches(two)[1] == 1
        a.clear_batching(pid)
        assert b.get_batching(pid)["enabled"] is False
