"""The primitive allowlist of the jaxpr format: what each primitive's params are.

``SPECS`` maps a primitive name to a ``PrimSpec``: the JAX primitive object,
one typed ``Param`` per param, and optional hooks that rebuild params JAX needs
but the document does not carry (shardings of a nested ``jit``, the consts of a
scatter's update jaxpr) and that check what JAX's own type rules leave unchecked
(the carry types of a ``while``, the branch signatures of a ``cond``).

The allowlist starts from ``jax.extend.core.primitives`` (plus a few primitives
that ordinary ``jax.numpy`` programs bind but that module does not export) and
leaves out everything in ``REFUSED``, each with its reason. A test checks that
every public primitive is either here or refused, so a JAX upgrade that adds one
is noticed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.extend.core.primitives as public_prims
from jax._src import core, dispatch
from jax._src import mesh as mesh_lib
from jax._src.lax import convolution, fft, lax, linalg, slicing, windowed_reductions
from jax._src.lax.control_flow import conditionals, solves
from jax._src.named_sharding import UNSPECIFIED
from jax._src.random import core as random_core
from jax._src.random import prng

from jitserve.compiler.jaxpr._params import (
    AXES,
    BOOL,
    DTYPE,
    FLOAT,
    INT,
    NAT,
    NONE,
    NUMBER,
    PAIRS,
    REQUIRED,
    SHAPE,
    STR,
    TRIPLES,
    BadParam,
    Codec,
    DecodeCtx,
    Param,
    closed_jaxpr,
    closed_jaxprs,
    enum_of,
    one_of,
    opt,
    record,
    tuple_of,
)

__all__ = ["INLINED", "OMIT", "PrimSpec", "REFUSED", "SPECS", "public_primitives"]

# A default meaning "leave this param out of the params dict" (cond's optional
# branches_platforms).
OMIT: Any = object()

# Calls whose evaluation is exactly their body: the decoder splices the body in
# place of the equation. For custom_jvp/custom_vjp this drops the differentiation
# rules, which the format does not carry (evaluation only).
INLINED = frozenset({"custom_jvp_call", "custom_vjp_call", "remat2", "closed_call", "call"})

# Every value a jaxpr document can name is an array, so its avals are ShapedArrays.
Avals = Sequence[core.ShapedArray]
Finalize = Callable[[dict[str, Any], Avals], dict[str, Any]]
Check = Callable[[Avals, Mapping[str, Any]], None]


@dataclasses.dataclass(frozen=True)
class PrimSpec:
    """How to rebuild one primitive from a document.

    Attributes:
      primitive: the JAX primitive bound by the rebuilt equation.
      params: every param the document may carry, with its codec and default.
      finalize: turns the decoded params into the dict JAX expects (adds the
        params the format fixes to their defaults); given the input avals.
      check: raises ``BadParam`` for a well-formed but ill-typed use that JAX's
        abstract evaluation would let through (nested jaxpr signatures).
    """

    primitive: core.Primitive
    params: Mapping[str, Param]
    finalize: Finalize | None = None
    check: Check | None = None


def public_primitives() -> dict[str, core.Primitive]:
    """Every primitive exported by ``jax.extend.core.primitives``, by name."""
    return {p.name: p for p in vars(public_prims).values() if isinstance(p, core.Primitive)}


# -- refusals --------------------------------------------------------------------------

_EFFECTS = "carries an effect (tokens, ordering); the format carries pure evaluation only"
_COLLECTIVE = ("is a collective over named mesh axes; sharding and multi-device programs "
               "are out of scope")
REFUSED: dict[str, str] = {
    "after_all": _EFFECTS,
    "create_token": _EFFECTS,
    "get": "reads a mutable array ref (a state effect)",
    "swap": "writes a mutable array ref (a state effect)",
    "rng_uniform": ("draws from XLA's stateful RngUniform, whose bits depend on the backend "
                    "and run; use threefry keys or rng_bit_generator"),
    "custom_lin": "exists only in the middle of linearization, never in a finished program",
    "sharding_constraint": "is a sharding annotation; placement is the server's choice",
    **{name: _COLLECTIVE for name in (
        "all_gather", "all_to_all", "axis_index", "pmax", "pmin", "ppermute", "psum",
        "ragged_all_to_all")},
}


# -- codecs that know JAX's types -------------------------------------------------------

def PRECISION(v: Any, ctx: DecodeCtx) -> Any:
    """``null``, ``[lhs, rhs]`` Precision names, or a DotAlgorithmPreset name."""
    if v is None:
        return None
    if isinstance(v, str):
        return enum_of(lax.DotAlgorithmPreset)(v, ctx)
    # No null inside the pair: JAX never makes one, and lowering one aborts LLVM.
    return tuple_of(enum_of(lax.Precision), length=2)(v, ctx)


def DOT_DIMS(v: Any, ctx: DecodeCtx) -> Any:
    """``[[lhs_contract, rhs_contract], [lhs_batch, rhs_batch]]``."""
    pair = tuple_of(AXES, length=2)
    return tuple_of(pair, length=2)(v, ctx)


GATHER_DIMS = record(slicing.GatherDimensionNumbers, {
    "offset_dims": AXES, "collapsed_slice_dims": AXES, "start_index_map": AXES,
    "operand_batching_dims": AXES, "start_indices_batching_dims": AXES})
SCATTER_DIMS = record(slicing.ScatterDimensionNumbers, {
    "update_window_dims": AXES, "inserted_window_dims": AXES,
    "scatter_dims_to_operand_dims": AXES, "operand_batching_dims": AXES,
    "scatter_indices_batching_dims": AXES})
CONV_DIMS = record(convolution.ConvDimensionNumbers, {
    "lhs_spec": AXES, "rhs_spec": AXES, "out_spec": AXES})
GATHER_MODE = enum_of(slicing.GatherScatterMode)


def _tolerance(atol: float, rtol: float, ulps: int) -> Any:
    try:
        return lax.Tolerance(atol=atol, rtol=rtol, ulps=ulps)
    except ValueError as e:
        raise BadParam(str(e)) from None


ACCURACY = opt(one_of(enum_of(lax.AccuracyMode),
                      record(_tolerance, {"atol": FLOAT, "rtol": FLOAT, "ulps": NAT})))


def PRNG_IMPL(v: Any, ctx: DecodeCtx) -> Any:
    if not isinstance(v, str) or v not in prng.prngs:
        raise BadParam(f"expected a PRNG implementation name, one of {sorted(prng.prngs)}")
    return prng.prngs[v]


_SELECT_PRIMS = {"ge": lax.ge_p, "le": lax.le_p}


def SELECT_PRIM(v: Any, ctx: DecodeCtx) -> Any:
    if not isinstance(v, str) or v not in _SELECT_PRIMS:
        raise BadParam(f"expected one of {sorted(_SELECT_PRIMS)}, got {v!r:.40}")
    return _SELECT_PRIMS[v]


def COPY_SEMANTICS(v: Any, ctx: DecodeCtx) -> Any:
    names = ("ALWAYS_COPY", "REUSE_INPUT", "DONATE_INPUT")
    if not isinstance(v, str) or v not in names:
        raise BadParam(f"expected one of {list(names)}, got {v!r:.40}")
    return getattr(dispatch.ArrayCopySemantics, v)


PLATFORMS = tuple_of(opt(tuple_of(STR, max_length=16)), max_length=16)
SUBSET = opt(tuple_of(NAT, length=2))


def UNROLL(v: Any, ctx: DecodeCtx) -> int:
    # Unrolling copies the loop body at compile time: a size bomb if unbounded.
    n = NAT(v, ctx)
    if n > ctx.max_unroll:
        raise BadParam(f"unroll {n} exceeds the limit of {ctx.max_unroll}")
    return n


def _linear_solve_tuple(codec: Codec) -> Codec:
    return record(solves._LinearSolveTuple, {
        "matvec": codec, "vecmat": codec, "solve": codec, "transpose_solve": codec})


# -- spec builders --------------------------------------------------------------------


def _p(codec: Codec, default: Any = REQUIRED) -> Param:
    return Param(codec, default)


_NO_PARAMS: dict[str, Param] = {}
_ACCURACY = {"accuracy": _p(ACCURACY, None)}
_AXES = {"axes": _p(AXES)}
_CUMULATIVE = {"axis": _p(NAT), "reverse": _p(BOOL, False)}
_WINDOW = {"window_dimensions": _p(SHAPE), "window_strides": _p(SHAPE), "padding": _p(PAIRS),
           "base_dilation": _p(SHAPE), "window_dilation": _p(SHAPE)}
_SCATTER = {"dimension_numbers": _p(SCATTER_DIMS), "indices_are_sorted": _p(BOOL, False),
            "unique_indices": _p(BOOL, False), "mode": _p(GATHER_MODE),
            "update_jaxpr": _p(opt(closed_jaxpr("update")), None)}

# Primitives without params: elementwise math, comparisons, bitwise ops, and a
# few linear-algebra and PRNG primitives.
_PARAMLESS = (
    "abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e ceil "
    "clamp clz complex copy cosh digamma div eq eq_to erf erf_inv erfc floor ge gt igamma "
    "igamma_grad_a igammac imag is_finite le le_to lgamma lt lt_to max min ne neg nextafter "
    "not or polygamma population_count pow real regularized_incomplete_beta rem select_n "
    "shift_left shift_right_arithmetic shift_right_logical sign sinh square sub xor zeta "
    "stop_gradient optimization_barrier random_fold_in random_unwrap random_clone threefry2x32 "
    "cholesky lu hessenberg householder_product geqrf dynamic_update_slice"
).split()
_WITH_ACCURACY = "cbrt cos exp exp2 expm1 log log1p logistic rsqrt sin sqrt tan tanh".split()

# The rest, param by param. Defaults are what the lax wrappers bind when the
# caller passes nothing, so hand-written documents may leave them out.
_PARAMS: dict[str, dict[str, Param]] = {
    "mul": {"out_dtype": _p(opt(DTYPE), None)},
    "argmax": {"axes": _p(AXES), "index_dtype": _p(DTYPE)},
    "argmin": {"axes": _p(AXES), "index_dtype": _p(DTYPE)},
    "bitcast_convert_type": {"new_dtype": _p(DTYPE)},
    "broadcast_in_dim": {"shape": _p(SHAPE), "broadcast_dimensions": _p(AXES),
                         "sharding": _p(NONE, None)},
    "concatenate": {"dimension": _p(NAT)},
    "conj": {"input_dtype": _p(DTYPE)},
    "convert_element_type": {"new_dtype": _p(DTYPE), "weak_type": _p(BOOL, False),
                             "sharding": _p(NONE, None)},
    **{f"cum{op}": _CUMULATIVE for op in ("sum", "prod", "max", "min", "logsumexp")},
    "dot_general": {"dimension_numbers": _p(DOT_DIMS), "precision": _p(PRECISION, None),
                    "preferred_element_type": _p(opt(DTYPE), None),
                    "out_sharding": _p(NONE, None)},
    "dynamic_slice": {"slice_sizes": _p(SHAPE)},
    "fft": {"fft_type": _p(enum_of(fft.FftType)), "fft_lengths": _p(SHAPE)},
    "gather": {"dimension_numbers": _p(GATHER_DIMS), "slice_sizes": _p(SHAPE),
               "unique_indices": _p(BOOL, False), "indices_are_sorted": _p(BOOL, False),
               "mode": _p(GATHER_MODE), "fill_value": _p(opt(NUMBER), None)},
    "integer_pow": {"y": _p(INT)},
    "iota": {"dtype": _p(DTYPE), "shape": _p(SHAPE), "dimension": _p(NAT),
             "sharding": _p(NONE, None)},
    "pad": {"padding_config": _p(TRIPLES)},
    "reduce_sum": {"axes": _p(AXES), "out_sharding": _p(NONE, None)},
    **{f"reduce_{op}": _AXES for op in ("max", "min", "prod", "and", "or", "xor")},
    "reduce_precision": {"exponent_bits": _p(NAT), "mantissa_bits": _p(NAT)},
    "reshape": {"new_sizes": _p(SHAPE), "dimensions": _p(opt(AXES), None),
                "sharding": _p(NONE, None)},
    "rev": {"dimensions": _p(AXES)},
    "round": {"rounding_method": _p(enum_of(lax.RoundingMethod))},
    "slice": {"start_indices": _p(SHAPE), "limit_indices": _p(SHAPE),
              "strides": _p(opt(SHAPE), None)},
    "sort": {"dimension": _p(NAT), "is_stable": _p(BOOL, True), "num_keys": _p(NAT, 1)},
    "squeeze": {"dimensions": _p(AXES)},
    "top_k": {"k": _p(NAT), "axis": _p(NAT)},
    "transpose": {"permutation": _p(AXES)},
    "split": {"sizes": _p(SHAPE), "axis": _p(NAT)},
    "stack": {"axis": _p(NAT)},
    "unstack": {"axis": _p(NAT)},
    "tile": {"reps": _p(SHAPE)},
    "name": {"name": _p(STR)},
    "platform_index": {"platforms": _p(PLATFORMS)},
    "empty2": {"dtype": _p(DTYPE), "memory_space": _p(enum_of(core.MemorySpace, ("Device",)), "Device")},
    "device_put": {"devices": _p(tuple_of(NONE)), "srcs": _p(tuple_of(NONE)),
                   "copy_semantics": _p(tuple_of(COPY_SEMANTICS))},
    "conv_general_dilated": {
        "window_strides": _p(SHAPE), "padding": _p(PAIRS), "lhs_dilation": _p(SHAPE),
        "rhs_dilation": _p(SHAPE), "dimension_numbers": _p(CONV_DIMS),
        "feature_group_count": _p(NAT, 1), "batch_group_count": _p(NAT, 1),
        "precision": _p(PRECISION, None), "preferred_element_type": _p(opt(DTYPE), None),
        "out_sharding": _p(NONE, None)},
    "reduce_window_sum": _WINDOW, "reduce_window_max": _WINDOW, "reduce_window_min": _WINDOW,
    "reduce_window": {**_WINDOW, "jaxpr": _p(closed_jaxpr("computation"))},
    "select_and_gather_add": {**_WINDOW, "select_prim": _p(SELECT_PRIM)},
    "select_and_scatter_add": {"select_prim": _p(SELECT_PRIM), "window_dimensions": _p(SHAPE),
                               "window_strides": _p(SHAPE), "padding": _p(PAIRS)},
    "select_and_scatter": {"select_jaxpr": _p(closed_jaxpr("select")),
                           "scatter_jaxpr": _p(closed_jaxpr("scatter")),
                           "window_dimensions": _p(SHAPE), "window_strides": _p(SHAPE),
                           "padding": _p(PAIRS)},
    **{name: _SCATTER for name in ("scatter", "scatter-add", "scatter-sub", "scatter-mul",
                                   "scatter-min", "scatter-max")},
    "reduce": {"jaxpr": _p(closed_jaxpr("computation")), "dimensions": _p(AXES)},
    "approx_top_k": {"k": _p(NAT), "reduction_dimension": _p(INT), "recall_target": _p(FLOAT),
                     "is_max_k": _p(BOOL), "reduction_input_size_override": _p(INT, -1),
                     "aggregate_to_topk": _p(BOOL, True)},
    "rng_bit_generator": {"shape": _p(SHAPE), "dtype": _p(DTYPE),
                          "algorithm": _p(enum_of(lax.RandomAlgorithm), "RNG_DEFAULT"),
                          "out_sharding": _p(NONE, None)},
    "random_seed": {"impl": _p(PRNG_IMPL)},
    "random_wrap": {"impl": _p(PRNG_IMPL)},
    "random_bits": {"bit_width": _p(NAT), "shape": _p(SHAPE)},
    "random_split": {"shape": _p(SHAPE)},
    "random_gamma": {"log_space": _p(BOOL, False)},
    # linear algebra
    "eigh": {"lower": _p(BOOL, True), "sort_eigenvalues": _p(BOOL, True),
             "subset_by_index": _p(SUBSET, None),
             "algorithm": _p(opt(enum_of(linalg.EighImplementation)), None)},
    "eig": {"compute_left_eigenvectors": _p(BOOL, True), "compute_right_eigenvectors": _p(BOOL, True),
            "enable_eigvec_derivs": _p(BOOL, False),
            "implementation": _p(opt(enum_of(linalg.EigImplementation)), None)},
    "svd": {"full_matrices": _p(BOOL, True), "compute_uv": _p(BOOL, True),
            "subset_by_index": _p(SUBSET, None),
            "algorithm": _p(opt(enum_of(linalg.SvdAlgorithm)), None)},
    "qr": {"pivoting": _p(BOOL, False), "full_matrices": _p(BOOL, True),
           "use_magma": _p(opt(BOOL), None)},
    "schur": {"compute_schur_vectors": _p(BOOL, True), "sort_eig_vals": _p(BOOL, False),
              "select_callable": _p(NONE, None)},
    "triangular_solve": {"left_side": _p(BOOL, False), "lower": _p(BOOL, False),
                         "transpose_a": _p(BOOL, False), "conjugate_a": _p(BOOL, False),
                         "unit_diagonal": _p(BOOL, False)},
    "tridiagonal": {"lower": _p(BOOL, True)},
    "tridiagonal_solve": {"perturb_singular": _p(BOOL, False)},
    "lu_pivots_to_permutation": {"permutation_size": _p(NAT)},
    # control flow and calls
    "while": {"cond_jaxpr": _p(closed_jaxpr("cond")), "body_jaxpr": _p(closed_jaxpr("body")),
              "cond_nconsts": _p(NAT, 0), "body_nconsts": _p(NAT, 0)},
    "cond": {"branches": _p(closed_jaxprs("branch")), "branches_platforms": _p(opt(PLATFORMS), OMIT)},
    "scan": {"jaxpr": _p(closed_jaxpr("body")), "length": _p(NAT), "reverse": _p(BOOL, False),
             "num_consts": _p(NAT, 0), "num_carry": _p(NAT, 0), "unroll": _p(UNROLL, 1)},
    "jit": {"jaxpr": _p(closed_jaxpr("body")), "name": _p(STR, "jit"),
            "keep_unused": _p(BOOL, False), "inline": _p(BOOL, False)},
    "custom_linear_solve": {"const_lengths": _p(_linear_solve_tuple(NAT)),
                            "jaxprs": _p(_linear_solve_tuple(opt(closed_jaxpr("solve"))))},
    "custom_jvp_call": {"call_jaxpr": _p(closed_jaxpr("body")), "num_consts": _p(NAT, 0),
                        "symbolic_zeros": _p(BOOL, False)},
    "custom_vjp_call": {"call_jaxpr": _p(closed_jaxpr("body")), "num_consts": _p(NAT, 0),
                        "symbolic_zeros": _p(BOOL, False)},
    "remat2": {"jaxpr": _p(closed_jaxpr("body")), "prevent_cse": _p(BOOL, True),
               "differentiated": _p(BOOL, False)},
    "closed_call": {"call_jaxpr": _p(closed_jaxpr("body"))},
    "call": {"call_jaxpr": _p(closed_jaxpr("body"))},
}


# -- checks JAX's abstract evaluation leaves out ------------------------------------------


def _fmt(avals: Avals) -> str:
    return "(" + ", ".join(a.str_short(short_dtypes=True) for a in avals) + ")"


def _match(what: str, got: Avals, want: Avals) -> None:
    if len(got) != len(want) or not all(map(core.typematch, got, want)):
        raise BadParam(f"{what} are {_fmt(got)}, expected {_fmt(want)}")


def _scalar(aval: core.ShapedArray) -> core.ShapedArray:
    return core.ShapedArray((), aval.dtype)


def _check_while(in_avals: Avals, p: Mapping[str, Any]) -> None:
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    if cn + bn > len(in_avals):
        raise BadParam(f"cond_nconsts + body_nconsts = {cn + bn} exceeds the {len(in_avals)} operands")
    cconsts, bconsts, carry = in_avals[:cn], in_avals[cn:cn + bn], in_avals[cn + bn:]
    _match("cond jaxpr inputs", p["cond_jaxpr"].in_avals, [*cconsts, *carry])
    _match("cond jaxpr outputs", p["cond_jaxpr"].out_avals, [core.ShapedArray((), bool)])
    _match("body jaxpr inputs", p["body_jaxpr"].in_avals, [*bconsts, *carry])
    _match("body jaxpr outputs", p["body_jaxpr"].out_avals, carry)


def _check_cond(in_avals: Avals, p: Mapping[str, Any]) -> None:
    if not in_avals or not core.typematch(in_avals[0], core.ShapedArray((), "int32")):
        raise BadParam(f"the first operand must be an int32[] branch index, got {_fmt(in_avals[:1])}")
    branches = p["branches"]
    for i, branch in enumerate(branches):
        _match(f"branch {i} inputs", branch.in_avals, in_avals[1:])
        _match(f"branch {i} outputs", branch.out_avals, branches[0].out_avals)
    platforms = p.get("branches_platforms")
    if platforms is not None and len(platforms) != len(branches):
        raise BadParam(f"branches_platforms has {len(platforms)} entries for {len(branches)} branches")


def _check_scan(in_avals: Avals, p: Mapping[str, Any]) -> None:
    nc, ncarry, length = p["num_consts"], p["num_carry"], p["length"]
    if nc + ncarry > len(in_avals):
        raise BadParam(f"num_consts + num_carry = {nc + ncarry} exceeds the {len(in_avals)} operands")
    consts, carry, xs = in_avals[:nc], in_avals[nc:nc + ncarry], in_avals[nc + ncarry:]
    for i, x in enumerate(xs):
        if not x.shape or x.shape[0] != length:
            raise BadParam(f"scanned operand {i} is {x.str_short()}; its leading axis must be "
                           f"the length {length}")
    slices = [x.update(shape=x.shape[1:]) for x in xs]
    body = p["jaxpr"]
    _match("body inputs", body.in_avals, [*consts, *carry, *slices])
    _match("body carry outputs", body.out_avals[:ncarry], carry)


def _check_call(in_avals: Avals, p: Mapping[str, Any]) -> None:
    body: Any = p.get("jaxpr") or p.get("call_jaxpr")
    _match("body inputs", body.in_avals, in_avals)


def _check_custom_call(in_avals: Avals, p: Mapping[str, Any]) -> None:
    if p["num_consts"] > len(in_avals):
        raise BadParam(f"num_consts {p['num_consts']} exceeds the {len(in_avals)} operands")
    _check_call(in_avals, p)


def _check_reduce(in_avals: Avals, p: Mapping[str, Any]) -> None:
    n, odd = divmod(len(in_avals), 2)
    if odd or not n:
        raise BadParam(f"reduce takes operands then as many init values, got {len(in_avals)} inputs")
    inits = [_scalar(a) for a in in_avals[n:]]
    _match("computation inputs", p["jaxpr"].in_avals, inits + inits)
    _match("computation outputs", p["jaxpr"].out_avals, inits)


def _check_binary_computation(what: str, jaxpr: Any, operand: core.ShapedArray,
                              out_dtype: Any = None) -> None:
    x = _scalar(operand)
    _match(f"{what} inputs", jaxpr.in_avals, [x, x])
    _match(f"{what} outputs", jaxpr.out_avals, [core.ShapedArray((), out_dtype or x.dtype)])


def _check_scatter(in_avals: Avals, p: Mapping[str, Any]) -> None:
    if p["update_jaxpr"] is not None and in_avals:
        _check_binary_computation("update jaxpr", p["update_jaxpr"], in_avals[0])


def _check_reduce_window(in_avals: Avals, p: Mapping[str, Any]) -> None:
    _check_reduce(in_avals, p)


def _window_shape(operand: core.ShapedArray, p: Mapping[str, Any]) -> tuple[int, ...]:
    """The shape of a windowed reduction of ``operand``, after checking the window params."""
    rank = len(operand.shape)
    for key in ("window_dimensions", "window_strides", "padding", "base_dilation", "window_dilation"):
        if key in p and len(p[key]) != rank:
            raise BadParam(f"{key} has {len(p[key])} entries for an operand of rank {rank}")
        if key != "padding" and key in p and not all(d >= 1 for d in p[key]):
            raise BadParam(f"{key} entries must be at least 1, got {list(p[key])}")
    shape: tuple[int, ...] = windowed_reductions.reduce_window_shape_tuple(
        operand.shape, p["window_dimensions"], p["window_strides"], p["padding"],
        p.get("base_dilation"), p.get("window_dilation"))
    return shape


def _check_source(source: core.ShapedArray, operand: core.ShapedArray, p: Mapping[str, Any]) -> None:
    # JAX's shape rules for the select-and-scatter family do not look at the
    # source; XLA's verifier would, with a far less helpful message.
    want = _window_shape(operand, p)
    if tuple(source.shape) != tuple(want):
        raise BadParam(f"source is {source.str_short()}; the windows of the operand give shape {list(want)}")


def _check_select_and_scatter(in_avals: Avals, p: Mapping[str, Any]) -> None:
    if len(in_avals) != 3:
        raise BadParam(f"select_and_scatter takes operand, source, init value; got {len(in_avals)} inputs")
    _check_binary_computation("select jaxpr", p["select_jaxpr"], in_avals[0], bool)
    _check_binary_computation("scatter jaxpr", p["scatter_jaxpr"], in_avals[1])
    _check_source(in_avals[1], in_avals[0], p)


def _check_select_and_scatter_add(in_avals: Avals, p: Mapping[str, Any]) -> None:
    if len(in_avals) != 2:
        raise BadParam(f"select_and_scatter_add takes source and operand; got {len(in_avals)} inputs")
    _check_source(in_avals[0], in_avals[1], p)


def _check_select_and_gather_add(in_avals: Avals, p: Mapping[str, Any]) -> None:
    if len(in_avals) != 2:
        raise BadParam(f"select_and_gather_add takes tangents and operand; got {len(in_avals)} inputs")
    _match("tangents", in_avals[:1], in_avals[1:])
    _window_shape(in_avals[1], p)


def _check_conv(in_avals: Avals, p: Mapping[str, Any]) -> None:
    # JAX reads the specs as permutations without checking that they are.
    rank = len(in_avals[0].shape) if in_avals else 0
    for name, spec in zip(("lhs_spec", "rhs_spec", "out_spec"), p["dimension_numbers"]):
        if sorted(spec) != list(range(rank)):
            raise BadParam(f"dimension_numbers.{name} {list(spec)} is not a permutation of 0..{rank - 1}")
    for key in ("window_strides", "padding", "lhs_dilation", "rhs_dilation"):
        if len(p[key]) != rank - 2:
            raise BadParam(f"{key} needs one entry per spatial dimension ({rank - 2}), got {len(p[key])}")


def _check_axes(in_avals: Avals, p: Mapping[str, Any]) -> None:
    rank = len(in_avals[0].shape) if in_avals else 0
    axes = p["axes"]
    if len(set(axes)) != len(axes) or any(a >= rank for a in axes):
        raise BadParam(f"axes {list(axes)} must be distinct axes of the rank-{rank} operand")


def _check_sort(in_avals: Avals, p: Mapping[str, Any]) -> None:
    # JAX leaves both to XLA's verifier (or to an assertion while lowering).
    rank = len(in_avals[0].shape) if in_avals else 0
    if p["dimension"] >= rank:
        raise BadParam(f"dimension {p['dimension']} is out of range for operands of rank {rank}")
    if not 1 <= p["num_keys"] <= len(in_avals):
        raise BadParam(f"num_keys must be between 1 and the {len(in_avals)} operands, got {p['num_keys']}")


def _check_linear_solve(in_avals: Avals, p: Mapping[str, Any]) -> None:
    lengths, jaxprs = p["const_lengths"], p["jaxprs"]
    if jaxprs.matvec is None or jaxprs.solve is None:
        raise BadParam("custom_linear_solve needs matvec and solve jaxprs")
    if sum(lengths) > len(in_avals):
        raise BadParam(f"const_lengths add up to {sum(lengths)}, more than the {len(in_avals)} operands")
    for name, n in zip(lengths._fields, lengths):
        jaxpr = getattr(jaxprs, name)
        if jaxpr is None and n:
            raise BadParam(f"const_lengths.{name} is {n} but there is no {name} jaxpr")


# -- params the format fixes to their defaults ------------------------------------------------


def _finalize_jit(p: dict[str, Any], in_avals: Avals) -> dict[str, Any]:
    n_in, n_out = len(in_avals), len(p["jaxpr"].out_avals)
    return dict(p, in_shardings=(UNSPECIFIED,) * n_in, out_shardings=(UNSPECIFIED,) * n_out,
                in_layouts=(None,) * n_in, out_layouts=(None,) * n_out,
                donated_invars=(False,) * n_in, ctx_mesh=mesh_lib.empty_concrete_mesh,
                compiler_options_kvs=())


def _split_consts(*names: tuple[str, str]) -> Finalize:
    # The document nests closed jaxprs; these primitives want an open jaxpr with
    # constvars in one param and the const values in another.
    def finalize(p: dict[str, Any], in_avals: Avals) -> dict[str, Any]:
        p = dict(p)
        for jaxpr_name, consts_name in names:
            closed = p[jaxpr_name]
            p[jaxpr_name] = None if closed is None else closed.jaxpr
            p[consts_name] = () if closed is None else tuple(closed.consts)
        return p
    return finalize


def _finalize_reduce(p: dict[str, Any], in_avals: Avals) -> dict[str, Any]:
    # `computation` (a Python callable) only serves vmap of a traced reduce; the
    # jaxpr is what lowers.
    return dict(p, computation=None)


def _finalize_device_put(p: dict[str, Any], in_avals: Avals) -> dict[str, Any]:
    n = len(in_avals)
    if not len(p["devices"]) == len(p["srcs"]) == len(p["copy_semantics"]) == n:
        raise BadParam(f"devices, srcs and copy_semantics need one entry per operand ({n})")
    return p


_HOOKS: dict[str, tuple[Finalize | None, Check | None]] = {
    "while": (None, _check_while),
    "cond": (None, _check_cond),
    "scan": (None, _check_scan),
    "jit": (_finalize_jit, _check_call),
    "custom_jvp_call": (None, _check_custom_call),
    "custom_vjp_call": (None, _check_custom_call),
    "remat2": (None, _check_call),
    "closed_call": (None, _check_call),
    "call": (None, _check_call),
    "reduce": (_finalize_reduce, _check_reduce),
    "reduce_window": (_split_consts(("jaxpr", "consts")), _check_reduce_window),
    "select_and_scatter": (_split_consts(("select_jaxpr", "select_consts"),
                                         ("scatter_jaxpr", "scatter_consts")),
                           _check_select_and_scatter),
    **{name: (_split_consts(("update_jaxpr", "update_consts")), _check_scatter)
       for name in ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
                    "scatter-max")},
    "select_and_scatter_add": (None, _check_select_and_scatter_add),
    "select_and_gather_add": (None, _check_select_and_gather_add),
    "custom_linear_solve": (None, _check_linear_solve),
    "conv_general_dilated": (None, _check_conv),
    "sort": (None, _check_sort),
    **{f"reduce_{op}": (None, _check_axes) for op in ("sum", "max", "min", "prod", "and", "or", "xor")},
    "device_put": (_finalize_device_put, None),
}

# Primitives that ordinary jax.numpy programs bind but jax.extend does not export.
_EXTRA_PRIMITIVES: tuple[core.Primitive, ...] = (
    prng.random_wrap_p, prng.random_unwrap_p, lax.split_p, lax.stack_p, lax.unstack_p,
    lax.tile_p, lax.optimization_barrier_p, conditionals.platform_index_p,
    linalg.lu_pivots_to_permutation_p, linalg.geqrf_p, slicing.scatter_sub_p,
    random_core.random_clone_p,
)


def _build_specs() -> dict[str, PrimSpec]:
    known = {**public_primitives(), **{p.name: p for p in _EXTRA_PRIMITIVES}}
    schemas = {**{n: _NO_PARAMS for n in _PARAMLESS}, **{n: _ACCURACY for n in _WITH_ACCURACY},
               **_PARAMS}
    specs = {}
    for name, schema in schemas.items():
        if name in known and name not in REFUSED:
            finalize, check = _HOOKS.get(name, (None, None))
            specs[name] = PrimSpec(known[name], schema, finalize, check)
    return specs


SPECS: dict[str, PrimSpec] = _build_specs()
