"""Memory in the app: bodies grow with what arrives, stall and disconnect cleanly, and a run's
intermediates count against the device-memory limits (service/api/bodies.py, executor.py, memory.py).

The same behaviour against real server processes, with RSS and sockets, is in
tests/e2e/test_memory_e2e.py.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax
from starlette.requests import ClientDisconnect, Request

from jitserve import wire
from jitserve.service.api.bodies import BodyReader, BodyTimeout
from jitserve.service.app import make_compiler
from jitserve.service.calls.executor import TempBudget
from jitserve.service.calls.futures import FutureStore
from jitserve.service.errors import BadRequest, PayloadTooLarge
from jitserve.service.memory import HeapTrimmer
from jitserve.service.metrics import Metrics
from jitserve.service.settings import Settings

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
GiB = 1 << 30


# -- BodyReader ----------------------------------------------------------------------


def _request(pieces: list[bytes], *, length: int | None, end: str = "done",
             pause_s: float = 0.0) -> Request:
    """A request whose body arrives as ``pieces``, then ends (``done``), disconnects
    (``disconnect``) or stalls for good (``stall``); ``pause_s`` before each piece."""
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    queue = list(pieces)

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(pause_s)
        if queue:
            return {"type": "http.request", "body": queue.pop(0),
                    "more_body": bool(queue) or end != "done"}
        if end == "disconnect":
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # stall
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/v1/x", "root_path": "",
             "query_string": b"", "headers": headers, "server": ("test", 80), "scheme": "http"}
    return Request(scope, receive)


@pytest.mark.parametrize("length", [None, 300_000], ids=["chunked", "content-length"])
async def test_body_in_pieces_is_read_whole(length: int | None) -> None:
    data = np.random.default_rng(0).bytes(300_000)
    pieces = [data[i:i + 7000] for i in range(0, len(data), 7000)]
    body = await BodyReader(_request(pieces, length=length), max_bytes=GiB).read()
    assert body == data and isinstance(body, bytearray)


async def test_lying_content_length_allocates_what_arrived() -> None:
    # 1 GiB declared, 10 bytes sent, then the client goes away: no 1 GiB buffer.
    request = _request([b"0123456789"], length=GiB, end="disconnect")
    tracemalloc.start()
    try:
        with pytest.raises(ClientDisconnect, match="after 10 of 1,073,741,824 bytes"):
            await BodyReader(request, max_bytes=2 * GiB).read()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 * MiB


async def test_buffer_grows_at_most_twice_what_arrived() -> None:
    pieces = [b"x" * 100_000] * 30  # 3 MB of a declared 1 GiB, then a stall
    request = _request(pieces, length=GiB, end="stall")
    tracemalloc.start()
    try:
        with pytest.raises(BodyTimeout):
            await BodyReader(request, max_bytes=2 * GiB, timeout_s=0.2).read()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 3_000_000 + MiB


async def test_stalled_body_times_out_and_is_counted() -> None:
    metrics = Metrics()
    reader = BodyReader(_request([b"abc"], length=100, end="stall"), max_bytes=MiB,
                        timeout_s=0.2, metrics=metrics)
    with pytest.raises(BodyTimeout) as info:
        await reader.read()
    err = info.value
    assert "JITSERVE_BODY_TIMEOUT_S" in err.message and "after 3 of 100 bytes" in err.message
    assert err.code == "bad_request" and err.headers() == {"Connection": "close"}
    assert metrics.registry.get_sample_value("jitserve_request_bodies_aborted_total",
                                             {"reason": "timeout"}) == 1


async def test_slow_but_steady_body_is_not_a_timeout() -> None:
    request = _request([b"a"] * 5, length=5, pause_s=0.05)
    assert await BodyReader(request, max_bytes=MiB, timeout_s=0.5).read() == b"aaaaa"


async def test_small_body_in_slow_pieces_times_out_only_when_a_piece_does() -> None:
    # Declared small (the one-message path), but it comes in pieces: 0.6 s in all,
    # never 0.25 s without a byte.
    request = _request([b"ab"] * 6, length=12, pause_s=0.1)
    assert await BodyReader(request, max_bytes=MiB, timeout_s=0.25).read() == b"ab" * 6
    with pytest.raises(BodyTimeout, match="after 0 of 12 bytes"):
        await BodyReader(_request([], length=12, end="stall"), max_bytes=MiB,
                         timeout_s=0.1).read()
    with pytest.raises(ClientDisconnect, match="after 0 of 12 bytes"):
        await BodyReader(_request([], length=12, end="disconnect"), max_bytes=MiB).read()


async def test_a_cancel_while_the_first_piece_waits_stays_a_cancel() -> None:
    # The first piece's time limit cancels the task itself: a cancel from elsewhere
    # (a client gone, a shutdown) must not turn into a body timeout, nor be swallowed.
    task = asyncio.ensure_future(BodyReader(_request([], length=12, end="stall"),
                                            max_bytes=MiB, timeout_s=30).read())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # and its timer went with it: nothing cancels this task's next wait
    assert await asyncio.wait_for(asyncio.sleep(0.1, "slept"), 1) == "slept"


@pytest.mark.parametrize(("pieces", "length", "error", "words"), [
    ([b"x" * 10], 20, BadRequest, "ended after 10 of 20 bytes"),
    ([b"x" * 600, b"x" * 600], None, PayloadTooLarge, "over the limit of 1,000"),
    ([b""], 2000, PayloadTooLarge, "2,000 bytes"),
], ids=["short", "too-long-chunked", "declared-too-long"])
async def test_body_errors(pieces: list[bytes], length: int | None, error: type[Exception],
                           words: str) -> None:
    with pytest.raises(error, match=words):
        await BodyReader(_request(pieces, length=length), max_bytes=1000).read()


async def test_stalled_body_is_a_400_through_the_app(make_api: Any) -> None:
    async def slow() -> AsyncIterator[bytes]:
        yield b"\x81"  # the start of a msgpack map, then nothing
        await asyncio.sleep(5)

    async with make_api(body_timeout_s=0.3) as api:
        pid = await api.upload("add_mul")
        r = await api.http.post(f"/v1/programs/{pid}/execute", content=slow(),
                                headers={"content-type": wire.MSGPACK, "content-length": "100"})
        assert r.status_code == 400, r.text
        assert "JITSERVE_BODY_TIMEOUT_S" in r.json()["error"]["message"]
        assert r.headers["connection"] == "close"
        assert await api.metric("jitserve_request_bodies_aborted_total", reason="timeout") == 1


# -- intermediates -------------------------------------------------------------------


def _carry(mib: int) -> Callable[[jax.Array], jax.Array]:
    """A program whose loop carries ``mib`` MiB of float32 and outputs one float32."""
    def fn(x: jax.Array) -> jax.Array:
        big = jnp.full((mib * MiB // 4,), x, jnp.float32)
        return lax.fori_loop(0, 3, lambda i, c: c * 1.5 + 1.0, big)[0]
    return fn


@pytest.fixture(scope="module")
def carry_8mib() -> bytes:
    spec = jax.ShapeDtypeStruct((), np.float32)
    return bytes(export.export(jax.jit(_carry(8)))(spec).serialize())


def test_executables_record_xla_memory_analysis(carry_8mib: bytes, tmp_path: Path) -> None:
    compiler = make_compiler(Settings(env="test", cache_dir=tmp_path))
    try:
        executable = compiler.lookup(compiler.decode(carry_8mib)).executable
    finally:
        compiler.close()
    mem = executable.memory
    assert mem is not None and mem.output_bytes == 4 and mem.temp_bytes >= 8 * MiB
    assert mem.run_bytes == mem.temp_bytes + mem.output_bytes - mem.alias_bytes
    assert executable.meta["memory"] == mem.to_json()


async def test_run_over_the_execution_limit_is_refused(make_api: Any, carry_8mib: bytes) -> None:
    async with make_api(max_execution_bytes=4 * MiB) as api:
        api.programs = {**api.programs, "carry": carry_8mib}
        pid = await api.upload("carry")
        r = await api.execute(pid, [np.float32(1)])
        assert r.status_code == 202, r.text  # a call never waits for its compile
        fid = r.json()["future_id"]
        doc = (await api.http.get(f"/v1/futures/{fid}", params={"wait": 30_000})).json()
        assert doc["status"] == "failed", doc  # refused once compiled: it never ran
        assert doc["error"]["code"] == "limit_exceeded"
        msg = doc["error"]["message"]
        assert "intermediates" in msg and "JITSERVE_MAX_EXECUTION_BYTES" in msg
        assert await api.metric("jitserve_executions_total", status="done") == 0
        # Now that its signature is known, the next call is refused before any future.
        r = await api.execute(pid, [np.float32(1)])
        assert r.status_code == 422 and r.json()["error"]["code"] == "limit_exceeded"
        ok = await api.execute(await api.upload("add_mul"),
                               [np.ones((2, 3), np.float32)] * 2, wait=30_000)
        assert ok.status_code == 200


async def test_run_within_the_limit_holds_its_temp_bytes_while_running(
        make_api: Any, carry_8mib: bytes) -> None:
    async with make_api(max_execution_bytes=64 * MiB) as api:
        api.programs = {**api.programs, "carry": carry_8mib}
        r = await api.execute(await api.upload("carry"), [np.float32(1)], wait=30_000)
        assert r.status_code == 200, r.text
        assert await api.metric("jitserve_execution_temp_bytes") == 0  # released after


async def test_temp_budget_waits_for_room_and_always_lets_one_run() -> None:
    futures = FutureStore(ttl_s=60, max_live=10, max_device_bytes=100)
    budget = TempBudget(futures, Metrics())
    entered: list[str] = []

    async def run(name: str, nbytes: int, hold_s: float) -> None:
        async with budget.hold(nbytes):
            entered.append(name)
            await asyncio.sleep(hold_s)

    first = asyncio.create_task(run("first", 60, 0.2))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(run("second", 60, 0))  # 120 > 100: waits for the first
    await asyncio.sleep(0.05)
    assert entered == ["first"] and budget.in_flight == 60
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert entered == ["first", "second"] and budget.in_flight == 0
    await asyncio.wait_for(run("alone", 1000, 0), 1)  # over the budget, but nothing else runs
    assert budget.in_flight == 0


# -- the heap ------------------------------------------------------------------------


def test_heap_trimmer_trims_only_over_its_bound() -> None:
    trimmer = HeapTrimmer(max_bytes=1 << 60)
    if not trimmer.available:
        pytest.skip("no glibc mallinfo2/malloc_trim here")
    assert trimmer.check() is False and trimmer.trims == 0
    eager = HeapTrimmer(max_bytes=0)
    block = bytearray(8 * MiB)
    del block
    assert eager.check() is True and eager.trims == 1
