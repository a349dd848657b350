"""The baseline: a minimal hand-written FastAPI endpoint doing the same work as jitserve.

It decodes a msgpack (or JSON) array, runs the jitted function, and encodes the result —
no futures, no caching layers, no validation. bench/service.py compares against it;
bench/batching.py too, with ``BASELINE_MLP`` naming the MLP it runs instead. ``/keep``
keeps each body it gets (bench/uploads.py).

``/run_child`` is the supervised baseline: the same work in one child process
(bench/_baseline_child.py), which gets the request body over a pipe and sends
back the answer's, as a server that keeps programs out of its API process must
at the least. It is the floor of that rule, as ``/run`` is of a server without it.

``asgi_app`` serves the same two endpoints as plain ASGI under uvicorn, without
FastAPI (``uvicorn _baseline_app:asgi_app``): the floor of a server built on
uvicorn, as jitserve's execute lane is, which answers ahead of FastAPI's
routing and middleware (service/api/routes/execute.py). Its ``/run_child`` is that
floor for a server that also runs no program in its API process.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
from _asgi import read_body
from fastapi import FastAPI, Request, Response

jax.config.update("jax_enable_x64", True)
app = FastAPI()


@jax.jit
def f(x):  # noqa: ANN001, ANN201 - the benchmark function, kept identical in service.py
    return jnp.sin(x) * 2.0 + 1.0


if os.environ.get("BASELINE_MLP"):  # bench/batching.py: one of its MLPs instead
    from _models import make_mlp

    f = jax.jit(make_mlp(os.environ["BASELINE_MLP"]))


@app.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


_kept: list[bytes] = []


@app.post("/keep")
async def keep(request: Request) -> dict[str, int]:
    """Keep the body (bench/uploads.py: what holding an upload once costs in a server)."""
    _kept.append(await request.body())
    return {"size": len(_kept[-1])}


def answer(fn, raw: bytes, as_json: bool) -> bytes:  # noqa: ANN001
    """The answer's body to a request's: msgpack in and out, or JSON (nested lists)."""
    if as_json:
        a = json.loads(raw)["args"][0]
        y = np.asarray(fn(np.asarray(a["data"], dtype=a["dtype"]).reshape(a["shape"])))
        out = {"outputs": [{"dtype": y.dtype.name, "shape": list(y.shape), "data": y.tolist()}]}
        return json.dumps(out).encode()
    a = msgpack.unpackb(raw)["args"][0]
    x = np.frombuffer(a["data"], dtype=a["dtype"]).reshape(a["shape"])
    y = np.asarray(fn(x))
    out = {"outputs": [{"dtype": y.dtype.name, "shape": list(y.shape), "data": y.tobytes()}]}
    return msgpack.packb(out)


def _media_type(content_type: str) -> str:
    return "application/json" if content_type.startswith("application/json") \
        else "application/msgpack"


@app.post("/run")
async def run(request: Request) -> Response:
    """msgpack in and out, or JSON (nested lists) when the body is JSON, as jitserve does."""
    media_type = _media_type(request.headers.get("content-type", ""))
    return Response(answer(f, await request.body(), media_type == "application/json"),
                    media_type=media_type)


class _Child:
    """The child process and the calls waiting on it, answered in order."""

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self.waiting: collections.deque[asyncio.Future[bytes]] = collections.deque()
        self.started = asyncio.Lock()

    async def call(self, frame: bytes) -> bytes:
        async with self.started:
            if self.process is None:
                self.process = await asyncio.create_subprocess_exec(
                    sys.executable, str(Path(__file__).with_name("_baseline_child.py")),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
                asyncio.get_running_loop().create_task(self._read())
        assert self.process.stdin is not None
        answered = asyncio.get_running_loop().create_future()
        self.waiting.append(answered)
        self.process.stdin.write(len(frame).to_bytes(4, "big") + frame)
        return await answered

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        stdout = self.process.stdout
        while True:
            size = int.from_bytes(await stdout.readexactly(4), "big")
            self.waiting.popleft().set_result(await stdout.readexactly(size))


_child = _Child()


@app.post("/run_child")
async def run_child(request: Request) -> Response:
    """``/run``, with the work done in a child process (the supervised baseline)."""
    media_type = _media_type(request.headers.get("content-type", ""))
    return Response(await _child.call(_frame(media_type, await request.body())),
                    media_type=media_type)


def _frame(media_type: str, body: bytes) -> bytes:
    """The child's request: one byte for the encoding, then the HTTP body."""
    return (b"j" if media_type == "application/json" else b"m") + body


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/healthz``, ``/run`` and ``/run_child`` as plain ASGI: no routing, request
    or response objects, dependencies or middleware."""
    if scope["type"] != "http":
        return
    body = await read_body(receive)
    content_type = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    media_type = _media_type(content_type.decode("latin-1"))
    path = scope["path"]
    if path == "/run":
        out = answer(f, body, media_type == "application/json")
    elif path == "/run_child":
        out = await _child.call(_frame(media_type, body))
    else:
        media_type, out = "application/json", b'{"status":"ok"}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", media_type.encode()),
                            (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})
