"""Tracing without a server: flat programs of any pytree, typed keys, host callbacks refused.

Each program is run here (``jax.export.deserialize(...).call``, or the jaxpr
decoder's function) on the flat leaves a call would send, and its flat outputs are
put back in the tree the client kept, as ``RemoteFunction`` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from client_fakes import server_decoder

from jitserve.client import HostCallbackError
from jitserve.client._jit import _donated_leaves
from jitserve.client._trace import Compiled, check_host_callbacks, local_input, split_key, trace

pytestmark = pytest.mark.timeout(120)

FORMATS = ("jax_export", "jaxpr")


class Pair(NamedTuple):
    a: Any
    b: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: Any
    b: Any
    scale: float = dataclasses.field(default=1.0, metadata={"static": True})


class Box:
    """A custom pytree node that jax.export could not serialize."""

    def __init__(self, inner: Any, tag: str) -> None:
        self.inner, self.tag = inner, tag


jax.tree_util.register_pytree_node(Box, lambda b: ((b.inner,), b.tag), lambda tag, c: Box(c[0], tag))


def run(fn: Any, *args: Any, format: str) -> tuple[Any, Compiled]:
    """Trace ``fn`` on ``args`` as a call would, run the program here, rebuild its outputs."""
    leaves, in_tree = jax.tree.flatten((args, {}))
    inputs = [local_input(leaf) for leaf in leaves]
    compiled = trace(lambda *a: fn(*a), "fn", in_tree, [s for _, s, _ in inputs],
                     [k.impl if k else None for _, _, k in inputs], format=format,
                     platforms=("cpu",))
    values = [v for v, _, _ in inputs]
    if format == "jaxpr":
        decoded = server_decoder()(compiled.program)
        outs = jax.jit(decoded.as_function(), keep_unused=True)(*values)
    else:
        outs = jax.export.deserialize(bytearray(compiled.program)).call(*values)
    outs = [k.wrap(o) if k else o for o, k in zip(outs, compiled.out_keys)]
    return jax.tree.unflatten(compiled.out_tree, outs), compiled


def assert_trees_close(got: Any, want: Any) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


X = np.arange(6, dtype=np.float32).reshape(2, 3)

TREES = {
    "namedtuple": (lambda p: Pair(p.b, p.a * 2), (Pair(X, X[0]),)),
    "dataclass": (lambda p: Params(p.w * p.scale, p.b + 1, p.scale), (Params(X, X[0], 3.0),)),
    "custom node": (lambda b: Box(b.inner.sum(), b.tag + "!"), (Box(X, "t"),)),
    "none leaves": (lambda t: {"y": t["x"] * 2, "z": None, "w": (None, t["x"][0])},
                    ({"x": X, "z": None},)),
    "no outputs": (lambda x: None, (X,)),
    "python scalars": (lambda x, s: (x * s, s), (X, 2.0)),
}


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("case", TREES, ids=list(TREES))
def test_any_pytree_in_and_out(case: str, format: str) -> None:
    fn, args = TREES[case]
    got, compiled = run(fn, *args, format=format)
    assert_trees_close(got, jax.jit(fn)(*args))
    assert all(a.shape is not None for a in compiled.out_avals)


@pytest.mark.parametrize("format", FORMATS)
def test_optax_states_need_no_registration(format: str) -> None:
    opt = optax.adamw(1e-2)
    params = {"w": X, "b": X[0]}
    state = opt.init(params)

    def step(p: Any, s: Any) -> Any:
        updates, s = opt.update(jax.tree.map(jnp.ones_like, p), s, p)
        return optax.apply_updates(p, updates), s

    got, _ = run(step, params, state, format=format)
    assert_trees_close(got, jax.jit(step)(params, state))


@pytest.mark.parametrize("format", FORMATS)
def test_typed_keys_travel_as_their_data(format: str) -> None:
    def fn(key: Any, legacy: Any) -> Any:
        keys = jax.random.split(key, 3)
        return keys, jax.random.uniform(keys[0], (2,)), jax.random.normal(legacy, (2,))

    key, legacy = jax.random.key(7), jax.random.PRNGKey(1)
    got, compiled = run(fn, key, legacy, format=format)
    assert_trees_close(got, jax.jit(fn)(key, legacy))
    keys_type, *rest = compiled.out_keys
    assert rest == [None, None]
    assert (keys_type.impl, keys_type.dtype, keys_type.data_ndim) == ("threefry2x32", key.dtype, 1)
    assert compiled.out_avals[0].shape == (3, 2) and compiled.out_avals[0].dtype == "uint32"


def test_split_key_and_local_input() -> None:
    key = jax.random.key(0, impl="rbg")
    data, kt = split_key(key)
    assert kt is not None and (kt.impl, kt.data_ndim, data.shape) == ("rbg", 1, (4,))
    assert split_key(X) == (X, None)
    value, spec, key_type = local_input(2.0)  # as jax.jit sees it: weak, x64 or not
    assert (value.dtype, spec.weak_type, key_type) == (jax.typeof(2.0).dtype, True, None)
    value, spec, key_type = local_input(jax.random.split(jax.random.key(0), 5))
    assert (value.shape, value.dtype, spec.shape, key_type.impl) == ((5, 2), np.uint32, (5, 2),
                                                                      "threefry2x32")


def printing(x: Any) -> Any:
    jax.debug.print("x = {}", x)
    return x


def pure(x: Any) -> Any:
    return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def io(x: Any) -> Any:
    from jax.experimental import io_callback

    return io_callback(np.cos, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def debug_callback(x: Any) -> Any:
    jax.debug.callback(lambda v: None, x)
    return x


@jax.custom_jvp
def custom(x: Any) -> Any:
    return pure(x)


custom.defjvp(lambda primals, tangents: (custom(primals[0]), tangents[0]))

NESTED = {
    "top level": printing,
    "in a jit": lambda x: jax.jit(pure)(x) + 1,
    "in a cond branch": lambda x: jax.lax.cond(x.sum() > 0, io, jnp.cos, x),
    "in a while body": lambda x: jax.lax.while_loop(lambda c: c.sum() < 100,
                                                    lambda c: debug_callback(c) * 2 + 1, x),
    "in a scan body": lambda x: jax.lax.scan(lambda c, _: (printing(c), None), x, None, length=2)[0],
    "in a custom_jvp": custom,
    "under grad": lambda x: jax.grad(lambda v: jnp.sum(custom(v)))(x),
}


@pytest.mark.parametrize("case", NESTED, ids=list(NESTED))
def test_host_callbacks_are_found_wherever_they_are(case: str) -> None:
    closed = jax.jit(NESTED[case]).trace(jax.ShapeDtypeStruct((3,), np.float32)).jaxpr
    with pytest.raises(HostCallbackError, match="host callbacks cannot run on a jitserve server"):
        check_host_callbacks(closed, "f")


@pytest.mark.parametrize("fn, advice", [
    (printing, "return the value as an output and print it on the client"),
    (pure, "compute it on the client before the call, or express it in jax.numpy"),
])
@pytest.mark.parametrize("format", FORMATS)
def test_trace_refuses_callbacks_before_making_a_program(fn: Any, advice: str, format: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax.export, "export", lambda *a, **k: pytest.fail("exported"))
    with pytest.raises(HostCallbackError, match=advice) as info:
        run(fn, X, format=format)
    assert isinstance(info.value, ValueError) and "test_client_trace.py:" in str(info.value)


def test_pure_functions_pass_the_check() -> None:
    closed = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)).trace(X).jaxpr
    check_host_callbacks(closed, "f")


@pytest.mark.parametrize("flags, tree, want", [
    ((True, False), (X, X), (True, False)),
    ((True, False), ({"a": X, "b": (X, None)}, X), (True, True, False)),
    ((False, True), (Pair(X, X), {"k": [X, X, X]}), (False, False, True, True, True)),
    (({"x": True, "y": False},), ({"x": Params(X, X), "y": X},), (True, True, False)),
])
def test_donation_covers_every_leaf_of_a_donated_argument(flags: Any, tree: Any,
                                                          want: tuple[bool, ...]) -> None:
    assert _donated_leaves(flags, tree) == want
