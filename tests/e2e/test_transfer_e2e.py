"""Big arrays through a real ``jitserve serve`` process (issue 14, P4).

A big result is streamed from the runtime's shared-memory segment, never joined
into one body in the API process; the SDK reads a big answer into one buffer and
decodes its arrays as views of it, for every dtype kind (x64 and complex too),
sync and async; the zero-copy msgpack reader agrees with msgpack, and gives up
to it on anything it does not expect. One server serves the whole module.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
from conftest import _serve
from jax import export

from jitserve import wire
from jitserve.client import AsyncClient, Client
from jitserve.client._buffers import BufferPool
from jitserve.client._transport import READ_BYTES, _Widening
from jitserve.wire._views import unpack_views

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for the module, with a body limit that fits its arrays."""
    yield from _serve(tmp_path_factory.mktemp("transfer"),
                      {"JITSERVE_MAX_BODY_BYTES": str(256 * MiB)})


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[Client]:
    with Client(url, timeout=120, progress=False) as c:
        yield c


def _export(fn: Any, *avals: jax.ShapeDtypeStruct) -> bytes:
    return bytes(export.export(jax.jit(fn))(*avals).serialize())


def _server_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1].encode()
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            args = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
            if b"jitserve.service" in args and b"--port" in args and port in args:
                return int(proc.name)
    raise AssertionError(f"no jitserve process on port {port.decode()}")


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """The highest ``field`` of ``/proc/<pid>/status`` while the block runs, sampled every 2 ms."""

    def __init__(self, pid: int, field: str) -> None:
        self.pid, self.field = pid, field
        self.start = self.peak = _status_kib(pid, field)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kib(self.pid, self.field))
            time.sleep(0.002)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib(self.pid, self.field))


# --------------------------------------------------------------------------- streaming


def test_big_result_streams_from_shared_memory(client: Client, url: str) -> None:
    """A 96 MiB result goes out in pieces with a Content-Length, and the API process's
    private memory grows by far less than the result: it is answered from the
    runtime's segment, not joined into one body. The input is tiny, so no earlier
    big body left freed heap that a joined answer could reuse unseen."""
    n = 96 * MiB // 4
    fn = _export(lambda s: jnp.full((n,), 1.0, jnp.float32) * s, jax.ShapeDtypeStruct((), np.float32))
    pid = client.upload(fn).program_id
    out = client.execute(pid, [np.float32(3.0)])[0]
    client.wait(out.future_id)
    server = _server_pid(url)
    chunks = got = 0
    with _Peak(server, "RssAnon") as anon, _Peak(server, "VmRSS") as rss, httpx.stream(
            "GET", f"{url}/v1/futures/{out.future_id}/result",
            headers={"accept": wire.MSGPACK}, timeout=60) as r:
        assert r.status_code == 200
        declared = int(r.headers["content-length"])
        for chunk in r.iter_raw():
            chunks += 1
            got += len(chunk)
    assert got == declared > 4 * n
    assert chunks > 1
    assert anon.peak - anon.start < 0.5 * 4 * n, (anon.start, anon.peak)
    assert rss.peak - rss.start < 2 * 4 * n, (rss.start, rss.peak)
    np.testing.assert_array_equal(out.result()[:5], np.full(5, 3.0, np.float32))


# --------------------------------------------------------------------------- SDK decoding


BIG = [  # (dtype, elements): each at least 1 MiB, so answers take the buffer-and-views path
    (np.float32, 3 * MiB // 4 + 1),
    (np.float64, MiB // 8 * 3 + 5),
    (np.int64, MiB // 8 * 2 + 3),
    (np.complex128, MiB // 16 * 3 + 1),
    (np.uint8, 2 * MiB + 7),
    (ml_dtypes.bfloat16, MiB + 3),
]


def _sample(dtype: Any, size: int) -> np.ndarray:
    rng = np.random.default_rng(size)
    if np.dtype(dtype) == np.complex128:
        return rng.standard_normal(size) + 1j * rng.standard_normal(size)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 100, size).astype(dtype)
    return rng.standard_normal(size).astype(dtype)


@pytest.mark.parametrize(("dtype", "size"), BIG, ids=lambda v: getattr(v, "__name__", str(v)))
def test_sdk_big_arrays_round_trip(client: Client, dtype: Any, size: int) -> None:
    x = _sample(dtype, size)
    aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    # Two outputs around a small one: views at several offsets of one answer buffer.
    pid = client.upload(_export(lambda v: (v + v, v[:3], v), aval)).program_id
    outs = [o.result() for o in client.execute(pid, [x])]
    assert [o.dtype for o in outs] == [x.dtype] * 3
    np.testing.assert_array_equal(outs[0], x + x)
    np.testing.assert_array_equal(outs[1], x[:3])
    np.testing.assert_array_equal(outs[2], x)
    assert not outs[0].flags.writeable  # as msgpack's own bytes were


def test_sdk_big_answer_buffer_is_reused(client: Client) -> None:
    """The buffer of a dropped answer serves the next one of the same size."""
    x = np.arange(2 * MiB // 4, dtype=np.float32)
    pid = client.upload(_export(lambda v: v * 2, jax.ShapeDtypeStruct(x.shape, x.dtype))).program_id
    first = client.execute(pid, [x], wait=60)[0]
    np.testing.assert_array_equal(first.result(), x * 2)
    del first
    kept = client._buffers.kept_bytes
    assert kept >= x.nbytes
    again = client.execute(pid, [x + 1], wait=60)[0].result()
    np.testing.assert_array_equal(again, (x + 1) * 2)
    assert client._buffers.kept_bytes < kept  # taken from the pool, not allocated


def test_async_client_big_result(url: str) -> None:
    x = _sample(np.complex128, MiB // 16 * 2 + 1)
    blob = _export(lambda v: v * 1j, jax.ShapeDtypeStruct(x.shape, x.dtype))

    async def go() -> np.ndarray:
        async with AsyncClient(url, timeout=120, progress=False) as ac:
            pid = (await ac.upload(blob)).program_id
            (out,) = await ac.execute(pid, [x])
            return await out.result()

    np.testing.assert_array_equal(asyncio.run(go()), x * 1j)


def test_json_client_still_round_trips(url: str) -> None:
    x = np.linspace(0, 1, 1000, dtype=np.float64)
    with Client(url, timeout=120, wire_format="json", progress=False) as c:
        pid = c.upload(_export(lambda v: v * 3, jax.ShapeDtypeStruct(x.shape, x.dtype))).program_id
        np.testing.assert_allclose(c.execute(pid, [x], wait=60)[0].result(), x * 3)


# --------------------------------------------------------------------------- the reader


def test_views_reader_matches_msgpack() -> None:
    big = np.arange(MiB, dtype=np.uint8)
    doc = {"a": [1, -1, 127, -32, 255, -129, 2**40, -2**40, 2**64 - 1, 1.5, None, True, False],
           "s": "hé" * 40, "b": b"x" * 300, "m": {"k": big.tobytes()}, "e": [], "f": {}}
    blob = msgpack.packb(doc, use_bin_type=True)
    got = unpack_views(memoryview(blob), max_str_len=1 << 20, max_depth=128)
    assert isinstance(got["m"]["k"], memoryview) and got["m"]["k"].readonly
    got["m"]["k"] = bytes(got["m"]["k"])
    assert got == msgpack.unpackb(blob, raw=False)


@pytest.mark.parametrize("blob", [
    msgpack.packb({"a": msgpack.ExtType(1, b"x")}, use_bin_type=True),   # extension type
    msgpack.packb({1: b"x"}, use_bin_type=True),                          # non-string key
    msgpack.packb(list(range(5000)), use_bin_type=True),                  # past the budget
    msgpack.packb({"a": b"x" * 100}, use_bin_type=True)[:-5],             # truncated
    msgpack.packb({"a": 1}, use_bin_type=True) + b"\x00",                 # trailing bytes
], ids=["ext", "int-key", "budget", "truncated", "trailing"])
def test_views_reader_gives_up_to_msgpack(blob: bytes) -> None:
    assert unpack_views(memoryview(blob), max_str_len=1 << 20, max_depth=128) is None


def test_unpackb_big_message_errors_stay_wire_errors() -> None:
    body = wire.packb({"args": [np.zeros(MiB, np.float32)]})
    with pytest.raises(wire.WireError):
        wire.unpackb(body[:-10])
    bad = bytearray(body)
    bad[bad.index(b"float32"):bad.index(b"float32") + 7] = b"float99"
    with pytest.raises(wire.WireError, match="float99"):
        wire.unpackb(bad)
    arr = wire.unpackb(bytearray(body))["args"][0]
    assert arr.shape == (MiB,) and not arr.flags.writeable


def test_buffer_pool_lends_and_keeps_within_bound() -> None:
    pool = BufferPool(max_bytes=3 * MiB)
    a = pool.take(2 * MiB)
    view = np.frombuffer(memoryview(a)[8:], np.float32)
    del a
    assert pool.kept_bytes == 0  # a view still holds it
    del view
    assert pool.kept_bytes == 2 * MiB
    b = pool.take(MiB + 1)  # fits in the kept one (at most twice the size)
    assert pool.kept_bytes == 0 and b.nbytes == MiB + 1
    c = pool.take(2 * MiB)
    del b, c  # 2 MiB + 2 MiB > the bound: one is freed
    assert pool.kept_bytes == 2 * MiB


def test_reads_widen_while_full_and_narrow_when_short() -> None:
    w = _Widening()
    k = 64 << 10
    sizes = []
    for got in [k, 2 * k, 4 * k, 8 * k, 16 * k, 16 * k, 300 << 10, 10, 10]:
        asked = w.size(k)
        sizes.append(asked)
        w.got(asked, b"x" * min(got, asked), k)
    assert sizes == [k, 2 * k, 4 * k, 8 * k, READ_BYTES, READ_BYTES, READ_BYTES, READ_BYTES, k]
