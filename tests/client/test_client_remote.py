"""RemoteArray and AsyncRemoteArray: metadata, one shared fetch, numpy protocol, deletion."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import numpy as np
import pytest
from client_fakes import FakeServer

from jitserve.client import (
    AsyncClient,
    AsyncRemoteArray,
    Aval,
    Client,
    FutureFailed,
    JitserveTimeout,
    NotFound,
    RemoteArray,
)
from jitserve.client._base import _Execution
from jitserve.client._remote import _FutureState

pytestmark = pytest.mark.timeout(60)

OUTS = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(7, np.int64)]


def future(server: FakeServer, c: Client | AsyncClient, outputs: list[np.ndarray] = OUTS,
           status: str = "done", error: dict[str, Any] | None = None) -> list[Any]:
    """Remote arrays for a future the fake server already holds."""
    fid = f"f{len(server.futures)}"
    avals = [{"shape": list(o.shape), "dtype": o.dtype.name} for o in outputs]
    server.futures[fid] = {"future_id": fid, "status": status, "error": error,
                           "outputs": list(outputs), "out_avals": avals}
    ex = _Execution(fid, tuple(Aval(o.shape, o.dtype.name) for o in outputs), None, None)
    return c._wrap(ex)


def result_calls(server: FakeServer) -> int:
    return sum(p.endswith("/result") for p in server.paths())


def test_metadata_without_any_request(server: FakeServer, client: Client) -> None:
    a, b = future(server, client)
    assert isinstance(a, RemoteArray)
    assert (a.shape, a.dtype, a.ndim, a.size, a.nbytes) == ((2, 3), np.float32, 2, 6, 24)
    assert (b.shape, b.dtype, b.ndim, b.size) == ((), np.int64, 0, 1)
    assert (a.future_id, a.index, b.index) == ("f0", 0, 1)
    assert a.ref() == {"future": "f0", "output": 0}
    assert repr(a) == "RemoteArray(future='f0', index=0, shape=(2, 3), dtype=float32, remote)"
    assert server.requests == []


def test_siblings_share_one_fetch(server: FakeServer, client: Client) -> None:
    a, b = future(server, client)
    np.testing.assert_array_equal(a.result(), OUTS[0])
    assert b.result() == 7 and b.result().shape == ()
    np.testing.assert_array_equal(np.asarray(a), OUTS[0])
    assert result_calls(server) == 1
    assert "fetched" in repr(b)


def test_concurrent_result_calls_fetch_once(server: FakeServer, client: Client) -> None:
    arrays = future(server, client)
    server.pending_polls = 2
    got: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda i=i: got.append(arrays[i % 2].result(timeout=5)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 6
    assert result_calls(server) == 3  # two pending polls, then one fetch for all


def test_array_protocol(server: FakeServer, client: Client) -> None:
    a, _ = future(server, client)
    assert np.asarray(a, dtype=np.float64).dtype == np.float64
    copy = np.array(a, copy=True)
    copy[0, 0] = 100  # a copy is writable; the fetched value is not touched
    assert a.result()[0, 0] == 0
    assert np.asarray(a).sum() == 15
    with pytest.raises(ValueError, match="needs a copy"):
        a.__array__(np.float64, copy=False)


def test_done_and_block_until_ready(server: FakeServer, client: Client) -> None:
    a, _ = future(server, client)
    server.pending_polls = 1
    assert a.done() is False  # the fake says "running" while polls are pending
    server.pending_polls = 0
    assert a.done() is True
    assert a.block_until_ready() is a
    # Like jax: waiting leaves the value on the server; nothing was downloaded.
    assert not any(str(r.url.path).endswith("/result") for r in server.requests)


def test_result_timeout(server: FakeServer, client: Client) -> None:
    a, _ = future(server, client)
    server.pending_polls = 10**6
    with pytest.raises(JitserveTimeout):
        a.result(timeout=0.3)


def test_failed_future(server: FakeServer, client: Client) -> None:
    a, _ = future(server, client, status="failed",
                  error={"code": "internal", "message": "device lost"})
    with pytest.raises(FutureFailed, match="device lost") as info:
        a.result()
    assert info.value.details["cause"]["code"] == "internal"


def test_delete_frees_only_that_output(server: FakeServer, client: Client) -> None:
    a, b = future(server, client)
    a.delete()
    a.delete()  # a second time does nothing, as in jax
    assert server.released == [("f0", 0)]
    assert b.result() == 7  # the sibling's fetch asks for its own output only
    assert server.requests[-1].url.params["outputs"] == "1"
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        a.result()
    client.delete("f0")
    with pytest.raises(NotFound):
        client.result("f0")


def test_fetched_values_survive_delete(server: FakeServer, client: Client) -> None:
    a, b = future(server, client)
    a.result()
    a.delete()
    assert b.result() == 7


def test_unknown_dtype_from_server_is_a_protocol_error() -> None:
    from jitserve.client import FutureInfo, ProtocolError

    doc = {"future_id": "f", "status": "done", "out_avals": [{"shape": [1], "dtype": "float128"}]}
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        FutureInfo.from_json(doc)


def test_missing_output_is_a_protocol_error(server: FakeServer, client: Client) -> None:
    from jitserve.client import ProtocolError

    a, b = future(server, client)
    server.futures["f0"]["outputs"] = OUTS[:1]
    with pytest.raises(ProtocolError, match="output 1 is missing"):
        b.result()


async def test_async_remote_array(server: FakeServer, aclient: AsyncClient) -> None:
    a, b = future(server, aclient)
    assert isinstance(a, AsyncRemoteArray)
    with pytest.raises(TypeError, match="not fetched yet"):
        np.asarray(a)
    server.pending_polls = 1
    assert await a.done() is False
    server.pending_polls = 0
    np.testing.assert_array_equal(await a.result(timeout=5), OUTS[0])
    assert await b == 7  # awaiting the array is awaiting its result
    np.testing.assert_array_equal(np.asarray(a), OUTS[0])
    assert result_calls(server) == 1
    assert await a.done() is True
    assert await a.block_until_ready() is a


async def test_async_concurrent_fetch_once(server: FakeServer, aclient: AsyncClient) -> None:
    import asyncio

    arrays = future(server, aclient)
    server.pending_polls = 1
    got = await asyncio.gather(*(arrays[i % 2].result() for i in range(5)))
    assert len(got) == 5 and result_calls(server) == 2


async def test_async_timeout_and_delete(server: FakeServer, aclient: AsyncClient) -> None:
    a, b = future(server, aclient)
    server.pending_polls = 10**6
    with pytest.raises(JitserveTimeout):
        await a.result(timeout=0.3)
    await a.delete()
    await b.delete()
    assert server.futures == {}
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        await b.result()


def test_a_sibling_released_meanwhile_leaves_the_fetch_to_its_own_output(
        server: FakeServer, client: Client) -> None:
    # Another thread (a running-ahead sender letting go of a sent call's inputs) may
    # release a sibling between the fetch's reading of what to ask and the answer.
    loss, small = future(server, client, [np.float32(0.5), np.arange(3.0)])
    server._release([{"future": loss.future_id, "output": 1}])  # behind the client's back
    assert float(loss) == 0.5
    asked = [r.url.params.get("outputs") for r in server.requests if r.url.path.endswith("/result")]
    assert asked == ["0,1", "0"]
    with pytest.raises(NotFound):  # the released one itself still says so
        np.asarray(small)


async def test_an_async_sibling_released_meanwhile_leaves_the_fetch_to_its_own_output(
        server: FakeServer, aclient: AsyncClient) -> None:
    loss, small = future(server, aclient, [np.float32(0.5), np.arange(3.0)])
    server._release([{"future": loss.future_id, "output": 1}])
    assert float(await loss) == 0.5
    with pytest.raises(NotFound):
        await small


def test_a_fetch_brings_small_siblings_and_leaves_big_ones(server: FakeServer, client: Client) -> None:
    # A training step's loss beside its model: reading the loss downloads the loss (and
    # what is small), not the model; the model's arrays are fetched when read.
    from jitserve.client._remote import SIBLING_BYTES

    big = np.zeros(SIBLING_BYTES // 4 + 1, np.float32)
    loss, small, model = future(server, client, [np.float32(0.5), np.arange(3.0), big])
    assert float(loss) == 0.5
    asked = [r.url.params.get("outputs") for r in server.requests if r.url.path.endswith("/result")]
    assert asked == ["0,1"]
    np.testing.assert_array_equal(np.asarray(small), np.arange(3.0))  # came along
    np.testing.assert_array_equal(np.asarray(model), big)  # a fetch of its own
    asked = [r.url.params.get("outputs") for r in server.requests if r.url.path.endswith("/result")]
    assert asked == ["0,1", "2"]


def test_a_kept_refusal_is_raised_anew_and_keeps_no_frames() -> None:
    """A refused call's error is raised on every use of its outputs: a copy each time
    (same class, message, fields), so the kept one holds no traceback, and the
    frames a raise went through, with the arrays in their locals, go when the caller
    is done with them (they stayed as long as the call's other outputs lived)."""
    class Big:
        pass

    state = _FutureState(None, None, 1, None)  # type: ignore[arg-type]
    kept = FutureFailed("refused", status_code=422, code="future_failed", details={"root": 1})
    state.sent(None, kept)

    def use() -> weakref.ref[Big]:
        big = Big()
        for _ in range(2):
            try:  # not pytest.raises: its ExceptionInfo and this frame would be a cycle
                state.future_id  # noqa: B018 - raises
            except FutureFailed as e:
                assert e is not kept and str(e) == str(kept) and e.details == {"root": 1}
            else:
                pytest.fail("no error")
        return weakref.ref(big)

    gc.disable()
    try:
        big = use()
        assert big() is None and kept.__traceback__ is None
    finally:
        gc.enable()


def test_a_failed_read_leaves_no_cycle_to_the_reader_s_arrays(server: FakeServer,
                                                                client: Client) -> None:
    """The error of a failed read goes through the client's driver, which held it in
    a variable of a frame in its own traceback: a cycle, freed only by the garbage
    collector, that kept every frame the error went through, and the reader's
    arrays in their locals, until it ran."""
    class Big:
        pass

    a, _ = future(server, client, status="failed",
                  error={"code": "internal", "message": "device lost"})

    def read() -> weakref.ref[Big]:
        big = Big()
        try:  # not pytest.raises: its ExceptionInfo and this frame would be a cycle
            a.result()
        except FutureFailed:
            pass
        else:
            pytest.fail("no error")
        return weakref.ref(big)

    gc.collect()
    gc.disable()
    try:
        big = read()
        assert big() is None, [type(r).__name__ for r in gc.get_referrers(big())]
    finally:
        gc.enable()
