"""Fixtures for in-process tests of the service app.

One pool of real runtime processes serves the whole session (they decode,
compile and run every program); every test gets a fresh app around it, with its
own settings, cache directory and event loop. ``api`` talks to that app through
httpx's ASGI transport.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fastapi import FastAPI
from jax import export

from jitserve import wire
from jitserve.service.app import create_app, start_pool
from jitserve.service.runtimes import RuntimePool
from jitserve.service.settings import Settings

F32 = np.float32


def _export(fn: Callable[..., Any], *specs: Any) -> bytes:
    return bytes(export.export(jax.jit(fn))(*specs).serialize())


def _spec(shape: Any, dtype: Any = F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(scope="session")
def programs() -> dict[str, bytes]:
    """Serialized ``jax.export`` programs the tests run, by name."""
    (b,) = export.symbolic_shape("b")
    return {
        # (x + y, 2x) on float32[2, 3]
        "add_mul": _export(lambda x, y: (x + y, x * 2), _spec((2, 3)), _spec((2, 3))),
        # 3x on float32[2, 3]: takes an output of add_mul
        "triple": _export(lambda x: x * 3, _spec((2, 3))),
        # column sums of float32[b, 3]: a dynamic dimension
        "colsum": _export(lambda x: x.sum(axis=0), _spec((b, 3))),
        # float64 and int64 in, a dict out: x64 is on
        "f64": _export(lambda x, n: {"y": x * 2, "n": n + 1},
                       _spec((4,), np.float64), _spec((), np.int64)),
        # 1 MiB of float32 + 1: results big enough to stream in slices
        "big": _export(lambda x: x + jnp.float32(1), _spec((1 << 18,))),
        # a model and its loss: 1 MiB of float32 + 1 and the sum, which alone comes
        # back with the run's answer (``wire.carried_outputs``)
        "step": _export(lambda x: (x + jnp.float32(1), x.sum()), _spec((1 << 18,))),
        # the sum of two float32[256, 256]: a call on two of spin's outputs
        "add256": _export(lambda x, y: x + y, _spec((256, 256)), _spec((256, 256))),
        # the sum of two 1 MiB float32 arrays: a run whose host input alone is packed
        # off the event loop (``Executor._pack``)
        "add_big": _export(lambda x, y: x + y, _spec((1 << 18,)), _spec((1 << 18,))),
        # 64 KiB of float32 + 1: inputs and outputs inline, a pipe's worth each
        "plus1": _export(lambda x: x + jnp.float32(1), _spec((1 << 14,))),
        # n rounds of a 256x256 matmul: as long a run as a caller asks for
        "spin": _export(lambda x, n: jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ y), x),
                        _spec((256, 256)), _spec((), np.int32)),
    }


@pytest.fixture(scope="session")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimePool]:
    """One runtime process (with its disk tier) for the whole session."""
    settings = Settings(env="test", cache_dir=tmp_path_factory.mktemp("compiler-cache"),
                        runtimes=1)
    pool = asyncio.run(start_pool(settings))
    yield pool
    pool.close()


@dataclass
class Api:
    """An app in its lifespan and an httpx client on it, with shortcuts."""

    app: FastAPI
    http: httpx.AsyncClient
    programs: dict[str, bytes]

    async def upload(self, name: str) -> str:
        r = await self.http.post("/v1/programs", content=self.programs[name],
                                 headers={"content-type": "application/octet-stream"})
        assert r.status_code in (200, 201), r.text
        return r.json()["program_id"]

    async def execute(self, program_id: str, args: list[Any], *, wait: int | None = None,
                      headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
        params = {} if wait is None else {"wait": wait}
        return await self.http.post(
            f"/v1/programs/{program_id}/execute", params=params,
            content=wire.packb({"args": args, **extra}),
            headers={"content-type": wire.MSGPACK, **(headers or {})})

    async def outputs(self, program_id: str, args: list[Any], **extra: Any) -> list[Any]:
        """The outputs of an execute that waits for them (its answer a 200)."""
        r = await self.execute(program_id, args, wait=30_000, **extra)
        assert r.status_code == 200, r.text
        return wire.unpackb(r.content)["outputs"]

    async def result(self, future_id: str, wait: int = 10_000, **kw: Any) -> httpx.Response:
        return await self.http.get(f"/v1/futures/{future_id}/result",
                                   params={"wait": wait}, **kw)

    async def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on ``/metrics`` (0 when absent)."""
        text = (await self.http.get("/metrics")).text
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                       if labels else "")
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == want:
                return float(value)
        return 0.0


MakeApi = Callable[..., contextlib.AbstractAsyncContextManager[Api]]


@pytest.fixture
def make_api(runtimes: RuntimePool, programs: dict[str, bytes], tmp_path: Path) -> MakeApi:
    """A factory: ``async with make_api(**settings) as api`` runs an app with those settings.

    Apps share the session's runtime, and so its caches of executables and
    programs, and the settings it was started with; ``own_runtimes=True`` gives
    the app runtimes of its own, started from its settings (a second or two),
    stopped with it.
    """

    @contextlib.asynccontextmanager
    async def make(cache_dir: Path | None = None, *, own_runtimes: bool = False,
                   **overrides: Any) -> AsyncIterator[Api]:
        overrides.setdefault("runtimes", 1)
        settings = Settings(env="test", cache_dir=cache_dir or tmp_path / "cache", **overrides)
        app = create_app(settings, runtimes=None if own_runtimes else runtimes)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=transport,
                                         base_url="http://jitserve") as http:
                yield Api(app, http, programs)

    return make


@pytest.fixture
async def api(make_api: MakeApi) -> AsyncIterator[Api]:
    """An app with the default test settings."""
    async with make_api() as a:
        yield a


@pytest.fixture
def x() -> np.ndarray:
    """A float32[2, 3] input."""
    return np.arange(6, dtype=F32).reshape(2, 3)
