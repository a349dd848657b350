"""The LAPACK shape rules accept exactly what jax lowers, and refuse a resized result."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from lapack_cases import FAMILIES

from jitserve.compiler import Limits, UnsafeProgram
from jitserve.compiler.programs import decode_program

jax.config.update("jax_enable_x64", True)

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]


def _text(fn, shapes, dtype) -> str:  # noqa: ANN001
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return jax.jit(fn).lower(*args).as_text()


def _decode(text: str):  # noqa: ANN202
    return decode_program(text.encode(), "stablehlo", platform="cpu", limits=Limits())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_jax_lowering_is_accepted(family: str, dtype: type) -> None:
    fn, shapes = FAMILIES[family]
    text = _text(fn, shapes, dtype)
    assert "lapack_" in text
    _decode(text)


_CALL = re.compile(r"custom_call @(\w+)\((.*?)\) (\{.*\}) : \((.*?)\) -> \(?(.*?)\)?$")


def _standalone_call(text: str, shrink: bool) -> str:
    """A module that is just the first LAPACK call of ``text``; ``shrink`` undersizes a result."""
    line = next(ln for ln in text.splitlines() if "custom_call @lapack_" in ln)
    target, _, attrs, operands, results = _CALL.search(line.strip()).groups()
    op_types = re.findall(r"tensor<[^>]*>+", operands)
    res_types = re.findall(r"tensor<[^>]*>+", results)
    if shrink:  # the last result with a leading dim above 1 (results aliased to operands come first)
        i = max(i for i, t in enumerate(res_types) if re.match(r"tensor<([2-9]|\d\d)", t))
        res_types[i] = re.sub(r"tensor<\d+", "tensor<1", res_types[i], count=1)
    args = ", ".join(f"%a{i}: {t}" for i, t in enumerate(op_types))
    uses = ", ".join(f"%a{i}" for i in range(len(op_types)))
    outs = ", ".join(f"%r#{i}" for i in range(len(res_types)))
    return (
        f"func.func public @main({args}) -> ({', '.join(res_types)}) {{\n"
        f"  %r:{len(res_types)} = stablehlo.custom_call @{target}({uses}) {attrs} : "
        f"({', '.join(op_types)}) -> ({', '.join(res_types)})\n"
        f"  return {outs} : {', '.join(res_types)}\n}}\n")


def test_standalone_call_is_accepted() -> None:
    fn, shapes = FAMILIES["getrf"]
    _decode(_standalone_call(_text(fn, shapes, np.float32), shrink=False))


@pytest.mark.parametrize("family", ["getrf", "svd", "eigh", "qr", "potrf", "eig", "tridiagonal"])
def test_undersized_result_is_refused(family: str) -> None:
    fn, shapes = FAMILIES[family]
    text = _standalone_call(_text(fn, shapes, np.float32), shrink=True)
    with pytest.raises(UnsafeProgram, match="do not match what the kernel writes"):
        _decode(text)


def test_bad_mode_attribute_is_refused() -> None:
    fn, shapes = FAMILIES["svd_reduced"]
    text = _standalone_call(_text(fn, shapes, np.float32), shrink=False)
    text = text.replace("mode = 83 : ui8", "mode = 65 : ui8")
    with pytest.raises(UnsafeProgram, match="do not match"):
        _decode(text)
