"""Remote arrays without a server: the array API on fetched values, lifetime and releases,
compile progress, and the error a failed compile arrives as."""

from __future__ import annotations

import copy
import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jitserve.client import (
    AsyncClient,
    Aval,
    Client,
    CompileError,
    FutureFailed,
    ProgramError,
    RemoteArray,
    _progress,
)
from jitserve.client._base import _Execution
from jitserve.client._release import ReleaseQueue
from jitserve.client._remote import KeyType, _FutureState
from jitserve.client.errors import error_from_response

pytestmark = pytest.mark.timeout(60)

X = np.arange(12, dtype=np.float32).reshape(3, 4)
S = np.array(2.5, np.float32)


@pytest.fixture
def offline() -> Iterator[Client]:
    """A client whose arrays come already fetched: nothing here talks to a server."""
    with Client("http://offline.invalid", api_key=None, progress=False) as c:
        yield c


def fetched(c: Client | AsyncClient, *values: np.ndarray) -> list[Any]:
    """Remote arrays already fetched, their values read-only copies, as the wire's are."""
    avals = tuple(Aval(v.shape, v.dtype.name) for v in values)
    return c._wrap(_Execution("f1", avals, [_read_only(v) for v in values], None))


def _read_only(value: np.ndarray) -> np.ndarray:
    value = value.copy()
    value.flags.writeable = False
    return value


def test_metadata_and_conversions(offline: Client) -> None:
    y, s = fetched(offline, X, S)
    assert (y.shape, y.dtype, y.ndim, y.size, y.nbytes, len(y)) == ((3, 4), np.float32, 2, 12, 48, 3)
    assert float(s) == 2.5 and int(s) == 2 and bool(s) and complex(s) == 2.5
    assert s.item() == 2.5 and y.tolist() == X.tolist() and y.item(5) == 5.0
    assert f"{s:.2f}" == "2.50" and f"{s}" == str(s) == "2.5"  # printed as jax prints
    assert round(s) == 2 and round(y).dtype.kind == "i" and round(s, 1) == 2.5
    assert divmod(s, 2) == (1.0, 0.5)
    assert divmod(7, s) == (2.0, 2.0) and 5.0 in y and 99.0 not in y
    assert y.tobytes() == X.tobytes() and y.weak_type is False
    with pytest.raises(TypeError, match=r"immutable.*x.at\[idx\].set\(y\)"):
        y[0] = 1.0
    # What indexing and views give is the caller's own, as a jax array's results are:
    # in-place arithmetic on it changes it alone (not the fetched value every read shares).
    for part in (y[...], y[1:], y.reshape(-1), y.T, next(iter(y)), y.real):
        part += 1
    np.testing.assert_array_equal(np.asarray(y), X)
    assert str(y) == f"{y}" == str(X) and repr(y).startswith("RemoteArray(future=")
    with pytest.raises(TypeError, match="len"):
        len(s)
    with pytest.raises(TypeError):
        hash(y)  # unhashable, like jax and numpy arrays


def test_indexing_and_arithmetic_apply_numpy(offline: Client) -> None:
    y, s = fetched(offline, X, S)
    cases = [
        (y + 1, X + 1), (1 - y, 1 - X), (y * s, X * S), (y / 2, X / 2), (2 ** y, 2 ** X),
        (y @ X.T, X @ X.T), (X.T @ y, X.T @ X), (-y, -X), (abs(-y), X), (y // 3, X // 3),
        (y % 3, X % 3), (y == 0, X == 0), (y != 0, X != 0), (y < 5, X < 5), (y >= 5, X >= 5),
        (y[1], X[1]), (y[:, 2], X[:, 2]), (y[y > 3], X[X > 3]), (y + y, X + X),
        (np.sin(y), np.sin(X)), (list(y)[2], X[2]),
    ]
    for got, want in cases:
        assert isinstance(got, np.ndarray | np.generic)
        np.testing.assert_array_equal(got, want)


def test_jax_array_s_methods_apply_numpy_to_the_value(offline: Client) -> None:
    y, s = fetched(offline, X, S)
    cases = [
        (y.T, X.T), (y.mT, X.T), (y.astype(np.int32), X.astype(np.int32)),
        (y.reshape(2, 6), X.reshape(2, 6)), (y.ravel(), X.ravel()), (y.flatten(), X.ravel()),
        (y.sum(), X.sum()), (y.sum(axis=0), X.sum(axis=0)), (y.mean(1), X.mean(1)),
        (y.std(), X.std()), (y.var(), X.var()), (y.min(), 0), (y.max(axis=1), X.max(axis=1)),
        (y.prod(), X.prod()), (y.argmax(), 11), (y.argmin(), 0), (y.any(), True), (y.all(), False),
        (y.cumsum(), X.cumsum()), (y.cumprod(axis=1), X.cumprod(axis=1)),
        (y.clip(2, 5), X.clip(2, 5)), (y.round(), X.round()), (y.dot(X.T), X @ X.T),
        (y.dot(y.T), X @ X.T), (y.take([0, 5]), X.take([0, 5])), (y.squeeze(), X),
        (y.swapaxes(0, 1), X.T), (y.transpose(), X.T), (y.diagonal(), X.diagonal()),
        (y.trace(), X.trace()), (y.repeat(2, axis=0), X.repeat(2, axis=0)),
        (y.sort(axis=0), np.sort(X, axis=0)), (y.argsort(axis=1), X.argsort(axis=1)),
        (y.ptp(), np.ptp(X)), (y.real, X), (y.imag, X * 0), (y.conj(), X), (y.copy(), X),
        (y.view(np.int32), X.view(np.int32)), (y.nonzero()[0], X.nonzero()[0]),
        (y.ravel().searchsorted(5.5), 6), (np.asarray(list(y.flat)), X.ravel()),
        (y.byteswap(), X.byteswap()),
        (s.astype(np.float16), S.astype(np.float16)),
    ]
    for got, want in cases:
        assert isinstance(got, np.ndarray | np.generic)
        np.testing.assert_array_equal(got, want)
    assert y.itemsize == 4 and y.copy().flags.writeable  # a copy is the caller's own
    assert y.sort.__doc__ and "numpy.sort" in y.sort.__doc__ and "ndarray.sum" in y.sum.__doc__


def test_remote_arrays_have_jax_array_s_methods_but_where_it_lives() -> None:
    """What ``jax.Array`` has that a remote array has not: what says where an array lives
    among this process's devices. A method a new jax adds fails here until it is decided."""
    placement = {"addressable_data", "addressable_shards", "committed", "device",
                 "devices", "format", "global_shards", "is_fully_addressable",
                 "is_fully_replicated", "on_device_size_in_bytes", "to_device", "traceback",
                 "unsafe_buffer_pointer"}
    public = {n for n in dir(jax.Array) if not n.startswith("_")}
    assert public - placement - set(dir(RemoteArray)) == set()


def test_without_jax_a_copy_is_the_value(offline: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server makes a copy with a jitted identity, which needs jax; a client installed
    without it (``pip install jitserve``) copies the value instead."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax" else real(name, *a))
    y, = fetched(offline, X)
    kept = copy.deepcopy({"y": y})["y"]
    assert type(kept) is np.ndarray and kept.flags.writeable and kept.tolist() == X.tolist()
    assert not y.is_deleted()


def test_jax_functions_take_remote_arrays(offline: Client) -> None:
    y, s = fetched(offline, X, S)
    assert float(jnp.sum(y)) == X.sum()
    np.testing.assert_array_equal(jnp.dot(y, X.T), X @ X.T)
    np.testing.assert_array_equal(jnp.ones(4) + y, 1 + X)
    np.testing.assert_array_equal(jax.jit(lambda a: a * 2)(y), X * 2)
    assert isinstance(y.__jax_array__(), jax.Array)
    assert float(jax.grad(lambda a: jnp.sum(a * a))(s)) == 5.0


def test_key_outputs_have_the_key_type(offline: Client) -> None:
    keys = jax.random.split(jax.random.key(3), 4)
    data = np.asarray(jax.random.key_data(keys))
    (k,) = offline._wrap(_Execution("f1", (Aval((4, 2), "uint32"),), [data], None),
                         keys=[KeyType("threefry2x32", keys.dtype, 1)])
    assert (k.shape, k.dtype, k.nbytes) == ((4,), keys.dtype, 32)
    np.testing.assert_array_equal(jax.random.key_data(k.result()), data)
    with pytest.raises(TypeError):
        np.asarray(k)  # as for a local key array


def test_deleted_arrays_raise_as_in_jax(offline: Client) -> None:
    sent: list[Any] = []
    offline.release = lambda refs: sent.append(list(refs)) or 1  # type: ignore[method-assign]
    y, s = fetched(offline, X, S)
    y.delete()
    assert y.is_deleted() and not s.is_deleted() and sent == [[("f1", 0)]]
    for use in (lambda: y.result(), lambda: np.asarray(y), lambda: y + 1, lambda: y.ref(),
                lambda: y.block_until_ready(), lambda: y.is_ready()):
        with pytest.raises(RuntimeError, match="Array has been deleted with shape=float32"):
            use()
    assert y.shape == (3, 4) and "deleted" in repr(y)
    assert float(s) == 2.5  # the sibling lives on


def test_garbage_collected_arrays_are_released_per_output() -> None:
    sent: list[list[tuple[str, int]]] = []
    queue = ReleaseQueue(sent.append, interval=0.01)
    state = _FutureState(None, "fut", 3, queue, values={0: X, 1: S, 2: X})
    arrays = [RemoteArray(state, i, Aval(v.shape, v.dtype.name)) for i, v in enumerate((X, S, X))]
    first, second, _ = arrays
    del arrays, first, _
    gc.collect()
    queue.close()
    assert sorted(ref for batch in sent for ref in batch) == [("fut", 0), ("fut", 2)]
    assert state.released == {0, 2} and state.values is not None and set(state.values) == {1}
    assert float(second) == 2.5


def test_a_rider_takes_release_batches_but_those_that_free_much() -> None:
    """``ReleaseQueue.rider`` (a running-ahead client's next batch) is offered each
    batch, and what it refuses is sent; a batch cut at ``max_bytes`` is sent at once."""
    sent: list[list[tuple[str, int]]] = []
    offered: list[list[tuple[str, int]]] = []
    answers = iter([True, False])
    queue = ReleaseQueue(sent.append, interval=0.01, max_bytes=1000)

    def rider(refs: list[tuple[str, int]]) -> bool:
        offered.append(refs)
        return next(answers)

    queue.rider = rider
    for n, future_id in enumerate(("taken", "refused")):
        queue.put(future_id, 0)
        deadline = time.monotonic() + 10
        while len(offered) <= n and time.monotonic() < deadline:  # one batch each
            time.sleep(0.005)
    queue.put("big", 0, 1000)
    queue.close()
    assert offered == [[("taken", 0)], [("refused", 0)]]
    assert sent == [[("refused", 0)], [("big", 0)]]


def test_release_queue_batches_and_survives_failures() -> None:
    batches: list[list[tuple[str, int]]] = []
    calls = iter([RuntimeError("server down")] + [None] * 100)

    def send(refs: list[tuple[str, int]]) -> None:
        error = next(calls)
        if error:
            raise error
        batches.append(refs)

    queue = ReleaseQueue(send, interval=0.2, batch=4)
    queue.put("lost", 0)  # its batch fails: logged and forgotten
    time.sleep(0.4)
    for i in range(10):
        queue.put("f", i)
    queue.close()
    assert [ref for b in batches for ref in b] == [("f", i) for i in range(10)]
    assert max(map(len, batches)) == 4


def _until_sent(sent: list[Any], timeout: float = 10.0) -> None:
    """Wait for a queue's thread to send its first batch (well before its interval)."""
    deadline = time.monotonic() + timeout
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)


def test_release_queue_sends_a_heavy_batch_at_once() -> None:
    sent: list[list[tuple[str, int]]] = []
    queue = ReleaseQueue(sent.append, interval=60.0, max_bytes=100)
    for i in range(3):
        queue.put("big", i, 40)  # the third makes 120 bytes: no waiting out the interval
    _until_sent(sent)
    assert sent == [[("big", 0), ("big", 1), ("big", 2)]]
    queue.put("small", 0, 1)
    queue.close()  # the light one waited for more; close sends it
    assert sent[-1] == [("small", 0)]


def test_dropped_arrays_are_released_with_their_size() -> None:
    sent: list[list[tuple[str, int]]] = []
    queue = ReleaseQueue(sent.append, interval=60.0, max_bytes=X.nbytes)
    state = _FutureState(None, "fut", 1, queue, values={0: X})
    y = RemoteArray(state, 0, Aval(X.shape, X.dtype.name))
    del y
    gc.collect()
    _until_sent(sent)
    assert sent == [[("fut", 0)]]  # one output of max_bytes: sent before the interval
    queue.close()


def test_release_queue_puts_from_many_threads() -> None:
    got: list[tuple[str, int]] = []
    queue = ReleaseQueue(got.extend, interval=0.01)
    threads = [threading.Thread(target=lambda t=t: [queue.put(f"t{t}", i) for i in range(100)])
               for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.close()
    assert len(got) == 800 and len(set(got)) == 800


def test_progress_logs_one_line_when_nobody_watches(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="jitserve.client"):
        with _progress.compile_progress("train_step", "http://gpu:8000") as show:
            for seconds in (2.0, 3.0, 12.0):
                show(seconds)
    assert [r.getMessage() for r in caplog.records] == [
        "compiling train_step on http://gpu:8000: 2 s so far"]


def test_progress_is_a_bar_for_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_progress, "_watched", lambda: True)
    with _progress.compile_progress("train_step", "http://gpu:8000") as show:
        show(12.0)
    assert "compiling train_step on http://gpu:8000: 12 s so far" in capsys.readouterr().err


@pytest.mark.parametrize("env, want", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_progress_default_follows_the_environment(env: str | None, want: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if env is None:
        monkeypatch.delenv(_progress.PROGRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(_progress.PROGRESS_ENV, env)
    assert _progress.progress_default() is want
    with Client("http://offline.invalid") as c, Client("http://offline.invalid", progress=True) as d:
        assert (c.progress, d.progress) == (want, True)


@pytest.mark.parametrize("cause, cls, code", [
    ({"code": "compile_failed", "message": "XLA could not compile"}, CompileError, "compile_failed"),
    ({"code": "compile_timeout", "message": "too slow"}, CompileError, "compile_timeout"),
    ({"code": "unsafe_program", "message": "custom call"}, CompileError, "unsafe_program"),
    ({"code": "runtime_crashed", "message": "boom"}, FutureFailed, "future_failed"),
])
def test_a_failed_compile_is_both_future_failed_and_program_error(cause: dict[str, str],
                                                                  cls: type, code: str) -> None:
    request = httpx.Request("GET", "http://s/v1/futures/f/result")
    response = httpx.Response(422, request=request, json={"error": {
        "code": "future_failed", "message": cause["message"], "cause": cause}})
    err = error_from_response(response, response.json())
    assert type(err) is cls and err.code == code and isinstance(err, FutureFailed)
    assert isinstance(err, ProgramError) is (cls is CompileError)
    assert err.error["cause"] == cause


def test_a_release_batch_goes_again_after_a_failure_that_passes() -> None:
    """No answer, or a server busy or restarting: the batch goes again (it was logged
    and forgotten, leaving its outputs on the server until their TTL). A refusal
    (a 4xx but 429) is not sent again."""
    request = httpx.Request("POST", "http://server/v1/futures/release")

    def status(code: int) -> httpx.HTTPStatusError:
        return httpx.HTTPStatusError(str(code), request=request,
                                     response=httpx.Response(code, request=request))

    failures = {"f": [httpx.ConnectError("refused", request=request), status(503)],
                "bad": [status(400)] * 3}
    attempts: list[list[tuple[str, int]]] = []
    sent: list[list[tuple[str, int]]] = []

    def send(refs: list[tuple[str, int]]) -> None:
        attempts.append(refs)
        left = failures[refs[0][0]]
        if left:
            raise left.pop(0)
        sent.append(refs)

    queue = ReleaseQueue(send, interval=0.01)
    queue.put("f", 0)
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [[("f", 0)]] and attempts == [[("f", 0)]] * 3  # the third went through
    queue.put("bad", 0)
    queue.close()
    assert attempts[3:] == [[("bad", 0)]]  # refused: once
