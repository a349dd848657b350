"""A corpus of JAX programs that jitserve must compile and run exactly like ``jax.jit``.

Each ``Case`` is a function, a deterministic argument builder (a seeded numpy
``Generator``) and the tolerances for comparing floating outputs; integer and
bool outputs are compared exactly. The helpers turn a case into the bytes of
each program format the compiler accepts::

    from tests.corpus import CASES, serialize, flat_args, expected, assert_outputs_match

    case = CASES[0]
    data, fmt = serialize(case, "stablehlo_text")     # fmt is the compiler's format name
    got = run_somewhere(data, fmt, flat_args(case))
    assert_outputs_match(case, got, expected(case))

Decompositions that are unique only up to sign or phase (eigh, eig, svd, schur,
qr, hessenberg) return invariants computed inside the function (sorted
eigenvalues, reconstructions, orthogonality checks), so comparisons stay robust
even if two compiles were to pick different (valid) bases.

Importing this module turns on ``jax_enable_x64``: float64, complex128 and int64
cases need it at trace time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import ml_dtypes
import numpy as np
from jax import lax

jax.config.update("jax_enable_x64", True)

__all__ = [
    "CASES",
    "CASES_BY_NAME",
    "FORMATS",
    "Case",
    "assert_outputs_match",
    "expected",
    "export",
    "flat_args",
    "serialize",
    "specs",
    "stablehlo_bytecode",
    "stablehlo_text",
]

# Test-side format names; ``serialize`` maps them to the compiler's format names.
FORMATS = ("jax_export", "stablehlo_text", "stablehlo_bytecode")
SEED = 20240611

Args = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Case:
    """One corpus program.

    Attributes:
      name: a short unique id (used as the pytest id).
      fn: the function; positional arguments are pytrees of arrays.
      make_args: builds the positional arguments from a seeded generator.
      rtol, atol: tolerances for floating and complex outputs.
    """

    name: str
    fn: Callable[..., Any]
    make_args: Callable[[np.random.Generator], Args]
    rtol: float = 1e-6
    atol: float = 1e-6

    def args(self) -> Args:
        """The case's arguments, the same on every call."""
        return _args(self)


@functools.cache
def _args(case: Case) -> Args:
    return case.make_args(np.random.default_rng(SEED))


# --------------------------------------------------------------------------- helpers


def _normal(rng: np.random.Generator, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """Standard normal samples of ``dtype`` (complex dtypes get both parts)."""
    x = rng.standard_normal(tuple(shape))
    if np.issubdtype(np.dtype(dtype), np.complexfloating):
        x = x + 1j * rng.standard_normal(tuple(shape))
    return np.asarray(x).astype(dtype)


def _spd(rng: np.random.Generator, n: int, dtype: Any = np.float64) -> np.ndarray:
    """A well-conditioned symmetric positive definite matrix."""
    a = rng.standard_normal((n, n))
    return (a @ a.T + n * np.eye(n)).astype(dtype)


def _sym(rng: np.random.Generator, n: int, dtype: Any = np.float64) -> np.ndarray:
    """A symmetric matrix with well-separated eigenvalues."""
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return (q @ np.diag(np.arange(1, n + 1) * 1.5) @ q.T).astype(dtype)


def _sorted_complex(w: jax.Array) -> jax.Array:
    """Eigenvalues in a canonical order (by real part, then imaginary part)."""
    return jnp.sort_complex(w)


# --------------------------------------------------------------------------- programs


def _mlp_loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def mlp_train_step(params, x, y):
    loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)
    new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return loss, grads, new


def _mlp_args(rng: np.random.Generator) -> Args:
    params = {
        "w1": _normal(rng, (4, 16)) * np.float32(0.5),
        "b1": np.zeros(16, np.float32),
        "w2": _normal(rng, (16, 2)) * np.float32(0.25),
        "b2": np.zeros(2, np.float32),
    }
    return params, _normal(rng, (8, 4)), _normal(rng, (8, 2))


def scan_running_stats(xs):
    def step(carry, x):
        total, count = carry
        total = total + x
        return (total, count + 1), total / (count + 1).astype(x.dtype)

    (total, count), means = lax.scan(step, (jnp.zeros_like(xs[0]), jnp.int32(0)), xs)
    return total, count, means


def cond_branch(pred, x):
    return lax.cond(pred > 0, lambda v: jnp.sin(v) * 2.0, lambda v: jnp.cos(v) - 1.0, x)


def cond_both(x):
    """Both branches, so each is exercised by one program."""
    return cond_branch(jnp.int32(1), x), cond_branch(jnp.int32(-1), x)


def while_newton_sqrt(a):
    def cond_fn(state):
        x, i = state
        return (jnp.max(jnp.abs(x * x - a)) > 1e-12) & (i < 100)

    def body(state):
        x, i = state
        return 0.5 * (x + a / x), i + 1

    return lax.while_loop(cond_fn, body, (a, jnp.int32(0)))


def fori_power_iteration(a, v):
    def body(_, v):
        w = a @ v
        return w / jnp.linalg.norm(w)

    v = lax.fori_loop(0, 30, body, v)
    return v @ a @ v, jnp.abs(v)


def conv2d(x, w):
    return lax.conv_general_dilated(
        x, w, window_strides=(1, 2), padding="SAME", rhs_dilation=(2, 1),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )


def gather(x, idx):
    return x[idx], x[:, idx[:2]], jnp.take_along_axis(x[:4], (idx % 4)[:, None], axis=1)


def scatter(x, idx, v):
    return x.at[idx].add(v), x.at[idx].set(v), x.at[idx].max(v)


def sort_ops(x, k):
    return jnp.sort(x, axis=-1), jnp.argsort(x, axis=0, stable=True), lax.sort((k, x[0]), num_keys=1)


def top_k(x):
    return lax.top_k(x, 3)


def cumsum(x, n):
    return jnp.cumsum(x, axis=1), jnp.cumprod(x[:, :3], axis=0), jnp.cumsum(n), lax.cummax(n, axis=0)


def fft(z):
    return jnp.fft.fft(z), jnp.fft.ifft(z, axis=0), jnp.fft.fft2(z)


def rfft(x):
    spec = jnp.fft.rfft(x)
    return spec, jnp.fft.irfft(spec, n=x.shape[-1])


def cholesky(a, b):
    lo = jnp.linalg.cholesky(a)
    return lo, jsl.cho_solve((lo, True), b)


def eigh(a):
    w, v = jnp.linalg.eigh(a)
    return w, (v * w) @ v.T, v.T @ v


def eig(a):
    w, v = jnp.linalg.eig(a)
    recon = (v * w) @ jnp.linalg.inv(v)
    return _sorted_complex(w), jnp.real(recon)


def svd(a):
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    return s, (u * s) @ vh


def qr(a):
    q, r = jnp.linalg.qr(a)
    return q @ r, jnp.abs(r), q.T @ q


def lu(a):
    p, lo, up = jsl.lu(a)
    return p @ lo @ up, jnp.abs(jnp.diag(up))


def triangular_solve(lo, b):
    return jsl.solve_triangular(lo, b, lower=True), jsl.solve_triangular(lo.T, b, lower=False, trans=1)


def tridiagonal_solve(dl, d, du, b):
    return lax.linalg.tridiagonal_solve(dl, d, du, b)


def schur(a):
    t, z = jsl.schur(a)
    return z @ t @ z.T, z.T @ z, jnp.tril(t, -2)


def hessenberg(a):
    h, q = jsl.hessenberg(a, calc_q=True)
    return q @ h @ q.T, jnp.tril(h, -2), q.T @ q


def random_from_seed(seed):
    key = jax.random.key(seed)
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (4, 3)), jax.random.randint(k2, (5,), 0, 100)


def random_from_key_data(key_data):
    key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    k1, k2 = jax.random.split(key)
    return (jax.random.uniform(k1, (3, 3), dtype=jnp.float64),
            jax.random.bernoulli(k2, 0.3, (6,)), jax.random.key_data(k2))


def einsum(a, b, c):
    return jnp.einsum("bij,bjk->bik", a, b), jnp.einsum("ij,ij->i", c, c), jnp.einsum("bii->b", a)


def float64_math(x):
    return (jnp.exp(x), jnp.log1p(jnp.abs(x)), jnp.tanh(x), jax.scipy.special.erf(x),
            jnp.arctan2(x, 1.0 + x * x), jax.nn.logsumexp(x), x @ x.T)


def complex128_math(z, w):
    return jnp.exp(z), jnp.abs(z), jnp.angle(z), z @ jnp.conj(w).T, jnp.sqrt(z) * w


def bfloat16_ops(x, w):
    y = jax.nn.relu(x @ w)
    return y, y.astype(jnp.float32).sum(), (x * 2 + 1).astype(jnp.bfloat16)


def float16_ops(x):
    return x * x - 1, jnp.max(x, axis=0)


def integer_ops(a, b, c, d, e):
    return (a * 3 - b.astype(jnp.int8), (b << 2) ^ (b >> 1), c // 7, c % 7, jnp.abs(c),
            d + d.max(), e * 2 + 1, (c.astype(jnp.int64) * 1_000_000_007) % 998_244_353)


def bool_ops(p, q, x):
    return p & q, p | ~q, p ^ q, jnp.any(p), jnp.all(q, axis=0), jnp.where(p, x, -x), x > 0


def pytree_io(tree, pair):
    a, (b, c) = pair
    return {"sum": tree["x"] + tree["y"]["z"], "nested": {"prod": (a * b, [c, c + 1])}, "n": tree["n"] * 2}


def scalars(x, n, flag):
    return x * 2.0, n + 1, jnp.logical_not(flag), jnp.where(flag, x, -x), jnp.float32(3.5)


def zero_size(x, y, z):
    return (x.sum(axis=0), x * 2, jnp.concatenate([z, z], axis=0), y.T, jnp.zeros((0,), jnp.int32),
            z.max(initial=0.0))


def softmax_reductions(x):
    return jax.nn.softmax(x, axis=-1), jnp.argmax(x, axis=-1), jnp.var(x, axis=0), jnp.prod(x[:2], axis=1)


def dot_precision(a, b):
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST), lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float64)


def shape_manipulation(x):
    return (x.reshape(6, 4).T, jnp.transpose(x, (2, 0, 1)), jnp.pad(x, ((1, 0), (0, 2), (1, 1))),
            lax.dynamic_slice(x, (0, 1, 1), (2, 2, 2)), jnp.flip(x, 1), jnp.tile(x[0], (2, 1)),
            lax.rev(x, (0,)), jnp.roll(x, 1, axis=2))


def _nested_loops(x):
    def outer(i, acc):
        def inner(j, a):
            return lax.cond(j % 2 == 0, lambda v: v + j, lambda v: v * 1.01, a)

        return lax.fori_loop(0, 3, inner, acc) + i

    return lax.fori_loop(0, 4, outer, x)


def nested_control_flow(x):
    return _nested_loops(x), jax.vmap(_nested_loops)(x.reshape(2, -1))


def vmap_grad(w, xs):
    def f(w, x):
        return jnp.sin(x @ w).sum()

    return jax.vmap(jax.grad(f), in_axes=(None, 0))(w, xs)


def custom_jvp_softplus(x):
    return jax.grad(lambda v: jax.nn.softplus(v).sum())(x), jax.nn.gelu(x)


# --------------------------------------------------------------------------- the corpus

_f32 = np.float32
_f64 = np.float64

CASES: tuple[Case, ...] = (
    Case("mlp_train_step", mlp_train_step, _mlp_args, rtol=1e-5, atol=1e-6),
    Case("scan", scan_running_stats, lambda r: (_normal(r, (6, 3)),)),
    Case("cond", cond_both, lambda r: (_normal(r, (5,)),)),
    Case("cond_pred_input", cond_branch, lambda r: (np.int32(1), _normal(r, (5,), _f64))),
    Case("while_loop", while_newton_sqrt, lambda r: (r.uniform(0.5, 4.0, (4,)),), rtol=1e-12),
    Case("fori_loop", fori_power_iteration, lambda r: (_sym(r, 5), np.ones(5)), rtol=1e-10, atol=1e-10),
    Case("conv", conv2d, lambda r: (_normal(r, (2, 8, 8, 3)), _normal(r, (3, 3, 3, 4))),
         rtol=1e-5, atol=1e-5),
    Case("gather", gather, lambda r: (_normal(r, (6, 4)), np.array([5, 0, 2, 2], np.int32))),
    Case("scatter", scatter,
         lambda r: (_normal(r, (6, 3)), np.array([1, 4, 1], np.int32), _normal(r, (3, 3)))),
    Case("sort", sort_ops, lambda r: (_normal(r, (4, 7)), r.integers(0, 3, 7).astype(np.int32))),
    Case("top_k", top_k, lambda r: (_normal(r, (3, 9)),)),
    Case("cumsum", cumsum, lambda r: (_normal(r, (4, 5), _f64), r.integers(-9, 9, (6,)).astype(np.int64))),
    Case("fft", fft, lambda r: (_normal(r, (4, 8), np.complex128),), rtol=1e-12, atol=1e-12),
    Case("rfft", rfft, lambda r: (_normal(r, (3, 16)),), rtol=1e-5, atol=1e-5),
    Case("cholesky", cholesky, lambda r: (_spd(r, 5), _normal(r, (5, 2), _f64)), rtol=1e-10, atol=1e-12),
    Case("eigh", eigh, lambda r: (_sym(r, 5),), rtol=1e-10, atol=1e-10),
    Case("eig", eig, lambda r: (_normal(r, (4, 4), _f64),), rtol=1e-9, atol=1e-9),
    Case("svd", svd, lambda r: (_normal(r, (5, 3), _f64),), rtol=1e-10, atol=1e-10),
    Case("qr", qr, lambda r: (_normal(r, (5, 4), _f64),), rtol=1e-10, atol=1e-10),
    Case("lu", lu, lambda r: (_normal(r, (5, 5), _f64),), rtol=1e-10, atol=1e-10),
    Case("triangular_solve", triangular_solve,
         lambda r: (np.tril(_normal(r, (4, 4), _f64)) + 4 * np.eye(4), _normal(r, (4, 3), _f64)),
         rtol=1e-12, atol=1e-12),
    Case("tridiagonal_solve", tridiagonal_solve,
         lambda r: (np.concatenate([[0.0], r.uniform(-1, 1, 5)]), r.uniform(4, 5, 6),
                    np.concatenate([r.uniform(-1, 1, 5), [0.0]]), _normal(r, (6, 2), _f64)),
         rtol=1e-12, atol=1e-12),
    Case("schur", schur, lambda r: (_normal(r, (4, 4), _f64),), rtol=1e-10, atol=1e-10),
    Case("hessenberg", hessenberg, lambda r: (_normal(r, (5, 5), _f64),), rtol=1e-10, atol=1e-10),
    Case("random_seed", random_from_seed, lambda r: (np.uint32(1234),)),
    Case("random_key_data", random_from_key_data, lambda r: (np.array([7, 42], np.uint32),)),
    Case("einsum", einsum,
         lambda r: (_normal(r, (2, 3, 3)), _normal(r, (2, 3, 4)), _normal(r, (5, 6))), rtol=1e-5, atol=1e-6),
    Case("float64_math", float64_math, lambda r: (_normal(r, (3, 4), _f64),), rtol=1e-13, atol=1e-13),
    Case("complex128_math", complex128_math,
         lambda r: (_normal(r, (3, 3), np.complex128), _normal(r, (3, 3), np.complex128)),
         rtol=1e-13, atol=1e-13),
    Case("bfloat16", bfloat16_ops,
         lambda r: (_normal(r, (4, 8), ml_dtypes.bfloat16), _normal(r, (8, 3), ml_dtypes.bfloat16)),
         rtol=1e-2, atol=1e-2),
    Case("float16", float16_ops, lambda r: (_normal(r, (3, 5), np.float16),), rtol=1e-3, atol=1e-3),
    Case("integers", integer_ops,
         lambda r: (r.integers(-40, 40, 6).astype(np.int8), r.integers(0, 900, 6).astype(np.int16),
                    r.integers(-10**6, 10**6, 6).astype(np.int32), r.integers(0, 2**40, 6).astype(np.uint64),
                    r.integers(0, 255, 6).astype(np.uint8))),
    Case("bools", bool_ops,
         lambda r: (r.random((3, 4)) > 0.5, r.random((3, 4)) > 0.3, _normal(r, (3, 4)))),
    Case("pytrees", pytree_io,
         lambda r: ({"x": _normal(r, (3,)), "y": {"z": _normal(r, (3,))}, "n": np.int32(4)},
                    (_normal(r, (2,)), (_normal(r, (2,)), np.arange(3, dtype=np.int64))))),
    Case("scalars", scalars, lambda r: (np.float32(1.5), np.int64(41), np.bool_(True))),
    Case("zero_size", zero_size,
         lambda r: (np.zeros((0, 3), np.float32), np.zeros((4, 0), np.int32), np.zeros((0,), np.float64))),
    Case("softmax_reductions", softmax_reductions, lambda r: (_normal(r, (4, 6)),), rtol=1e-5, atol=1e-6),
    Case("dot_precision", dot_precision, lambda r: (_normal(r, (3, 5)), _normal(r, (5, 2))), rtol=1e-5),
    Case("shape_manipulation", shape_manipulation, lambda r: (_normal(r, (2, 3, 4)),)),
    Case("nested_control_flow", nested_control_flow, lambda r: (_normal(r, (6,)),), rtol=1e-5),
    Case("vmap_grad", vmap_grad, lambda r: (_normal(r, (4, 3)), _normal(r, (5, 4))), rtol=1e-5, atol=1e-6),
    Case("custom_jvp", custom_jvp_softplus, lambda r: (_normal(r, (7,), _f64),), rtol=1e-13, atol=1e-13),
)

CASES_BY_NAME: dict[str, Case] = {c.name: c for c in CASES}
assert len(CASES_BY_NAME) == len(CASES), "corpus case names must be unique"


# --------------------------------------------------------------------------- serialization


def specs(case: Case) -> Args:
    """``jax.ShapeDtypeStruct`` pytrees matching the case's arguments."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), case.args())


def flat_args(case: Case) -> list[np.ndarray]:
    """The flat input leaves, as numpy arrays, in the order programs take them."""
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(case.args())]


@functools.cache
def export(case: Case) -> jax.export.Exported:
    """The case exported for this host's platform with static shapes."""
    return jax.export.export(jax.jit(case.fn))(*specs(case))


def _lowered(case: Case) -> Any:
    # keep_unused: raw StableHLO's @main must take every flat leaf, used or not.
    return jax.jit(case.fn, keep_unused=True).lower(*specs(case))


def stablehlo_text(case: Case) -> bytes:
    """Raw StableHLO (MLIR text) of the case, taking and returning flat leaves."""
    return _lowered(case).as_text().encode()


def stablehlo_bytecode(case: Case) -> bytes:
    """The same module as MLIR bytecode."""
    from jax._src.interpreters import mlir

    return mlir.module_to_bytecode(_lowered(case).compiler_ir("stablehlo"))


@functools.cache
def serialize(case: Case, fmt: str) -> tuple[bytes, str]:
    """The case as ``fmt`` (one of ``FORMATS``): ``(data, compiler format name)``."""
    if fmt == "jax_export":
        return bytes(export(case).serialize()), "jax_export"
    if fmt == "stablehlo_text":
        return stablehlo_text(case), "stablehlo"
    if fmt == "stablehlo_bytecode":
        return stablehlo_bytecode(case), "stablehlo"
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


# --------------------------------------------------------------------------- checking


@functools.cache
def _expected(case: Case) -> tuple[np.ndarray, ...]:
    out = jax.jit(case.fn)(*case.args())
    return tuple(np.asarray(x) for x in jax.tree_util.tree_leaves(out))


def expected(case: Case) -> list[np.ndarray]:
    """The flat output leaves of local ``jax.jit(case.fn)``, computed once per case."""
    return list(_expected(case))


def _comparable(x: np.ndarray) -> np.ndarray:
    """numpy's allclose does not know bfloat16 or float8: widen small floats."""
    if x.dtype.kind == "V" or x.dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        return x.astype(np.float32)
    return x


def assert_outputs_match(case: Case, got: Sequence[Any], want: Sequence[np.ndarray]) -> None:
    """Compare flat output leaves: shapes and dtypes exactly, values within the case's
    tolerances (floats, complex) or exactly (ints, bools)."""
    assert len(got) == len(want), f"{case.name}: {len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        where = f"{case.name} output {i}"
        assert g.shape == w.shape, f"{where}: shape {g.shape}, expected {w.shape}"
        assert g.dtype == w.dtype, f"{where}: dtype {g.dtype}, expected {w.dtype}"
        if np.issubdtype(w.dtype, np.inexact) or w.dtype == np.dtype(ml_dtypes.bfloat16):
            np.testing.assert_allclose(_comparable(g), _comparable(w), rtol=case.rtol, atol=case.atol,
                                       err_msg=where)
        else:
            np.testing.assert_array_equal(g, w, err_msg=where)
