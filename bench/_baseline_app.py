"""The baseline: a minimal hand-written FastAPI endpoint doing the same work as jitserve.

It decodes a msgpack (or JSON) array, runs the jitted function, and encodes the result —
no futures, no caching layers, no validation. bench/service.py compares against it;
bench/batching.py too, with ``BASELINE_MLP`` naming the MLP it runs instead.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
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


@app.post("/run")
async def run(request: Request) -> Response:
    """msgpack in and out, or JSON (nested lists) when the body is JSON, as jitserve does."""
    raw = await request.body()
    if request.headers.get("content-type", "").startswith("application/json"):
        a = json.loads(raw)["args"][0]
        y = np.asarray(f(np.asarray(a["data"], dtype=a["dtype"]).reshape(a["shape"])))
        out = {"outputs": [{"dtype": y.dtype.name, "shape": list(y.shape), "data": y.tolist()}]}
        return Response(json.dumps(out), media_type="application/json")
    a = msgpack.unpackb(raw)["args"][0]
    x = np.frombuffer(a["data"], dtype=a["dtype"]).reshape(a["shape"])
    y = np.asarray(f(x))
    out = {"outputs": [{"dtype": y.dtype.name, "shape": list(y.shape), "data": y.tobytes()}]}
    return Response(msgpack.packb(out), media_type="application/msgpack")
