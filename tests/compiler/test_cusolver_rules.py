"""The CUDA linalg shape rules accept exactly what jax lowers, and refuse any other result.

No GPU is needed: jax cross-lowers for ``cuda`` on any host, and the rules read
only the module. Each family of tests/lapack_cases.py that has a CUDA lowering,
plus the shapes and options that pick other kernels or attributes on CUDA.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from lapack_cases import FAMILIES

from jitserve.compiler import Limits, UnsafeProgram
from jitserve.compiler._cusolver import is_cusolver_target
from jitserve.compiler.programs import decode_program

jax.config.update("jax_enable_x64", True)

DTYPES = [np.float32, np.float64, np.complex64, np.complex128]
QR, JACOBI = lax.linalg.SvdAlgorithm.QR, lax.linalg.EighImplementation.JACOBI
Family = tuple[Callable[..., Any], list[tuple[int, ...]]]
PIVOTS = "cu_lu_pivots_to_permutation"

# Schur and Hessenberg have no CUDA lowering; eig's CUDA targets are not stable (below).
NO_CUDA_RULE = {"schur", "hessenberg", "eig"}
CUDA_FAMILIES: dict[str, Family] = {
    **{name: case for name, case in FAMILIES.items() if name not in NO_CUDA_RULE},
    "solve": (jnp.linalg.solve, [(4, 4), (4, 2)]),
    "qr_complete": (lambda a: jnp.linalg.qr(a, mode="complete"), [(5, 3)]),
    "householder": (lax.linalg.householder_product, [(3, 5, 4), (3, 2)]),
    "eigh_jacobi": (lambda a: lax.linalg.eigh(a, implementation=JACOBI), [(3, 4, 4)]),
    "eigh_upper": (lambda a: lax.linalg.eigh(a, lower=False), [(4, 4)]),
    "svd_econ": (lambda a: jnp.linalg.svd(a, full_matrices=False), [(2, 40, 33)]),
    "svd_econ_values": (lambda a: lax.linalg.svd(a, full_matrices=False, compute_uv=False),
                        [(40, 33)]),
    "svd_tall_1025": (jnp.linalg.svd, [(1025, 2)]),
    "gesvd": (lambda a: lax.linalg.svd(a, algorithm=QR), [(2, 5, 3)]),
    "gesvd_wide": (lambda a: lax.linalg.svd(a, algorithm=QR), [(3, 5)]),
    "gesvd_wide_reduced": (lambda a: lax.linalg.svd(a, full_matrices=False, algorithm=QR),
                           [(2, 3, 5)]),
    "gesvd_reduced": (lambda a: lax.linalg.svd(a, full_matrices=False, algorithm=QR), [(5, 3)]),
    "gesvd_values": (lambda a: lax.linalg.svd(a, compute_uv=False, algorithm=QR), [(2, 3, 5)]),
    "gtsv_batched": (lax.linalg.tridiagonal_solve, [(2, 4), (2, 4), (2, 4), (2, 4, 3)]),
    "tridiagonal_upper": (lambda a: lax.linalg.tridiagonal(a, lower=False), [(4, 4)]),
}


@functools.cache
def _text(family: str, dtype: type) -> str:
    fn, shapes = CUDA_FAMILIES[family]
    traced = jax.jit(fn).trace(*[jax.ShapeDtypeStruct(s, dtype) for s in shapes])
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def _decode(text: str) -> None:
    decode_program(text.encode(), "stablehlo", platform="cuda", limits=Limits())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("family", sorted(CUDA_FAMILIES))
def test_jax_lowering_is_accepted(family: str, dtype: type) -> None:
    text = _text(family, dtype)
    assert family.startswith("trsm") or _calls(text), "expected a CUDA linalg custom call"
    assert "lapack_" not in text
    _decode(text)


@pytest.mark.parametrize("family", ["potrf", "svd", "qr", "getrf", "gesvd_wide_reduced"])
def test_cuda_export_is_accepted(family: str) -> None:
    """The path of a real upload: a jax.export artifact for cuda, decoded by a CUDA server."""
    fn, shapes = CUDA_FAMILIES[family]
    specs = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]
    flat_fn = lambda *args: tuple(jax.tree.leaves(fn(*args)))  # noqa: E731 (SVDResult is no export tree)
    exported = jax.export.export(jax.jit(flat_fn), platforms=["cuda"])(*specs)
    program = decode_program(bytes(exported.serialize()), None, platform="cuda", limits=Limits())
    assert program.platforms == ("cuda",)


def test_longer_permutation_is_accepted() -> None:
    fn = functools.partial(lax.linalg.lu_pivots_to_permutation, permutation_size=6)
    text = jax.jit(fn).trace(jax.ShapeDtypeStruct((2, 3), np.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "tensor<2x6xi32>" in text
    _decode(text)


def test_eig_stays_refused() -> None:
    """eig's CUDA kernels are not guaranteed stable: cusolver_geev_ffi where jaxlib's cuSOLVER
    has it (11.7.1 on), else cuhybrid_eig_real (LAPACK on the host), as here without a GPU."""
    text = jax.jit(jnp.linalg.eig).trace(jax.ShapeDtypeStruct((4, 4), np.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    with pytest.raises(UnsafeProgram, match="'(cuhybrid_eig_real|cusolver_geev_ffi)' is not allowed"):
        _decode(text)


_CALL = re.compile(r"custom_call @(\w+)\((.*?)\) (\{.*\}) : \((.*?)\) -> \(?(.*?)\)?$")
_CONFIG = re.compile(r"mhlo\.(?:backend_config|frontend_attributes) = \{[^{}]*\}")
_TYPE = re.compile(r"tensor<[^>]*>+")


def _calls(text: str) -> list[tuple[str, str, list[str], list[str]]]:
    """(target, attributes, operand types, result types) of each CUDA linalg call of ``text``."""
    calls = []
    for line in text.splitlines():
        m = _CALL.search(line.strip())
        if m and is_cusolver_target(m.group(1)):
            target, _, attrs, operands, results = m.groups()
            calls.append((target, attrs, _TYPE.findall(operands), _TYPE.findall(results)))
    return calls


def _standalone(target: str, attrs: str, operands: list[str], results: list[str]) -> str:
    """A module that is just this call, with the attributes the kernel reads (no layouts or
    aliases, which the MLIR verifier would check before the rules)."""
    config = ", ".join(['backend_config = ""', *_CONFIG.findall(attrs)])
    args = ", ".join(f"%a{i}: {t}" for i, t in enumerate(operands))
    uses = ", ".join(f"%a{i}" for i in range(len(operands)))
    n = len(results)
    lhs = {0: "", 1: "%r = "}.get(n, f"%r:{n} = ")
    outs = "%r" if n == 1 else ", ".join(f"%r#{i}" for i in range(n))
    ret = f"return {outs} : {', '.join(results)}" if n else "return"
    return (
        f"func.func public @main({args}) -> ({', '.join(results)}) {{\n"
        f"  {lhs}stablehlo.custom_call @{target}({uses}) {{{config}}} : "
        f"({', '.join(operands)}) -> ({', '.join(results)})\n  {ret}\n}}\n")


_OTHER_ELEMENT = {"f32": "f64", "f64": "f32", "complex<f32>": "complex<f64>",
                  "complex<f64>": "complex<f32>", "i32": "i64"}


def _split(t: str) -> tuple[list[int], str]:
    dims, element = re.fullmatch(r"tensor<((?:\d+x)*)(.*)>", t).groups()
    return [int(d) for d in dims.split("x")[:-1]], element


def _join(sizes: list[int], element: str) -> str:
    return f"tensor<{''.join(f'{d}x' for d in sizes)}{element}>"


def _bigger(t: str) -> str:
    """One dimension +1 (the first; a scalar becomes a 1-vector)."""
    sizes, element = _split(t)
    return _join([sizes[0] + 1, *sizes[1:]] if sizes else [1], element)


def _other_element(t: str) -> str:
    sizes, element = _split(t)
    return _join(sizes, _OTHER_ELEMENT[element])


def _mutants(results: list[str], kind: str) -> Iterator[tuple[int, list[str]]]:
    for i, t in enumerate(results):
        if kind == "dropped":
            yield i, results[:i] + results[i + 1:]
        else:
            yield i, [*results[:i], _bigger(t) if kind == "bigger" else _other_element(t), *results[i + 1:]]


def test_standalone_call_is_accepted() -> None:
    for family in CUDA_FAMILIES:
        for target, attrs, operands, results in _calls(_text(family, np.complex64)):
            _decode(_standalone(target, attrs, operands, results))


@pytest.mark.parametrize("kind", ["bigger", "other_element", "dropped"])
@pytest.mark.parametrize("family", sorted(f for f in CUDA_FAMILIES if not f.startswith("trsm")))
def test_changed_result_is_refused(family: str, kind: str) -> None:
    accepted = []
    for dtype in (np.float32, np.complex128):
        calls = _calls(_text(family, dtype))
        assert calls
        for target, attrs, operands, results in calls:
            if kind == "bigger" and target == PIVOTS and len(_split(results[0])[0]) == 1:
                continue  # a longer permutation is legitimate (test_short_permutation_is_refused)
            for i, changed in _mutants(results, kind):
                try:
                    _decode(_standalone(target, attrs, operands, changed))
                    accepted.append(f"{target} result {i}: {changed}")
                except UnsafeProgram as e:
                    assert target in str(e)
    assert not accepted


def test_short_permutation_is_refused() -> None:
    target, attrs, operands, results = _calls(_text("solve", np.float32))[1]
    assert target == PIVOTS and results == ["tensor<4xi32>"]
    with pytest.raises(UnsafeProgram, match=f"{target}.*at least as long as the pivots"):
        _decode(_standalone(target, attrs, operands, ["tensor<3xi32>"]))


@pytest.mark.parametrize(("family", "attribute", "value"), [
    ("svd_econ", "full_matrices = false", "full_matrices = true"),
    ("gesvd_wide_reduced", "full_matrices = false", "full_matrices = true"),
    ("gesvd_values", "compute_uv = false", "compute_uv = true"),
    ("gesvd_wide", "transposed = true", "transposed = false"),
    ("svd_econ", "full_matrices = false", "full_matrices = 0 : i32"),
])
def test_changed_attribute_is_refused(family: str, attribute: str, value: str) -> None:
    target, attrs, operands, results = _calls(_text(family, np.float32))[0]
    assert attribute in attrs
    changed = attrs.replace(attribute, value)
    with pytest.raises(UnsafeProgram, match=target):
        _decode(_standalone(target, changed, operands, results))


@pytest.mark.parametrize("target", ["cusolver_gesvdj_ffi", "lapack_sgesdd_ffi"])
def test_backend_config_dictionary_is_refused(target: str) -> None:
    """With API version 4, a ``backend_config`` dictionary reaches the kernel instead of
    ``mhlo.backend_config``: a module could show the rule a reduced SVD and run a full one."""
    call = (f'%r:5 = stablehlo.custom_call @{target}(%a) {{api_version = 4 : i32, '
            'backend_config = {compute_uv = true, full_matrices = true, mode = 65 : ui8}, '
            'mhlo.backend_config = {compute_uv = true, full_matrices = false, mode = 83 : ui8}} : '
            '(tensor<40x33xf32>) -> (tensor<40x33xf32>, tensor<33xf32>, tensor<40x33xf32>, '
            'tensor<33x33xf32>, tensor<i32>)')
    text = (f"func.func public @main(%a: tensor<40x33xf32>) -> tensor<33xf32> {{\n  {call}\n"
            "  return %r#1 : tensor<33xf32>\n}\n")
    with pytest.raises(UnsafeProgram, match=f"{target}: attributes must be in mhlo.backend_config"):
        _decode(text)
