"""Requests to a runtime are written without blocking the API process's event loop
(``pipes.PipeWriter``): what a full pipe does not take waits, in order, for a
thread of the writer's own. Real pipes, and a real runtime that reads nothing
for a while (stopped) as calls keep coming."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest

from jitserve import wire
from jitserve.service.runtimes.pipes import PipeWriter


def test_writes_past_a_full_pipe_return_at_once_and_arrive_in_order() -> None:
    r, w = os.pipe()
    writer = PipeWriter(w, "test-writer")
    messages = [bytes([k % 256]) * (20_000 + k) for k in range(40)]  # ~850 KB: 13 pipes' worth
    t = time.monotonic()
    for m in messages:
        writer.write(m)  # nobody reads yet
    assert time.monotonic() - t < 5  # did not wait for a reader (which would be forever)
    got: list[bytes] = []
    conn = Connection(r, writable=False)
    reading = threading.Thread(target=lambda: got.extend(conn.recv_bytes() for _ in messages))
    reading.start()
    reading.join(30)
    assert got == messages
    writer.close()
    with pytest.raises(BrokenPipeError):
        writer.write(b"after")
    os.close(w)
    conn.close()


def test_one_thread_sends_what_each_full_pipe_left() -> None:
    """Three times the pipe fills and is read empty: the writer's one thread, started
    at the first, sends each time's rest (starting a thread each time cost the event
    loop a tenth of its time on a loop that runs ahead)."""
    r, w = os.pipe()
    writer = PipeWriter(w, "test-writer-once")
    conn = Connection(r, writable=False)
    for round_ in range(3):
        messages = [bytes([round_]) * 50_000 for _ in range(4)]  # 200 KB: past 64 KiB
        for m in messages:
            writer.write(m)
        assert [conn.recv_bytes() for _ in messages] == messages
    assert [t.name for t in threading.enumerate()].count("test-writer-once") == 1
    writer.close()
    assert "test-writer-once" not in [t.name for t in threading.enumerate()]
    os.close(w)
    conn.close()


def test_close_drops_what_waits_and_lets_go_of_the_descriptor() -> None:
    r, w = os.pipe()
    writer = PipeWriter(w, "test-writer")
    for _ in range(10):
        writer.write(b"x" * 60_000)  # the pipe takes one; the rest wait
    writer.close()  # returns once the writer's thread has stopped writing
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 20):
        data += chunk
    assert 0 < len(data) < 10 * 60_004
    os.close(r)


@pytest.mark.timeout(300)
async def test_the_api_answers_while_its_runtime_reads_nothing(make_api) -> None:
    """The runtime is stopped (SIGSTOP: it reads nothing, as when all its threads
    wait on compiles) while 40 calls of 64 KiB more than fill its pipe. The app
    still answers; the calls end once it goes on. A loop that blocked on the pipe
    would answer only after the runtime was resumed, 20 s later."""
    async with make_api(own_runtimes=True) as api:
        plus1 = await api.upload("plus1")
        v = np.arange(1 << 14, dtype=np.float32)
        assert (await api.execute(plus1, [v], wait=60_000)).status_code == 200
        pid = api.app.services.runtimes.runtimes[0].pid
        resumed = threading.Event()

        def resume() -> None:
            resumed.set()
            os.kill(pid, signal.SIGCONT)

        os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(20, resume)
        timer.start()
        try:
            calls = [asyncio.create_task(api.execute(plus1, [v + k], wait=120_000))
                     for k in range(40)]
            await asyncio.sleep(0.3)
            assert (await api.http.get("/healthz")).status_code == 200
            assert not resumed.is_set()  # answered while the runtime read nothing
        finally:
            timer.cancel()
            if not resumed.is_set():
                resume()
        for k, r in enumerate(await asyncio.gather(*calls)):
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], v + k + 1)
