"""A fresh server whose first programs are raw StableHLO linear algebra runs them.

jaxlib hands its LAPACK kernels their entry points only when jax's own linalg
lowering runs. A raw StableHLO upload never lowers through jax, so a server that
had not made the kernels ready died with SIGSEGV on the first ``lapack_*`` call.
These programs come from ``jax.jit(f).lower(...)``, never through jax_export, and
reach a server that has run nothing before them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import jax
import numpy as np
import pytest
from jax._src.interpreters import mlir
from lapack_cases import FAMILIES

from jitserve import wire

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _inputs(family: str, shapes: list[tuple[int, ...]], dtype: type) -> list[np.ndarray]:
    rng = np.random.default_rng(len(family))
    out = []
    for shape in shapes:
        x = rng.standard_normal(shape)
        if np.issubdtype(dtype, np.complexfloating):
            x = x + 1j * rng.standard_normal(shape)
        if family == "potrf":  # Cholesky wants a Hermitian positive-definite matrix
            x = x @ np.conj(np.swapaxes(x, -1, -2)) + shape[-1] * np.eye(shape[-1])
        out.append(x.astype(dtype))
    return out


def _program(fn: Callable[..., Any], args: list[np.ndarray], kind: str) -> bytes:
    lowered = jax.jit(fn).lower(*args)
    if kind == "text":
        return lowered.as_text().encode()
    return mlir.module_to_bytecode(lowered.compiler_ir("stablehlo"))


CASES = [(family, dtype, kind)
         for family in sorted(FAMILIES)
         for dtype, kind in ((np.float64, "text"), (np.complex128, "bytecode"))
         if not (family == "gtsv" and dtype is np.complex128)]


def test_raw_stablehlo_linalg_as_the_first_programs(start_server: Callable[..., str]) -> None:
    url = start_server({}, "fresh")
    with httpx.Client(base_url=url, timeout=120) as http:
        uploaded = []
        for family, dtype, kind in CASES:  # every upload before any execution
            fn, shapes = FAMILIES[family]
            args = _inputs(family, shapes, dtype)
            r = http.post("/v1/programs", params={"format": "stablehlo"},
                          content=_program(fn, args, kind))
            assert r.status_code == 201, (family, r.text)
            uploaded.append((family, fn, args, r.json()["program_id"]))
        for family, fn, args, pid in uploaded:
            r = http.post(f"/v1/programs/{pid}/execute", params={"wait": 60_000},
                          content=wire.packb({"args": args}),
                          headers={"content-type": wire.MSGPACK, "accept": wire.MSGPACK})
            assert r.status_code == 200, (family, r.text)
            got = wire.unpackb(r.content)["outputs"]
            want = jax.tree.leaves(jax.jit(fn)(*args))
            assert len(got) == len(want), family
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, np.asarray(w), rtol=1e-9, atol=1e-9,
                                           err_msg=family)
        assert http.get("/healthz").status_code == 200
