"""client.jit against the fake server: tracing, signatures, caching, chaining, upload."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from client_fakes import FAST, FakeServer, error, executes, held

from jitserve.client import (
    AsyncClient,
    AsyncRemoteArray,
    AsyncRemoteFunction,
    Client,
    NotFound,
    PayloadTooLarge,
    ProgramError,
    RemoteArray,
    RemoteFunction,
    Timeout,
    wire,
)

pytestmark = pytest.mark.timeout(120)

X = np.arange(6, dtype=np.float32).reshape(2, 3)


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every jax.export.export call made while tracing."""
    calls: list[Any] = []
    real = jax.export.export

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(kw.get("platforms"))
        return real(*args, **kw)

    monkeypatch.setattr(jax.export, "export", counting)
    return calls


def test_pytrees_in_and_out(client: Client) -> None:
    def fn(x: Any, pair: Any, *, scale: Any) -> Any:
        return {"sum": x + pair[0], "rest": (pair[1] * scale, None), "n": jnp.sum(x)}

    f = client.jit(fn)
    assert isinstance(f, RemoteFunction) and f.__name__ == "fn"
    out = f(X, (X, np.int32(3)), scale=np.int32(2))
    assert set(out) == {"sum", "rest", "n"} and out["rest"][1] is None
    assert all(isinstance(v, RemoteArray) for v in jax.tree_util.tree_leaves(out))
    # Shapes and dtypes are known before anything is fetched.
    assert (out["sum"].shape, out["sum"].dtype, out["n"].shape) == ((2, 3), np.float32, ())
    expected = jax.jit(fn)(X, (X, np.int32(3)), scale=np.int32(2))
    for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want))
        assert got.dtype == want.dtype and got.shape == want.shape


def test_requests_of_first_and_later_calls(each_client: Client, server: FakeServer,
                                           exports: list[Any]) -> None:
    f = each_client.jit(jnp.sin)
    f(X)  # a signature's first call waits for the server to take it, running ahead or not
    pid = next(iter(server.programs))
    assert server.paths() == ["GET /v1/devices", f"GET /v1/programs/{pid}", "POST /v1/programs",
                              f"POST /v1/programs/{pid}/execute"]
    server.requests.clear()
    f(X + 1)
    if each_client._ahead is not None:  # queued, and sent in a batch
        assert each_client._ahead.flush(5)
        assert server.paths() == ["POST /v1/calls"]
        [call] = executes(server)
        assert (call["program_id"], call["inline"]) == (pid, True)
        np.testing.assert_array_equal(call["args"][0], X + 1)
    else:
        assert server.paths() == [f"POST /v1/programs/{pid}/execute"]  # no trace, check, upload
    assert len(exports) == 1 and f._cache_size() == 1


def test_program_id_is_the_sha256_of_the_export(client: Client, server: FakeServer) -> None:
    import hashlib

    client.jit(jnp.cos)(X)
    ((pid, blob),) = server.programs.items()
    assert pid == hashlib.sha256(blob).hexdigest()
    assert jax.export.deserialize(bytearray(blob)).platforms == ("cpu",)


def test_upload_skipped_when_the_server_has_the_program(client: Client, server: FakeServer) -> None:
    client.jit(jnp.tanh)(X)
    server.requests.clear()
    client.jit(jnp.tanh)(X)  # a new RemoteFunction: the client knows the program is there
    assert [p.split(" ")[0] for p in server.paths()] == ["POST"]
    with Client("http://jitserve.test", api_key=None, timeout=FAST,
                transport=httpx.MockTransport(server)) as other:
        server.requests.clear()
        other.jit(jnp.tanh)(X)  # a new client: checks, finds it, does not upload
    assert [p.split(" ")[0] for p in server.paths()] == ["GET", "GET", "POST"]
    assert not any(p == "POST /v1/programs" for p in server.paths())


def test_new_signatures_trace_again(client: Client, exports: list[Any]) -> None:
    f = client.jit(lambda x: x * 2)
    f(X)
    f(X[:1])                       # new shape
    f(X.astype(np.int32))          # new dtype
    f((X,)[0])                     # same as the first
    f(2.0)                         # weak-typed scalar
    f(np.float32(2.0))             # strong float32 scalar: a different signature
    assert f._cache_size() == len(exports) == 5


def test_static_argnums_and_argnames(client: Client, server: FakeServer, exports: list[Any]) -> None:
    def power(x: Any, n: int, *, mode: str = "pow") -> Any:
        return x ** n if mode == "pow" else x * n

    f = client.jit(power, static_argnums=1, static_argnames="mode")
    np.testing.assert_allclose(np.asarray(f(X, 2)), X ** 2)
    np.testing.assert_allclose(np.asarray(f(X, n=3)), X ** 3)  # by name: still static
    np.testing.assert_allclose(np.asarray(f(X, 2, mode="mul")), X * 2)
    np.testing.assert_allclose(np.asarray(f(X, 2)), X ** 2)
    assert len(exports) == 3
    assert all(len(body["args"]) == 1 for body in executes(server))  # statics are not sent


def test_static_argnames_given_positionally(client: Client) -> None:
    f = client.jit(lambda x, n: jnp.tile(x, n), static_argnames="n")
    assert f(X, 2).shape == (2, 6)


def test_negative_static_argnum(client: Client) -> None:
    f = client.jit(lambda x, shape: jnp.broadcast_to(x, shape), static_argnums=-1)
    assert f(np.float32(1), (2, 2)).shape == (2, 2)


def test_unhashable_static_argument(client: Client) -> None:
    f = client.jit(lambda x, opts: x, static_argnums=1)
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        f(X, {"a": 1})


@pytest.mark.parametrize("transform", [
    lambda f: jax.jit(f), lambda f: jax.grad(lambda x: f(x).sum()), lambda f: jax.vmap(f),
    lambda f: functools.partial(jax.eval_shape, f)], ids=["jit", "grad", "vmap", "eval_shape"])
def test_a_call_inside_a_jax_transformation_says_to_put_the_transformation_inside(
        client: Client, server: FakeServer, transform: Callable[[Any], Any]) -> None:
    f = client.jit(lambda x: x * 2)
    with pytest.raises(TypeError, match=r"<lambda> was called with a jax tracer \(float32\[.*"
                                        r"client.jit\(jax.grad\(fn\)\)"):
        transform(f)(X)
    assert not server.requests  # refused before anything is traced or sent


def test_a_program_over_the_server_s_size_says_its_constants_are_the_cause(
        client: Client, server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "_post_programs", lambda request: error(
        413, "payload_too_large", f"request body is {len(request.content):,} bytes, over the "
        "limit of 1,024 bytes (JITSERVE_MAX_PROGRAM_BYTES)"))
    table = np.arange(4096, dtype=np.float32)

    def lookup(i: Any) -> Any:
        return jnp.asarray(table)[i]  # a constant of the program: 16 KiB of it

    with pytest.raises(PayloadTooLarge, match=r"over the limit of 1,024 bytes .*: lookup's "
                                              r"program is [\d,]+ bytes\. The arrays a function "
                                              r"closes over are constants of its program"):
        client.jit(lookup)(np.int32(3))


@pytest.fixture(params=[False, True], ids=["x32", "x64"])
def x64(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Run with jax_enable_x64 off and on (the caller's choice, as with jax.jit)."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", request.param)
    yield request.param
    jax.config.update("jax_enable_x64", before)


def test_scalars_and_x64_follow_jax_jit(client: Client, server: FakeServer, x64: bool) -> None:
    def fn(a: Any, b: Any, c: Any, d: Any) -> Any:
        return (a + 1, b, c, d)

    f = client.jit(fn)
    inputs = (2.5, 7, True, np.arange(3, dtype=np.float64))
    out = f(*inputs)
    wide = ["float64", "int64", "bool", "float64"]
    narrow = ["float32", "int32", "bool", "float32"]
    args = executes(server)[0]["args"]
    assert [a.dtype.name for a in args] == (wide if x64 else narrow)
    expected = jax.jit(fn)(*inputs)
    assert [o.dtype for o in out] == [e.dtype for e in expected]
    np.testing.assert_allclose(out[0].result(), 3.5)


def test_x64_setting_is_part_of_the_signature(client: Client, exports: list[Any]) -> None:
    f = client.jit(lambda a: a * 2)
    before = jax.config.jax_enable_x64
    try:
        for flag in (False, True, False):
            jax.config.update("jax_enable_x64", flag)
            assert f(1.5).dtype == (np.float64 if flag else np.float32)
    finally:
        jax.config.update("jax_enable_x64", before)
    assert len(exports) == 2


def test_jax_arrays_as_inputs(client: Client) -> None:
    y = client.jit(lambda a: a.T)(jnp.asarray(X))
    np.testing.assert_array_equal(np.asarray(y), X.T)


def test_chaining_keeps_data_on_the_server(each_client: Client, server: FakeServer) -> None:
    f = each_client.jit(lambda a, b: a @ b)
    y = f(X, X.T)
    z = f(y, y)
    assert each_client._ahead is None or each_client._ahead.flush(5)
    assert not any(p.endswith("/result") for p in server.paths())
    assert executes(server)[1]["args"] == [{"future": y.future_id, "output": 0}] * 2
    np.testing.assert_allclose(np.asarray(z), (X @ X.T) @ (X @ X.T))


def test_remote_array_of_another_client_is_sent_inline(client: Client) -> None:
    other_server = FakeServer()
    with Client("http://other.test", api_key=None, timeout=FAST,
                transport=httpx.MockTransport(other_server)) as other:
        y = other.jit(jnp.negative)(X)
        z = client.jit(jnp.abs)(y)
    np.testing.assert_array_equal(np.asarray(z), X)


def test_reupload_when_the_server_lost_the_program(each_client: Client,
                                                   server: FakeServer) -> None:
    f = each_client.jit(jnp.exp)
    f(X)
    server.programs.clear()  # a restart with a fresh store
    server.requests.clear()
    np.testing.assert_allclose(np.asarray(f(X)), np.exp(X), rtol=1e-6)
    call = "POST calls" if each_client._ahead is not None else "POST execute"
    assert [p.split(" ")[0] + " " + p.split("/")[-1] for p in server.paths()] == [
        call, f"GET {next(iter(server.programs))}", "POST programs", call]
    # the retried call held its answer too: the outputs came with it


def test_missing_future_reference_is_not_found(each_client: Client, server: FakeServer) -> None:
    f = each_client.jit(jnp.exp)
    y = f(X)
    each_client.delete(y.future_id)  # behind the array's back
    if each_client._ahead is None:
        with pytest.raises(NotFound, match="unknown future"):
            f(y)
    else:  # an asynchronous error: raised on the first use of the call's outputs
        z = f(y)
        with pytest.raises(NotFound, match="call of exp: unknown future"):
            np.asarray(z)


def test_deleted_array_cannot_be_used(client: Client, server: FakeServer) -> None:
    f = client.jit(jnp.exp)
    y = f(X)
    y.delete()
    assert y.is_deleted() and server.released == [(y.future_id, 0)]
    server.requests.clear()
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        f(y)
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        np.asarray(y)
    assert server.requests == []


def test_outputs_none_and_zero_leaves(client: Client) -> None:
    assert client.jit(lambda x: None)(X) is None
    assert client.jit(lambda x: ())(X) == ()


def test_decorator_forms(client: Client) -> None:
    @client.jit
    def double(x: Any) -> Any:
        return x * 2

    @client.jit(static_argnums=1)
    def scale(x: Any, k: float) -> Any:
        return x * k

    np.testing.assert_array_equal(np.asarray(double(X)), X * 2)
    np.testing.assert_array_equal(np.asarray(scale(X, 3.0)), X * 3)
    assert "double" in repr(double)


def test_exports_for_the_server_platform(client: Client, server: FakeServer,
                                         exports: list[Any]) -> None:
    server.devices_doc = {"platform": "gpu", "platform_version": "cuda 12.4"}
    with pytest.raises(ProgramError, match="platform_mismatch"):
        client.jit(jnp.sin)(X)  # the fake runs CPU programs only
    assert exports == [("cuda",)]
    (blob,) = server.programs.values()
    assert jax.export.deserialize(bytearray(blob)).platforms == ("cuda",)


def test_failed_execution_surfaces_on_result(client: Client, server: FakeServer) -> None:
    from jitserve.client import FutureFailed

    server.fail_with = {"code": "internal", "message": "out of device memory"}
    y = client.jit(jnp.sin)(X)
    with pytest.raises(FutureFailed, match="out of device memory"):
        y.result(timeout=5)


def test_program_errors_raise_at_call(client: Client, server: FakeServer) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"error": {"code": "unsafe_program",
                                                   "message": "custom_call foo not allowed"}})

    server._post_programs = refuse  # type: ignore[method-assign]
    with pytest.raises(ProgramError, match="custom_call foo"):
        client.jit(jnp.sin)(X)


async def test_async_jit(aclient: AsyncClient, server: FakeServer) -> None:
    f = aclient.jit(lambda a, n: {"y": a * n}, static_argnums=1)
    assert isinstance(f, AsyncRemoteFunction)
    out = await f(X, 3)
    y = out["y"]
    assert isinstance(y, AsyncRemoteArray) and y.shape == (2, 3)
    z = await f(y, 2)
    np.testing.assert_array_equal(await z["y"].result(timeout=5), X * 6)
    assert executes(server)[1]["args"] == [{"future": y.future_id, "output": 0}]

    @aclient.jit
    def neg(a: Any) -> Any:
        return -a

    np.testing.assert_array_equal(await (await neg(X)), -X)


def test_small_outputs_come_back_with_the_call(each_client: Client, server: FakeServer) -> None:
    f = each_client.jit(lambda a: (jnp.sin(a), a.sum()))
    f(X)
    server.requests.clear()
    y, total = f(X + 1)
    assert each_client._ahead is not None or y.is_ready()  # waiting: the answer had them
    np.testing.assert_allclose(np.asarray(y), np.sin(X + 1), rtol=1e-6)
    assert y.is_ready()  # nothing left to ask
    assert float(total) == float((X + 1).sum())
    assert server.paths() == ([f"POST /v1/programs/{next(iter(server.programs))}/execute"]
                              if each_client._ahead is None else ["POST /v1/calls"])
    # Timeout.hold, in ms; running ahead, Timeout.poll when the reader was waiting
    # before the batch was built (``_FutureState.awaited``).
    poll = str(round(each_client.timeout.poll * 1000))
    assert held(server) == ["2"] or (each_client._ahead is not None and held(server) == [poll])
    z = f(y)[0]  # a held answer still names a future: chaining keeps data on the server
    assert each_client._ahead is None or each_client._ahead.flush(5)
    assert executes(server)[-1]["args"] == [{"future": y.future_id, "output": 0}]
    np.testing.assert_allclose(np.asarray(z), np.sin(np.sin(X + 1)), rtol=1e-6)


def test_a_reader_s_batch_waits_only_the_hold_while_several_threads_call(
        client: Client, server: FakeServer) -> None:
    """Running ahead, a batch a reader waits for may wait for the whole run, and the
    sender sends nothing meanwhile: not while calls come from several threads, whose
    calls would wait for it too (``_Batches._queued_by``)."""
    f = client.jit(lambda a: (jnp.sin(a), a.sum()))
    f(X)
    other = threading.Thread(target=lambda: f(X + 2))
    other.start()
    other.join(10)
    assert client._ahead is not None and client._ahead.flush(5)
    server.requests.clear()
    for k in range(3):
        np.testing.assert_allclose(np.asarray(f(X + k)[0]), np.sin(X + k), rtol=1e-6)
    assert held(server) == ["2"] * 3  # Timeout.hold, in ms, never Timeout.poll


def test_big_outputs_are_not_held(each_client: Client, server: FakeServer) -> None:
    n = wire.INLINE_OUTPUTS_BYTES // 4 + 1  # float32: one element past the limit
    f = each_client.jit(lambda a: jnp.zeros(n, jnp.float32) + a.sum())
    f(X)
    y = f(X)
    assert each_client._ahead is None or each_client._ahead.flush(5)
    assert held(server) == [None, None]  # they would come back whole, wanted or not
    np.testing.assert_array_equal(np.asarray(y), np.full(n, X.sum(), np.float32))
    assert server.paths()[-1].startswith("GET /v1/futures/")


def test_a_signature_that_misses_the_hold_stops_asking_for_a_while(
        waits: Client, server: FakeServer) -> None:
    f = waits.jit(jnp.cos)
    server.hold_execute = True  # every answer comes before the outputs
    for _ in range(1 + 2 + 1 + 4 + 1):
        f(X)
    # a miss, two calls that do not ask; a second miss, four that do not ask; ask again
    assert held(server) == ["2", None, None, "2", None, None, None, None, "2"]
    server.hold_execute = False
    server.requests.clear()
    for _ in range(1 + 8 + 3):
        f(X)
    assert held(server) == [None] * 8 + ["2"] * 4  # the skips left, then a hit: ask on


@pytest.mark.parametrize("run_ahead", [32, 0])
async def test_async_small_outputs_come_back_with_the_call(
        server: FakeServer, run_ahead: int) -> None:
    async with AsyncClient("http://jitserve.test", api_key=None, timeout=FAST,
                           transport=httpx.MockTransport(server), run_ahead=run_ahead) as c:
        f = c.jit(jnp.sin)
        await f(X)
        server.requests.clear()
        y = await f(X)
        if run_ahead:  # on its way: its batch's answer brings the values
            assert not await y.is_ready()
            np.testing.assert_allclose(await y, np.sin(X), rtol=1e-6)
            assert server.paths() == ["POST /v1/calls"]
        np.testing.assert_allclose(y._local(), np.sin(X), rtol=1e-6)  # fetched: no await needed
        # Running ahead, the reader awaits before the loop's sender builds the batch,
        # which then asks for as long as a fetch would (``_FutureState.awaited``).
        assert held(server) == ([str(round(FAST.poll * 1000))] if run_ahead else ["2"])
        assert len(server.paths()) == 1


@pytest.mark.parametrize("run_ahead", [32, 0])
def test_hold_zero_never_asks(server: FakeServer, run_ahead: int) -> None:
    with Client("http://jitserve.test", api_key=None, timeout=Timeout(5.0, poll=0.2, hold=0),
                transport=httpx.MockTransport(server), run_ahead=run_ahead) as c:
        f = c.jit(jnp.sin)
        f(X)
        np.testing.assert_allclose(np.asarray(f(X)), np.sin(X), rtol=1e-6)
    assert held(server) == [None, None]


def test_a_result_s_timeout_covers_a_call_still_on_its_way(client: Client,
                                                            server: FakeServer) -> None:
    import threading

    from jitserve.client import JitserveTimeout

    f = client.jit(jnp.sin)
    f(X)  # the first call waits; the next ones run ahead
    server.calls_gate = threading.Event()
    y = f(X + 1)
    try:
        assert not y.is_ready()
        with pytest.raises(JitserveTimeout, match="not done after 0.2 s"):
            y.result(timeout=0.2)
    finally:
        server.calls_gate.set()
    np.testing.assert_allclose(y.result(timeout=10), np.sin(X + 1), rtol=1e-6)


async def test_an_async_result_s_timeout_covers_a_call_still_on_its_way(
        server: FakeServer) -> None:
    import asyncio

    from jitserve.client import JitserveTimeout

    gate = asyncio.Event()
    gate.set()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/calls":
            await gate.wait()  # in the loop: the fake's own gate would block it
        return server(request)

    async with AsyncClient("http://jitserve.test", api_key=None, timeout=FAST,
                           transport=httpx.MockTransport(handler)) as c:
        f = c.jit(jnp.sin)
        await f(X)
        gate.clear()
        y = await f(X + 1)
        try:
            with pytest.raises(JitserveTimeout, match="not done after 0.2 s"):
                await y.result(timeout=0.2)
        finally:
            gate.set()
        np.testing.assert_allclose(await asyncio.wait_for(y.result(), 10), np.sin(X + 1),
                                   rtol=1e-6)


def test_jit_needs_a_callable(client: Client) -> None:
    with pytest.raises(TypeError, match="callable"):
        client.jit(3)  # type: ignore[call-overload]


def test_functools_partial(client: Client) -> None:
    f = client.jit(functools.partial(jnp.add, 1.0))
    np.testing.assert_array_equal(np.asarray(f(X)), X + 1)
