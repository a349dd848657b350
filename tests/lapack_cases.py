"""One program per LAPACK family jaxlib's CPU kernels implement, with input shapes.

Shared by the LAPACK shape-rule tests (tests/compiler) and the end-to-end test
that runs each family as a server's first program (tests/e2e).
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax import lax

__all__ = ["FAMILIES"]

FAMILIES = {
    "potrf": (jnp.linalg.cholesky, [(3, 4, 4)]),
    "getrf": (lambda a: lax.linalg.lu(a), [(2, 5, 3)]),
    "getrf_wide": (lambda a: lax.linalg.lu(a), [(2, 3, 5)]),
    "qr": (jnp.linalg.qr, [(2, 5, 3)]),
    "qr_wide": (jnp.linalg.qr, [(3, 5)]),
    "eigh": (jnp.linalg.eigh, [(2, 4, 4)]),
    "eig": (jnp.linalg.eig, [(4, 4)]),
    "svd": (jnp.linalg.svd, [(2, 5, 3)]),
    "svd_reduced": (lambda a: jnp.linalg.svd(a, full_matrices=False), [(3, 5)]),
    "svd_values": (lambda a: jnp.linalg.svd(a, compute_uv=False), [(5, 3)]),
    "svd_values_reduced": (lambda a: lax.linalg.svd(a, full_matrices=False, compute_uv=False),
                           [(5, 3)]),
    "trsm_left": (lambda a, b: jsl.solve_triangular(a, b, lower=True), [(2, 4, 4), (2, 4, 3)]),
    "trsm_right": (lambda a, b: lax.linalg.triangular_solve(a, b, left_side=False, lower=True),
                   [(3, 3), (4, 3)]),
    "gtsv": (lax.linalg.tridiagonal_solve, [(4,), (4,), (4,), (4, 2)]),
    "schur": (jsl.schur, [(4, 4)]),
    "hessenberg": (jsl.hessenberg, [(4, 4)]),
    "tridiagonal": (lax.linalg.tridiagonal, [(2, 4, 4)]),
}
