"""Runtime answers read on the pool's event loop (``RuntimePool.start(loop)``).

A real runtime process and real pipes: frames of every size reach their callers,
whether they come from the reading loop or from another thread's loop; a runtime
killed under a request fails it; a loop that closes before the pool hands the
reading back to the supervisor thread. The framing itself is checked against
``multiprocessing``'s own, cut at every byte.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jitserve.service.runtimes import (
    Buffer,
    Runtime,
    RuntimeLost,
    RuntimePool,
    frames,
    make_pool,
)
from jitserve.service.runtimes.pipes import LoopReader
from jitserve.service.settings import Settings


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[RuntimePool]:
    made = make_pool(Settings(env="test", cache_dir=tmp_path / "cache", runtimes=1))
    made.start(asyncio.get_running_loop())
    try:
        await made.wait_ready()
        yield made
    finally:
        await asyncio.to_thread(made.close)


async def _round_trip(pool: RuntimePool, array: np.ndarray) -> np.ndarray:
    """``array`` put on the runtime and fetched back inline (no segment)."""
    runtime = pool.runtimes[0]
    descs, _ = frames.pack_arrays([array], None)
    put = await runtime.request("put", {"args": descs}, timeout_s=60)
    fetched = await runtime.request("fetch", {"handles": put["handles"]}, timeout_s=60)
    runtime.send_free(put["handles"], put["generation"])
    return frames.unpack_arrays(fetched["arrays"])[0]


async def test_answers_of_every_size_come_back_on_the_loop(pool: RuntimePool) -> None:
    assert pool.loop is asyncio.get_running_loop()
    rng = np.random.default_rng(0)
    # 4 B to 768 KiB: the big ones arrive in many reads of a 64 KiB pipe
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (1, 1000, 40_000, 196_608)]
    for got, want in zip(await asyncio.gather(*(_round_trip(pool, a) for a in arrays)), arrays):
        np.testing.assert_array_equal(got, want)


async def test_a_caller_on_another_loop_gets_its_answer(pool: RuntimePool) -> None:
    want = np.arange(10_000, dtype=np.float64)
    out: dict[str, Any] = {}

    def elsewhere() -> None:  # its own loop, in its own thread
        out["got"] = asyncio.run(_round_trip(pool, want))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    await asyncio.to_thread(thread.join, 60)
    np.testing.assert_array_equal(out["got"], want)


async def test_a_killed_runtime_fails_what_it_had_and_comes_back(pool: RuntimePool) -> None:
    runtime = pool.runtimes[0]
    assert runtime.pid is not None
    os.kill(runtime.pid, signal.SIGSTOP)  # the request waits for sure, once all its threads stop
    for _ in range(500):
        if all(_state(task) == "T" for task in Path(f"/proc/{runtime.pid}/task").iterdir()):
            break
        await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(runtime.request("stats", {}, timeout_s=60))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    runtime.kill("test")
    with pytest.raises(RuntimeLost):
        await waiting
    await runtime.wait_up()
    want = np.ones(7, np.int32)
    np.testing.assert_array_equal(await _round_trip(pool, want), want)


async def test_outputs_of_a_lost_runtime_say_how_its_process_ended(pool: RuntimePool) -> None:
    """An output whose process is gone says how that process ended: stopped on purpose
    (``runtime_stopped``) or crashed, from the moment of the kill, before its exit is
    seen, and still after later exits of the same runtime."""
    runtime = pool.runtimes[0]
    put = await runtime.request("put", {"args": frames.pack_arrays([np.ones(3)], None)[0]},
                                timeout_s=60)
    stopped = Buffer(runtime, put["generation"], put["handles"][0], 24)
    runtime.kill("cancel")  # as a DELETE of a running future does
    why = "runtime 0 was stopped to cancel an execution: the outputs were lost"
    with pytest.raises(RuntimeLost) as lost:
        await pool.fetch([stopped])
    assert (lost.value.code, str(lost.value)) == ("runtime_stopped", why)
    await _restarted(runtime, stopped.generation)
    crashed = runtime.generation
    os.kill(runtime.pid, signal.SIGKILL)  # not ours: a crash
    await _restarted(runtime, crashed)
    assert runtime.lost(crashed).code == "runtime_crashed"
    assert "crashed with SIGKILL" in str(runtime.lost(crashed))
    with pytest.raises(RuntimeLost) as lost:  # the earlier stop, as it was
        await pool.fetch([stopped])
    assert (lost.value.code, str(lost.value)) == ("runtime_stopped", why)


async def _restarted(runtime: Runtime, generation: int) -> None:
    """Wait until ``runtime`` runs a process after ``generation``."""
    for _ in range(6000):
        if runtime.generation > generation and runtime.state == "up":
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"runtime {runtime.index} not back within 60 s ({runtime.state})")


def _state(task: Path) -> str:
    return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_pool_outliving_its_loop_reads_in_its_threads(tmp_path: Path) -> None:
    made = make_pool(Settings(env="test", cache_dir=tmp_path / "cache", runtimes=1))

    async def start() -> None:
        made.start(asyncio.get_running_loop())
        await made.wait_ready()

    asyncio.run(start())  # that loop is closed now
    try:
        want = np.arange(5, dtype=np.int64)
        np.testing.assert_array_equal(asyncio.run(_round_trip(made, want)), want)
    finally:
        made.close()


@pytest.mark.parametrize("piece", [1, 3, 4096])
async def test_frames_cut_anywhere_are_read_whole(piece: int) -> None:
    messages = [{"id": i, "data": bytes([i]) * n} for i, n in enumerate((0, 5, 70_000, 1))]
    r, w = os.pipe()
    pieces: list[bytes] = []

    def drain() -> None:  # the pipe holds 64 KiB: read while multiprocessing writes
        while chunk := os.read(r, 1 << 16):
            pieces.append(chunk)

    thread = threading.Thread(target=drain)
    thread.start()
    writer = Connection(w, readable=False)
    for message in messages:
        writer.send_bytes(frames.pack(message))
    writer.close()
    thread.join(10)
    os.close(r)
    stream = b"".join(pieces)

    got: list[dict[str, Any]] = []
    a, b = os.pipe()
    reader = LoopReader(a, lambda message, loop: got.append(message))
    reader.attach(asyncio.get_running_loop())
    for k in range(0, len(stream), piece):
        os.write(b, stream[k:k + piece])
        await asyncio.sleep(0)  # let the loop read what is there
    os.close(b)
    await asyncio.to_thread(reader.ended.wait, 10)
    os.close(a)
    assert got == messages


def test_the_header_of_a_frame_over_2_gib_is_understood() -> None:
    # multiprocessing writes -1 and then an 8-byte size for frames of 2 GiB and more
    payload = frames.pack({"id": 1})
    stream = (-1).to_bytes(4, "big", signed=True) + len(payload).to_bytes(8, "big") + payload
    got, _ = _read_all(stream)
    assert got == [{"id": 1}]


@pytest.mark.parametrize("reply", [[1, 2], "ok", 7, None], ids=repr)
def test_a_reply_that_is_no_map_stops_the_reading(reply: Any) -> None:
    good = frames.pack({"id": 1, "kind": "ok"})
    got, reader = _read_all(b"".join(frames.frame(m) for m in (good, frames.pack(reply), good)))
    assert got == [{"id": 1, "kind": "ok"}] and reader.garbled and reader.ended.is_set()


def _read_all(stream: bytes) -> tuple[list[Any], LoopReader]:
    """What a reader makes of ``stream`` written whole to a closed pipe, and the reader."""
    got: list[Any] = []
    r, w = os.pipe()
    os.write(w, stream)
    os.close(w)
    reader = LoopReader(r, lambda message, loop: got.append(message))
    reader.read_rest()
    os.close(r)
    return got, reader


def test_a_frame_that_is_no_message_stops_the_reading() -> None:
    good, bad = frames.pack({"id": 1}), b"\xc1"  # 0xc1: never used in msgpack
    stream = b"".join(len(p).to_bytes(4, "big") + p for p in (good, bad, good))
    got: list[dict[str, Any]] = []
    r, w = os.pipe()
    os.write(w, stream)
    reader = LoopReader(r, lambda message, loop: got.append(message))
    reader.read_rest()  # returns at the bad frame, though the pipe is still open
    os.close(w)
    os.close(r)
    assert got == [{"id": 1}] and reader.garbled and reader.ended.is_set()
