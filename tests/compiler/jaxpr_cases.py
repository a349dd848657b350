"""A corpus of functions for the jaxpr format's round-trip tests and coverage script.

Each case is a function and example arguments built from a fixed seed, so that
``jax.jit(fn)(*args)`` and the decoded document give comparable numbers. The
corpus is meant to touch every primitive family the format carries; the coverage
script (``bench/jaxpr_coverage.py``) reports which primitives it reaches.

Cases need ``jax_enable_x64`` (some use float64/int64 inputs); callers turn it on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Case", "all_cases", "case_args"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One corpus entry.

    Attributes:
      name: a test id.
      fn: the function; takes arrays (and pytrees of them), returns a pytree.
      make_args: builds the example arguments (numpy arrays) from a numpy Generator.
      rtol: the tolerance the round trip is held to (0: bitwise equal).
    """

    name: str
    fn: Callable[..., Any]
    make_args: Callable[[np.random.Generator], tuple[Any, ...]]
    rtol: float = 0.0


def case_args(case: Case) -> tuple[Any, ...]:
    """The example arguments of ``case``, the same on every call."""
    seed = int.from_bytes(case.name.encode()[:8].ljust(8, b"\0"), "little")
    return case.make_args(np.random.default_rng(seed))


def _f32(*shape: int) -> Callable[[np.random.Generator], np.ndarray]:
    return lambda r: r.standard_normal(shape).astype(np.float32)


def _args(*makers: Callable[[np.random.Generator], Any]) -> Callable[[np.random.Generator], tuple]:
    return lambda r: tuple(m(r) for m in makers)


def _spd(n: int, dtype: Any = np.float64) -> Callable[[np.random.Generator], np.ndarray]:
    def make(r: np.random.Generator) -> np.ndarray:
        a = r.standard_normal((n, n))
        return (a @ a.T + n * np.eye(n)).astype(dtype)
    return make


def _ints(lo: int, hi: int, *shape: int, dtype: Any = np.int32) -> Callable:
    return lambda r: r.integers(lo, hi, shape).astype(dtype)


def _build() -> list[Case]:
    # jax is imported here so that importing this module stays cheap.
    import jax
    import jax.numpy as jnp
    from jax import lax

    cases: list[Case] = []

    def add(name: str, make_args: Callable, rtol: float = 0.0) -> Callable:
        def register(fn: Callable) -> Callable:
            cases.append(Case(name, fn, make_args, rtol))
            return fn
        return register

    # -- elementwise math, comparisons, bitwise --------------------------------
    @add("unary_math", _args(_f32(4, 5)))
    def _(x):
        y = jnp.abs(x) + 0.5
        return [jnp.sin(x), jnp.cos(x), jnp.tan(x), jnp.tanh(x), jnp.exp(x),
                jnp.exp2(x), jnp.expm1(x), jnp.log(y), jnp.log1p(y), jnp.sqrt(y),
                lax.rsqrt(y), jnp.cbrt(x), jnp.floor(x), jnp.ceil(x), jnp.round(x),
                jnp.sign(x), -x, jnp.arcsin(x / 4), jnp.arccos(x / 4), jnp.arctan(x),
                jnp.sinh(x), jnp.cosh(x), jnp.arcsinh(x), jnp.arccosh(y + 1),
                jnp.arctanh(x / 4), jax.nn.sigmoid(x), jnp.square(x),
                jnp.isfinite(x / (x - x)), lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)]

    @add("binary_math", _args(_f32(3, 4), _f32(3, 4)))
    def _(x, y):
        return [x + y, x - y, x * y, x / y, jnp.maximum(x, y), jnp.minimum(x, y),
                jnp.arctan2(x, y), jnp.power(jnp.abs(x), y), jnp.remainder(x, y),
                lax.rem(x, y), jnp.nextafter(x, y), lax.pow(x, 3)]

    @add("special_functions", _args(lambda r: r.uniform(0.1, 3.0, (6,))), rtol=1e-12)
    def _(x):
        from jax.scipy import special
        return [special.erf(x), special.erfc(x), special.erfinv(x / 4), special.gammaln(x),
                special.digamma(x), special.i0e(x), special.i1e(x),
                special.gammainc(x, x + 1), special.gammaincc(x, x + 1),
                special.betainc(x, x + 1, x / 4), special.zeta(x + 1, x),
                special.polygamma(1, x)]

    @add("complex_math",
         _args(lambda r: (r.standard_normal(5) + 1j * r.standard_normal(5)).astype(np.complex64)))
    def _(z):
        return [jnp.real(z), jnp.imag(z), jnp.conj(z), jnp.abs(z), lax.complex(jnp.real(z), jnp.imag(z)),
                jnp.exp(z), z * z]

    @add("comparisons", _args(_f32(6), _f32(6)))
    def _(x, y):
        return [x < y, x <= y, x > y, x >= y, x == y, x != y,
                jnp.where(x > 0, x, y), jnp.clip(x, -0.5, 0.5),
                lax.clamp(np.float32(-0.2), x, np.float32(0.3))]

    @add("bitwise", _args(_ints(-1000, 1000, 8), _ints(0, 31, 8)))
    def _(a, s):
        u = a.astype(jnp.uint32)
        return [a & s, a | s, a ^ s, ~a, lax.shift_left(a, s), lax.shift_right_arithmetic(a, s),
                lax.shift_right_logical(u, s.astype(jnp.uint32)), lax.population_count(a),
                lax.clz(a), jnp.logical_not(a > 0), (a > 0) & (s > 3),
                lax.bitcast_convert_type(a, jnp.float32)]

    @add("integer_pow_and_select", _args(_f32(5), _ints(0, 3, 5)))
    def _(x, i):
        return [x ** 2, x ** 3, x ** -2, lax.integer_pow(x, 5),
                lax.select_n(i, x, -x, 2 * x), lax.select(x > 0, x, 0 * x)]

    @add("convert_and_reduce_precision", _args(lambda r: r.standard_normal(7)))
    def _(x):
        return [x.astype(jnp.float32), x.astype(jnp.int32), x.astype(jnp.bfloat16),
                x.astype(jnp.float16).astype(jnp.float64), x.astype(jnp.complex128),
                lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10), (x > 0).astype(jnp.int8)]

    # -- shapes ------------------------------------------------------------------
    @add("iota_pad_reshape", _args(_f32(2, 3)))
    def _(x):
        return [jnp.arange(6).reshape(2, 3) + x, lax.iota(jnp.int32, 5),
                lax.broadcasted_iota(jnp.float32, (2, 3), 1),
                jnp.pad(x, ((1, 2), (0, 1))), lax.pad(x, np.float32(9), ((1, -1, 1), (0, 0, 2))),
                x.reshape(3, 2), x.T, jnp.flip(x, 0), jnp.flip(x), x[None, :, None].squeeze(),
                jnp.broadcast_to(x[:, :1], (2, 5)), jnp.concatenate([x, x], 1),
                jnp.expand_dims(x, 1), jnp.tile(x, (2, 1)), jnp.stack([x, x]),
                jnp.split(jnp.arange(6.0), 3)[1]]

    @add("slicing", _args(_f32(6, 5), _ints(0, 4, 1)))
    def _(x, i):
        k = i[0]
        return [x[1:4, ::2], x[::-1], lax.dynamic_slice(x, (k, k), (2, 3)),
                lax.dynamic_update_slice(x, jnp.ones((2, 2), x.dtype), (k, k)),
                lax.dynamic_slice_in_dim(x, k, 2, axis=1), x[k], x.at[k].set(0.0),
                lax.slice(x, (0, 1), (5, 5), (2, 3))]

    @add("gather_scatter", _args(_f32(5, 4), _ints(0, 5, 3), _f32(3, 4)))
    def _(x, idx, upd):
        return [x[idx], x[idx, 1:3], jnp.take(x, idx, axis=0, mode="clip"),
                jnp.take(x, idx, axis=0, mode="fill", fill_value=-1.0),
                x.at[idx].set(upd), x.at[idx].add(upd), x.at[idx].mul(upd),
                x.at[idx].min(upd), x.at[idx].max(upd), x.at[idx, 2].get(mode="clip"),
                x.at[idx].add(upd, mode="drop", indices_are_sorted=True),
                jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1)]

    @add("batched_gather", _args(_f32(3, 5, 2), _ints(0, 5, 3, 2)))
    def _(x, idx):
        return jax.vmap(lambda a, i: a[i])(x, idx)

    # -- reductions, cumulative, sorting ------------------------------------------
    @add("reductions", _args(_f32(4, 6), _ints(-5, 5, 4, 6)))
    def _(x, a):
        b = a > 0
        return [x.sum(), x.sum(0), x.max(1), x.min(), x.prod(0), jnp.argmax(x, 1),
                jnp.argmin(x, 0), b.all(1), b.any(0), a.sum(1), jnp.bitwise_xor.reduce(a, axis=0),
                jax.nn.logsumexp(x, axis=1), jnp.mean(x), jnp.var(x, 0),
                lax.reduce((x, a), (np.float32(0), np.int32(0)),
                           lambda p, q: (p[0] + q[0], jnp.maximum(p[1], q[1])), (1,))]

    @add("windowed_reductions", _args(_f32(1, 6, 6, 2)))
    def _(x):
        win, st = (1, 2, 2, 1), (1, 2, 2, 1)
        f32 = np.float32
        return [lax.reduce_window(x, f32(-np.inf), lax.max, win, st, "VALID"),
                lax.reduce_window(x, f32(np.inf), lax.min, win, (1, 1, 1, 1), "SAME"),
                lax.reduce_window(x, f32(0), lax.add, win, st, "VALID"),
                lax.reduce_window(x, f32(1), lax.mul, win, st, "VALID"),
                jax.grad(lambda v: lax.reduce_window(v, f32(-np.inf), lax.max, win, st,
                                                     "VALID").sum())(x)]

    @add("cumulative", _args(_f32(4, 5)))
    def _(x):
        return [jnp.cumsum(x, 1), jnp.cumprod(x, 0), lax.cummax(x, 1), lax.cummin(x, 0, reverse=True),
                lax.cumlogsumexp(x, 1)]

    @add("sort_top_k", _args(_f32(4, 7), _ints(0, 9, 4, 7)))
    def _(x, k):
        return [jnp.sort(x, 1), jnp.argsort(x, 0), lax.sort((k, x), num_keys=2),
                lax.top_k(x, 3)[0], lax.top_k(x, 3)[1], jnp.median(x, 1)]

    # -- linear algebra, conv, fft -------------------------------------------------
    @add("dot_general_precision", _args(_f32(3, 4, 5), _f32(3, 5, 2)), rtol=1e-6)
    def _(a, b):
        return [jnp.matmul(a, b, precision=lax.Precision.HIGHEST),
                jnp.einsum("bij,bjk->bik", a, b, precision="high"),
                lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))),
                                preferred_element_type=jnp.float64),
                jnp.tensordot(a, b, ((0, 2), (0, 1))), a[0] @ b[0]]

    @add("conv", _args(_f32(2, 3, 9, 9), _f32(4, 3, 3, 3)), rtol=1e-6)
    def _(x, w):
        return [lax.conv(x, w, (1, 1), "SAME"),
                lax.conv_general_dilated(x, w, (2, 1), ((1, 1), (0, 2)), lhs_dilation=(1, 2),
                                         rhs_dilation=(2, 1), precision=lax.Precision.HIGHEST),
                lax.conv_general_dilated(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), (1, 1),
                                         "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")),
                lax.conv_general_dilated(x, jnp.concatenate([w[:, :1]] * 3, 0), (1, 1), "VALID",
                                         feature_group_count=3)]

    @add("fft", _args(_f32(4, 8)), rtol=1e-5)
    def _(x):
        return [jnp.fft.fft(x), jnp.fft.ifft(x.astype(jnp.complex64)), jnp.fft.rfft(x),
                jnp.fft.irfft(jnp.fft.rfft(x)), jnp.fft.fft2(x)]

    @add("linalg", _args(_spd(4), lambda r: r.standard_normal((4, 3))), rtol=1e-9)
    def _(a, b):
        w, v = jnp.linalg.eigh(a)
        u, s, vt = jnp.linalg.svd(b, full_matrices=False)
        q, r = jnp.linalg.qr(b)
        p, lo, up = jax.scipy.linalg.lu(a)
        c = jnp.linalg.cholesky(a)
        return [w, jnp.abs(v), s, jnp.abs(u @ vt), jnp.abs(q), jnp.abs(r), p, lo, up, c,
                jax.scipy.linalg.solve_triangular(c, b, lower=True),
                jnp.linalg.solve(a, b), jnp.linalg.inv(a), jnp.linalg.det(a),
                jnp.linalg.slogdet(a)[1], jax.scipy.linalg.cho_solve((c, True), b)]

    @add("linalg_extra", _args(_spd(4), lambda r: r.standard_normal(4)), rtol=1e-9)
    def _(a, d):
        from jax.lax import linalg
        h, taus = linalg.hessenberg(a)
        dl = jnp.concatenate([jnp.zeros(1), d[1:] * 0.1])
        du = jnp.concatenate([d[:-1] * 0.1, jnp.zeros(1)])
        return [linalg.tridiagonal_solve(dl, d + 4, du, a[:, :2]),
                h, taus, jnp.linalg.eigvalsh(a), jnp.linalg.pinv(a), jnp.linalg.matrix_rank(a)]

    # -- random --------------------------------------------------------------------
    @add("random_typed_keys", _args(_ints(0, 100, 1, dtype=np.int64)))
    def _(seed):
        k = jax.random.key(seed[0])
        k1, k2 = jax.random.split(k)
        return [jax.random.normal(k1, (3,)), jax.random.uniform(jax.random.fold_in(k2, 7), (2, 2)),
                jax.random.bits(k1, (4,), jnp.uint32), jax.random.randint(k2, (3,), 0, 10),
                jax.random.key_data(k2)]

    @add("random_raw_keys", _args(_ints(0, 100, 1, dtype=np.int64)))
    def _(seed):
        k = jax.random.PRNGKey(seed[0])
        return [jax.random.normal(k, (4,)), jax.random.bernoulli(k, 0.3, (5,)),
                jax.random.permutation(k, 6), jax.random.gamma(k, 2.0, (3,)),
                jax.random.split(k, 3), jax.random.categorical(k, jnp.zeros((2, 4)))]

    @add("rng_bit_generator", _args(lambda r: np.array([1, 2, 3, 4], np.uint32)))
    def _(key):
        return lax.rng_bit_generator(key, (3, 2), dtype=jnp.uint32)

    # -- control flow ----------------------------------------------------------------
    @add("while_cond_scan", _args(_f32(4), _ints(0, 3, 1)))
    def _(x, i):
        def body(c):
            n, v = c
            return n + 1, v * 1.5 + jnp.sin(v)
        w = lax.while_loop(lambda c: c[0] < 5, body, (0, x))
        c = lax.cond(x.sum() > 0, lambda v: v * 2, lambda v: v - 1, x)
        s = lax.switch(i[0], [jnp.sin, jnp.cos, jnp.tanh], x)
        carry, ys = lax.scan(lambda c, v: (c + v, c * v), 0.0, x)
        r = lax.scan(lambda c, v: (c * 0.5 + v, None), x, jnp.ones((3, 4), x.dtype), reverse=True)[0]
        f = lax.fori_loop(0, i[0] + 2, lambda j, v: v + j, x)
        m = lax.map(lambda v: v ** 2, x)
        return [w[0], w[1], c, s, carry, ys, r, f, m]

    @add("nested_jit_and_calls", _args(_f32(3, 3)))
    def _(x):
        from jax import ad_checkpoint

        @jax.jit
        def inner(y):
            return jnp.tanh(y) @ y

        @functools.partial(jax.jit, inline=True)
        def inlined(y):
            return y + 1.0

        @jax.checkpoint
        def remat(y):
            return jnp.sin(jnp.sin(y))

        named = jax.named_call(lambda y: y * 3, name="triple")
        return [inner(inner(x)), inlined(x), remat(x), named(x), lax.stop_gradient(x),
                ad_checkpoint.checkpoint_name(x * 2, "saved"), lax.optimization_barrier(x)]

    @add("custom_derivatives", _args(_f32(4, 3)))
    def _(x):
        @jax.custom_vjp
        def clip_grad(y):
            return y * 2

        clip_grad.defvjp(lambda y: (y * 2, None), lambda _, g: (jnp.clip(g, -1, 1),))
        return [jax.nn.relu(x), jax.nn.softplus(x), jax.nn.gelu(x), jax.nn.silu(x),
                jax.nn.log_softmax(x, axis=1), jax.nn.softmax(x), clip_grad(x),
                jax.numpy.linalg.norm(x, axis=1)]

    @add("custom_linear_solve", _args(_spd(3), lambda r: r.standard_normal(3)), rtol=1e-9)
    def _(a, b):
        return jax.scipy.sparse.linalg.cg(lambda v: a @ v, b, maxiter=20)[0]

    @add("mlp_value_and_grad_step", lambda r: (
        {"w1": r.standard_normal((4, 8)).astype(np.float32) * 0.3, "b1": np.zeros(8, np.float32),
         "w2": r.standard_normal((8, 2)).astype(np.float32) * 0.3, "b2": np.zeros(2, np.float32)},
        r.standard_normal((16, 4)).astype(np.float32), r.integers(0, 2, 16).astype(np.int32)),
        rtol=1e-6)
    def _(params, x, y):
        def loss(p):
            h = jax.nn.relu(x @ p["w1"] + p["b1"])
            logits = h @ p["w2"] + p["b2"]
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    @add("grad_through_control_flow", _args(_f32(5)), rtol=1e-6)
    def _(x):
        def f(v):
            v = lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * 1.1, v)
            return lax.cond(v.sum() > 0, jnp.sum, lambda u: jnp.sum(u ** 2), v)
        return jax.grad(f)(x), jax.jacfwd(lambda v: jnp.cumsum(jnp.tanh(v)))(x)

    # -- the rest of the allowlist, reached through less common APIs -----------------------
    @add("approx_top_k_and_misc", _args(_f32(3, 16), _f32(3, 16)))
    def _(x, y):
        from jax._src.lax import lax as lax_internal
        from jax.extend.random import threefry_2x32
        bits = threefry_2x32(np.array([7, 9], np.uint32), jnp.arange(8, dtype=jnp.uint32))
        return [lax.approx_max_k(x, 3)[0], lax.approx_min_k(x, 2)[1], bits,
                lax_internal.eq_to_p.bind(x, y), lax_internal.lt_to_p.bind(x, y),
                lax_internal.le_to_p.bind(x, y), *jnp.unstack(x[:2]),
                x.at[jnp.array([0, 2])].subtract(1.0)]

    @add("windowed_derivatives", _args(_f32(8), _f32(8), _f32(4)))
    def _(x, t, s):
        from jax._src.lax.windowed_reductions import _select_and_scatter

        def pool(v):
            return lax.reduce_window(v, np.float32(-np.inf), lax.max, (2,), (2,), "VALID")

        return [jax.jvp(pool, (x,), (t,))[1],
                _select_and_scatter(x, lax.ge, (2,), (2,), ((0, 0),), s, np.float32(0), lax.add)]

    @add("linalg_qr_parts", _args(lambda r: r.standard_normal((4, 3)), _spd(4)), rtol=1e-9)
    def _(a, s):
        from jax._src.lax import linalg
        qr, taus = linalg.geqrf(a)
        arr, d, e, tau = linalg.tridiagonal(s)
        _, pivots, _ = linalg.lu(s)
        return [qr, linalg.householder_product(qr, taus), arr, d, e, tau,
                linalg.lu_pivots_to_permutation(pivots, 4)]

    @add("special_gradients", _args(lambda r: r.uniform(0.5, 3.0, (5,))), rtol=1e-12)
    def _(a):
        from jax.scipy import special
        k = jax.random.key(3)
        return [jax.grad(lambda v: special.gammainc(v, 2.0).sum())(a),
                jax.random.key_data(jax.random.clone(k)),
                jax.grad(lambda v: jax.random.gamma(k, v).sum())(a)]

    @add("calls", _args(_f32(3)))
    def _(x):
        from jax._src import core as jcore
        inner = jax.make_jaxpr(lambda v: jnp.cos(v) + 1)(x)
        closed = jcore.closed_call_p
        call = jcore.call_p
        return [*closed.bind(x, **closed.get_bind_params({"call_jaxpr": inner})),
                *call.bind(x, **call.get_bind_params({"call_jaxpr": inner.jaxpr}))]

    if jax.default_backend() == "cpu":  # LAPACK-only decompositions
        @add("linalg_cpu_only", _args(_spd(4)), rtol=1e-9)
        def _(a):
            w, v = jnp.linalg.eig(a)
            t, z = jax.scipy.linalg.schur(a)
            return [jnp.sort(jnp.real(w)), jnp.abs(jnp.real(v)).sum(0), jnp.abs(t), jnp.abs(z)]

    return cases


@functools.cache
def all_cases() -> tuple[Case, ...]:
    """Every corpus case (built on first use, so importing traces nothing)."""
    return tuple(_build())
