"""Programs and servers for the Open Inference Protocol tests (test_v2_*.py).

One model per v2 datatype (``affine_<datatype>``: ``x * 2 + 1``, ``not x`` for
BOOL, on ``[2, 3]``), a model with named inputs and outputs (``pair``: dict in,
dict out) and one with a symbolic batch dimension (``batched``). Expected
outputs come from ``jax.jit`` on this side (x64 on, as the server runs).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from e2e.conftest import _free_port, _serve
from jax import export

#: Every datatype jitserve serves over v2, and the numpy dtype tritonclient uses for it.
DATATYPES: dict[str, Any] = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "BF16": ml_dtypes.bfloat16, "FP32": np.float32,
    "FP64": np.float64,
}
SHAPE = (2, 3)


def affine(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return jnp.logical_not(x)
    return x * 2 + 1


def pair(d: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {"sum": d["x"] + d["y"], "prod": d["x"] * d["y"]}


def sample(datatype: str) -> np.ndarray:
    """Values of ``datatype`` that reach its edges (negatives, big uint64s, fractions)."""
    dtype = DATATYPES[datatype]
    if datatype == "BOOL":
        values: list[Any] = [True, False, False, True, True, False]
    elif datatype.startswith("UINT"):
        top = np.iinfo(dtype).max
        values = [0, 1, 2, 7, top // 2 + 3, top]
    elif datatype.startswith("INT"):
        info = np.iinfo(dtype)
        values = [info.min, -3, 0, 1, 5, info.max]
    else:
        values = [-1.5, 0.0, 0.25, 1.0, 2.5, 100.0]
    return np.array(values, dtype=dtype).reshape(SHAPE)


def expected(fn: Callable[..., Any], *args: Any) -> Any:
    return jax.tree.map(np.asarray, jax.jit(fn)(*args))


@functools.cache
def program(kind: str, shape: tuple[int, ...] = SHAPE) -> bytes:
    """The exported program of ``affine_<DATATYPE>`` (on ``shape``), ``pair`` or ``batched``.

    Cached: an export's bytes carry source locations, so a fresh one could differ.
    """
    if kind == "pair":
        spec = jax.ShapeDtypeStruct(SHAPE, np.float32)
        return bytes(export.export(jax.jit(pair))({"x": spec, "y": spec}).serialize())
    if kind == "batched":
        b = export.symbolic_shape("b, 3")
        return bytes(export.export(jax.jit(affine))(jax.ShapeDtypeStruct(b, np.float32))
                     .serialize())
    datatype = kind.removeprefix("affine_")
    spec = jax.ShapeDtypeStruct(shape, DATATYPES[datatype])
    return bytes(export.export(jax.jit(affine))(spec).serialize())


def upload(url: str, data: bytes, name: str, key: str | None = None) -> dict[str, Any]:
    """``POST /v1/programs?name=`` and its answer (201 or 200)."""
    headers = {"content-type": "application/octet-stream"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    r = httpx.post(f"{url}/v1/programs", params={"name": name}, content=data, headers=headers,
                   timeout=60)
    assert r.status_code in (200, 201), r.text
    return r.json()


def upload_all(url: str) -> None:
    """Every model of this module under its name."""
    for datatype in DATATYPES:
        upload(url, program(f"affine_{datatype}"), f"affine_{datatype.lower()}")
    upload(url, program("pair"), "pair")
    upload(url, program("batched"), "batched")


@contextlib.contextmanager
def v2_server(tmp: Path) -> Iterator[tuple[str, int]]:
    """A real ``jitserve serve`` with the gRPC port on, and every model uploaded:
    ``(base URL, gRPC port)``."""
    port = _free_port()
    with contextlib.contextmanager(_serve)(tmp, {"JITSERVE_GRPC_PORT": str(port)}) as url:
        upload_all(url)
        yield url, port
