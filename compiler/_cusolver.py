"""Shape rules for the CUDA linear-algebra custom calls a program may contain.

On a CUDA host jax lowers linalg to cuSOLVER, cuSPARSE and jaxlib's own CUDA
kernels. Like the LAPACK kernels (compiler._lapack) they write results sized from
their operands and attributes, so each allowed target has a rule giving its exact
result types, and a module that declares anything else is refused before XLA sees
it. Unlike LAPACK's, the targets do not name the element type: the kernel takes it
from the first operand (f32, f64, complex<f32> or complex<f64>).

Where a kernel writes the same results as its LAPACK counterpart (potrf, getrf,
geqrf, orgqr, syevd, sytrd), the LAPACK rule is reused. The rules mirror jax's
CUDA lowerings in jax/_src/lax/linalg.py and the kernels in jaxlib/gpu/
(solver_kernels_ffi.cc, sparse_kernels.cc, linalg_kernels.cc);
tests/compiler/test_cusolver_rules.py checks them against jax's own lowering.

Only targets that jax.export guarantees stable can be allowed. Those jax lowers
for CUDA that are not in that set stay refused, without a rule: eig
(cusolver_geev_ffi, or cuhybrid_eig_real/cuhybrid_eig_comp on the host),
SvdAlgorithm.POLAR (cusolver_gesvdp_ffi), ormqr (cusolver_ormqr_ffi), pivoted QR
(cuhybrid_geqp3), cholesky_update (cu_cholesky_update_ffi), symmetric_product
(cusolver_syrk_ffi) and tridiagonal_solve with perturb_singular
(cu_tridiagonal_solve_perturbed). Schur and Hessenberg have no CUDA lowering;
triangular_solve lowers to a plain op.
"""

from __future__ import annotations

from functools import partial

from jax._src.lib.mlir import ir

from jitserve.compiler._lapack import ELEMENT, REAL, Rule, Typ, check_call, expect_operands, matrix
from jitserve.compiler._lapack import RULES as _LAPACK_RULES
from jitserve.compiler.errors import UnsafeProgram

__all__ = ["check_cusolver_call", "is_cusolver_target"]

# The LAPACK rules take a kind letter; a cuSOLVER kernel takes any of the four types.
_KIND = {element: kind for kind, element in ELEMENT.items()}
_GTSV2 = "cusparse_gtsv2_ffi"
_PIVOTS = "cu_lu_pivots_to_permutation"


def is_cusolver_target(target: str) -> bool:
    return target in _RULES or target == _PIVOTS


def check_cusolver_call(op: ir.Operation, target: str) -> None:
    """Raise ``UnsafeProgram`` unless ``op``'s result types are exactly what the kernel writes."""
    if target == _PIVOTS:
        rule = partial(_pivots_to_permutation, _permutation_size(op))
        check_call(op, target, rule, {"i32": ""}, core_rank=1)
    elif target in _RULES:
        core_rank = 1 if target == _GTSV2 else 2  # gtsv2's first operand is a vector
        check_call(op, target, _RULES[target], _KIND, core_rank)
    else:
        raise UnsafeProgram(f"custom_call target {target!r} has no shape rule")


def _flag(attrs: dict[str, int], name: str) -> bool:
    value = attrs.get(name)
    if not isinstance(value, bool):
        raise ValueError(f"needs the boolean attribute {name}")
    return value


def _gesvdj(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    """Jacobi SVD: always writes U and V (not V^T), m x k and n x k without full_matrices."""
    expect_operands(ops)
    b, m, n = matrix(ops[0])
    r = min(m, n)
    u, v = ((m, m), (n, n)) if _flag(attrs, "full_matrices") else ((m, r), (n, r))
    e = ELEMENT[k]
    return [ops[0], ((*b, r), REAL[k]), ((*b, *u), e), ((*b, *v), e), (b, "i32")]


def _gesvd(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    """QR SVD of an m x n matrix with m >= n, or of its transpose (``transposed``, m < n).

    jax sets ``transposed`` exactly when m < n (the kernel refuses wide matrices);
    then the kernel's U, written first, is jax's V^T. Without compute_uv, jax
    declares U and V^T as scalars, which the kernel leaves alone.
    """
    expect_operands(ops)
    b, m, n = matrix(ops[0])
    transposed = _flag(attrs, "transposed")
    if transposed != (m < n):
        raise ValueError(f"transposed must be {m < n} for a {m} x {n} matrix")
    big, r, e = max(m, n), min(m, n), ELEMENT[k]
    u: Typ
    vt: Typ
    if not _flag(attrs, "compute_uv"):
        u = vt = ((), e)
    elif _flag(attrs, "full_matrices"):
        u, vt = ((*b, big, big), e), ((*b, r, r), e)
    else:
        u, vt = ((*b, *((r, big) if transposed else (big, r))), e), ((*b, r, r), e)
    return [ops[0], ((*b, r), REAL[k]), u, vt, (b, "i32")]


def _gtsv2(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    """LAPACK gtsv's operands, but writes only the solution (no info).

    cuSPARSE needs m >= 3; jax solves smaller systems without it.
    """
    solution = _LAPACK_RULES["gtsv"](k, ops, attrs)[3]
    if solution[0][-2] < 3:
        raise ValueError("cuSPARSE gtsv2 needs at least 3 rows")
    return [solution]


def _permutation_size(op: ir.Operation) -> int:
    """The permutation's length, which jax gives only as the result type.

    Any length at least the pivots' is safe: the kernel writes exactly that many
    entries per batch and skips pivots outside it.
    """
    t = op.results[0].type if len(op.results) == 1 else None
    if isinstance(t, ir.RankedTensorType) and t.has_static_shape and t.rank:
        return t.shape[-1]
    return -1


def _pivots_to_permutation(size: int, k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    shape = ops[0][0]
    if not shape or size < shape[-1]:
        raise ValueError("the permutation must be at least as long as the pivots")
    return [((*shape[:-1], size), "i32")]


_RULES: dict[str, Rule] = {
    "cusolver_potrf_ffi": _LAPACK_RULES["potrf"], "cusolver_getrf_ffi": _LAPACK_RULES["getrf"],
    "cusolver_geqrf_ffi": _LAPACK_RULES["geqrf"], "cusolver_orgqr_ffi": _LAPACK_RULES["orgqr"],
    "cusolver_syevd_ffi": _LAPACK_RULES["syevd"], "cusolver_sytrd_ffi": _LAPACK_RULES["sytrd"],
    "cusolver_gesvdj_ffi": _gesvdj, "cusolver_gesvd_ffi": _gesvd, _GTSV2: _gtsv2,
}
