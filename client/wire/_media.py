"""Media types, and the format constants both sides of the API name."""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "JAXPR_FORMAT_NAME",
    "JAXPR_PRIMITIVES",
    "JAXPR_FORMAT_VERSION",
    "JAXPR_MIN_SUPPORTED_VERSION",
    "JSON",
    "MSGPACK",
    "MSGPACK_TYPES",
    "OCTET_STREAM",
    "ProgramFormat",
    "TierName",
]

MSGPACK: Final = "application/msgpack"
JSON: Final = "application/json"
OCTET_STREAM: Final = "application/octet-stream"
#: Content types read as msgpack (the registered name and the common variants).
MSGPACK_TYPES: Final = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")


class ProgramFormat(enum.StrEnum):
    """The ``format`` of an upload (docs/api.md, "Programs")."""

    JAX_EXPORT = "jax_export"
    STABLEHLO = "stablehlo"
    JAXPR = "jaxpr"


#: The value of a jaxpr document's ``"format"`` field (docs/jaxpr-format.md).
JAXPR_FORMAT_NAME: Final = "jitserve.jaxpr"

# The jaxpr document version. Bump it on any change an older decoder would misread:
# a field renamed, removed or reinterpreted, a param's spelling changed, or a JAX
# upgrade that changes a primitive's params. Adding an optional field, a primitive,
# or a param with a default does not bump it.
#
# Compatibility window: a server decodes every version from
# JAXPR_MIN_SUPPORTED_VERSION to JAXPR_FORMAT_VERSION. After a bump, the previous
# version stays readable for at least six months (the minimum trails by one), so
# that clients can upgrade on their own schedule.
#
# 1 (2026-11-21): the first version, written against jax 0.10.2.
JAXPR_FORMAT_VERSION: Final = 1
JAXPR_MIN_SUPPORTED_VERSION: Final = 1

#: The primitives a version-1 document may name: the server's allowlist
#: (``compiler/jaxpr/_prims.py``; a test keeps the two equal). A writer on another
#: jax spells what its jax binds in these names (``client/jaxpr.py``), so any server
#: of this format reads it.
JAXPR_PRIMITIVES: Final = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "approx_top_k", "argmax", "argmin",
    "asin", "asinh", "atan", "atan2", "atanh", "bessel_i0e", "bessel_i1e",
    "bitcast_convert_type", "broadcast_in_dim", "call", "cbrt", "ceil", "cholesky",
    "clamp", "closed_call", "clz", "complex", "concatenate", "cond", "conj",
    "conv_general_dilated", "convert_element_type", "copy", "cos", "cosh", "cumlogsumexp",
    "cummax", "cummin", "cumprod", "cumsum", "custom_jvp_call", "custom_linear_solve",
    "custom_vjp_call", "device_put", "digamma", "div", "dot_general", "dynamic_slice",
    "dynamic_update_slice", "eig", "eigh", "empty2", "eq", "eq_to", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expm1", "fft", "floor", "gather", "ge", "geqrf", "gt",
    "hessenberg", "householder_product", "igamma", "igamma_grad_a", "igammac", "imag",
    "integer_pow", "iota", "is_finite", "jit", "le", "le_to", "lgamma", "log", "log1p",
    "logistic", "lt", "lt_to", "lu", "lu_pivots_to_permutation", "max", "min", "mul",
    "name", "ne", "neg", "nextafter", "not", "optimization_barrier", "or", "pad",
    "platform_index", "polygamma", "population_count", "pow", "qr", "random_bits",
    "random_clone", "random_fold_in", "random_gamma", "random_seed", "random_split",
    "random_unwrap", "random_wrap", "real", "reduce", "reduce_and", "reduce_max",
    "reduce_min", "reduce_or", "reduce_precision", "reduce_prod", "reduce_sum",
    "reduce_window", "reduce_window_max", "reduce_window_min", "reduce_window_sum",
    "reduce_xor", "regularized_incomplete_beta", "rem", "remat2", "reshape", "rev",
    "rng_bit_generator", "round", "rsqrt", "scan", "scatter", "scatter-add", "scatter-max",
    "scatter-min", "scatter-mul", "scatter-sub", "schur", "select_and_gather_add",
    "select_and_scatter", "select_and_scatter_add", "select_n", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh", "slice",
    "sort", "split", "sqrt", "square", "squeeze", "stack", "stop_gradient", "sub", "svd",
    "tan", "tanh", "threefry2x32", "tile", "top_k", "transpose", "triangular_solve",
    "tridiagonal", "tridiagonal_solve", "unstack", "while", "xor", "zeta",
})


class TierName(enum.StrEnum):
    """Who answered a lookup: the ``tier`` of a compile or execute answer.

    ``memory`` is a loaded executable in the runtime (L1); ``disk`` and ``redis``
    are the serialized tiers (L2); ``compiled`` means XLA compiled it just now.
    """

    MEMORY = "memory"
    DISK = "disk"
    REDIS = "redis"
    COMPILED = "compiled"
