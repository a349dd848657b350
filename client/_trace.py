"""Trace a remote function into a program of flat leaves, in either format.

The program a remote function sends takes a flat list of arrays and returns a
flat list of arrays: the pytree structure of the arguments and of the outputs
stays on the client (``Compiled.out_tree``), so any pytree ``jax.jit`` takes
works (optax states, flax structs, NamedTuples, custom nodes), whether or not
``jax.export`` could serialize its node types. Typed PRNG keys travel as their
``uint32`` data and are wrapped and unwrapped inside the program.

Both formats trace the same flat function, once: ``jax.jit(flat).trace`` gives
the jaxpr that is checked for host callbacks and, for ``format="jaxpr"``,
encoded; ``jax.export`` reuses that trace.

jax is imported by the functions here, never at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jitserve import wire
from jitserve.client._models import Aval
from jitserve.client._remote import KeyType
from jitserve.client.errors import HostCallbackError

__all__ = ["Compiled", "FlatFunction", "check_host_callbacks", "local_input", "split_key", "trace",
           "trace_jaxpr", "wire_aval"]

#: Primitives that call back into the caller's Python process, with what to do instead.
HOST_CALLBACKS = {
    "debug_print": "return the value as an output and print it on the client",
    "debug_callback": "return the value as an output and use it on the client",
    "io_callback": "return the value as an output and do the side effect on the client",
    "pure_callback": "compute it on the client before the call, or express it in jax.numpy",
    "buffer_callback": "compute it on the client before the call, or express it in jax.numpy",
}


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One traced signature of a remote function.

    Attributes:
      program_id: sha256 hex of ``program`` (the server's id for it too).
      program: the program bytes (``Exported.serialize()``, or a msgpack jaxpr
        document), kept to upload again if the server has lost them.
      out_tree: the jax ``PyTreeDef`` of the outputs; the program returns its leaves.
      out_avals: the outputs' avals on the wire (a key output's are its data's).
      out_keys: per output, the ``KeyType`` of a typed key output, else ``None``.
      out_shardings: per output of a sharded program, its ``NamedSharding`` over the
        abstract mesh it was exported for (``None`` where unspecified); else empty.
    """

    program_id: str
    program: bytes
    out_tree: Any
    out_avals: tuple[Aval, ...]
    out_keys: tuple[KeyType | None, ...]
    out_shardings: tuple[Any, ...] = ()


def split_key(x: Any) -> tuple[Any, KeyType | None]:
    """A typed PRNG key array's ``uint32`` data and its ``KeyType``; anything else as it is."""
    import jax

    dtype = getattr(x, "dtype", None)
    if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return x, None
    data = jax.random.key_data(x)
    return data, KeyType(str(jax.random.key_impl(x)), dtype, data.ndim - x.ndim)


def local_input(leaf: Any) -> tuple[np.ndarray, Any, KeyType | None]:
    """A local leaf's wire value, its ``ShapeDtypeStruct`` and its ``KeyType`` (keys only).

    ``jax.typeof`` gives the aval ``jax.jit`` would see: canonical dtype (x64 or
    not), and weak types for Python scalars.
    """
    import jax

    leaf, key = split_key(leaf)
    aval = jax.typeof(leaf)
    value = np.asarray(leaf)
    if value.dtype != aval.dtype:
        value = value.astype(aval.dtype)
    return value, jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type), key


class FlatFunction:
    """``fn`` as a function of flat leaves that returns flat leaves.

    Unflattens its arguments with ``in_tree`` (wrapping the leaves named in
    ``in_keys`` back into typed keys), calls ``fn``, and returns the leaves of
    the result, typed keys as their data. ``out_tree`` and ``out_keys`` are
    known once it has been traced.
    """

    def __init__(self, fn: Callable[..., Any], in_tree: Any,
                 in_keys: Sequence[str | None], name: str) -> None:
        self.fn, self.in_tree, self.in_keys = fn, in_tree, tuple(in_keys)
        self.out_tree: Any = None
        self.out_keys: tuple[KeyType | None, ...] = ()
        self.__name__ = self.__qualname__ = name

    def __call__(self, *leaves: Any) -> list[Any]:
        import jax

        leaves = tuple(x if k is None else jax.random.wrap_key_data(x, impl=k)
                       for x, k in zip(leaves, self.in_keys))
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, leaves)
        out_leaves, self.out_tree = jax.tree_util.tree_flatten(self.fn(*args, **kwargs))
        data, keys = zip(*map(split_key, out_leaves)) if out_leaves else ((), ())
        self.out_keys = tuple(keys)
        return list(data)


def trace_jaxpr(fn: Callable[..., Any], name: str, in_tree: Any, specs: Sequence[Any],
                in_keys: Sequence[str | None], *, keep_unused: bool = False,
                inline: bool = False) -> tuple[Any, FlatFunction]:
    """The closed jaxpr of ``fn`` on flat ``specs``, as ``jax.jit(f).trace(...).jaxpr``
    gives it (typed key inputs and outputs as their data, as the program has them),
    and the flat function, which knows the outputs' tree and keys once traced."""
    import jax

    flat = FlatFunction(fn, in_tree, in_keys, name)
    with _no_source_locations():
        traced = jax.jit(flat, keep_unused=keep_unused, inline=inline).trace(*specs)
    return traced.jaxpr, flat


def trace(fn: Callable[..., Any], name: str, in_tree: Any, specs: Sequence[Any],
          in_keys: Sequence[str | None], *, format: str,
          platforms: tuple[str, ...] | None, in_shardings: Sequence[Any] | None = None,
          out_shardings: Any = None, keep_unused: bool = False,
          inline: bool = False) -> Compiled:
    """Trace ``fn`` on flat ``specs`` and make the program of ``format``.

    ``in_shardings``: one ``Sharding`` (or ``None``) per flat input; ``out_shardings``:
    ``jax.jit``'s, a pytree prefix of ``fn``'s outputs. With shardings over a mesh
    of N devices the program is one for N devices of the server. ``keep_unused``
    and ``inline``: ``jax.jit``'s.

    Raises ``HostCallbackError`` before anything is exported if ``fn`` calls back
    into Python, and ``ValueError`` if ``fn`` uses a mesh of several devices inside
    but names none at its boundary (it would export for one device).
    """
    import jax

    flat = FlatFunction(fn, in_tree, in_keys, name)
    layouts: tuple[Any, ...] = ()  # the outputs' shardings, of a sharded export
    ins = tuple(in_shardings) if in_shardings is not None else ()
    sharded = any(s is not None for s in ins)
    jit = functools.partial(jax.jit, keep_unused=keep_unused, inline=inline)
    jitted = jit(flat, in_shardings=ins) if sharded else jit(flat)
    with _no_source_locations():
        traced = jitted.trace(*specs)
        check_host_callbacks(traced.jaxpr, name)
        if out_shardings is not None:  # a prefix of fn's outputs: known once traced
            outs = jax.tree.broadcast(out_shardings, flat.out_tree.unflatten(
                [0] * flat.out_tree.num_leaves), is_leaf=lambda x: x is None)
            jitted = jit(flat, in_shardings=ins if sharded else None,
                         out_shardings=jax.tree.leaves(outs, is_leaf=lambda x: x is None))
            traced = jitted.trace(*specs)
            sharded = True
        if format == "jaxpr":
            if sharded:
                raise ValueError(f"{name}: in_shardings and out_shardings need format="
                                 "'jax_export' (a jaxpr document runs on one device)")
            from jitserve.client.jaxpr import encode_jaxpr

            program = encode_jaxpr(traced.jaxpr, format="msgpack")
            out_avals = traced.jaxpr.out_avals
        else:
            exported = jax.export.export(jitted, platforms=platforms)(*specs)  # reuses the trace
            if exported.nr_devices == 1:
                check_inner_meshes(traced.jaxpr, name)
            program, out_avals = bytes(exported.serialize()), exported.out_avals
            if exported.nr_devices > 1 and getattr(exported, "_has_named_shardings", False):
                layouts = tuple(exported._out_named_shardings)
    return Compiled(hashlib.sha256(program).hexdigest(), program, flat.out_tree,
                    tuple(map(wire_aval, out_avals)), flat.out_keys, layouts)


def check_host_callbacks(closed_jaxpr: Any, name: str) -> None:
    """Raise ``HostCallbackError`` if the jaxpr, or any jaxpr nested in it, calls back into Python.

    A host callback runs a Python function of the caller's process in the middle
    of the program; the server has no such process, so it can never run.
    """
    for eqn in _equations(closed_jaxpr.jaxpr):
        prim = eqn.primitive.name
        if prim in HOST_CALLBACKS:
            raise HostCallbackError(
                f"{name} calls back into Python ({prim}, from {_source(eqn)}): host callbacks "
                f"cannot run on a jitserve server; {HOST_CALLBACKS[prim]} instead")


def check_inner_meshes(closed_jaxpr: Any, name: str) -> None:
    """Raise ``ValueError`` if the jaxpr shards over a mesh of several devices (a
    sharding constraint, ``shard_map``) while the function's arguments and outputs
    name no sharding: ``jax.export`` then makes a program for one device, and the
    constraint would fail on the server."""
    for eqn in _equations(closed_jaxpr.jaxpr):
        sharding = eqn.params.get("sharding")
        mesh = eqn.params.get("mesh", getattr(sharding, "mesh", None))
        size = getattr(mesh, "size", 1)
        if size > 1:
            raise ValueError(
                f"{name} shards over a mesh of {size} devices ({eqn.primitive.name}, from "
                f"{_source(eqn)}), but its arguments and outputs name no sharding, so it would "
                "run on one device: give c.jit in_shardings= or out_shardings= over that mesh "
                "(c.mesh(shape, axis_names)), as jax.export needs")


def _equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs in its params (jit, cond, while, scan...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in _jaxprs_in(param):
                yield from _equations(sub)


def _jaxprs_in(param: Any) -> Iterator[Any]:
    from jax.extend import core as jcore

    if isinstance(param, jcore.ClosedJaxpr):
        yield param.jaxpr
    elif isinstance(param, jcore.Jaxpr):
        yield param
    elif isinstance(param, (tuple, list)):  # cond's branches
        for p in param:
            yield from _jaxprs_in(p)


def _source(eqn: Any) -> str:
    """Where the user's code made ``eqn`` (jax's own frames left out), or the primitive's name."""
    from jax._src import source_info_util

    frame = source_info_util.user_frame(eqn.source_info.traceback)
    return f"{frame.file_name}:{frame.start_line}" if frame else "an unknown line"


def wire_aval(aval: Any) -> Aval:
    """A jax aval (shape, dtype, weak type) as the wire's ``Aval``."""
    return Aval(tuple(int(d) for d in aval.shape), wire.dtype_name(aval.dtype), bool(aval.weak_type))


@contextlib.contextmanager
def _no_source_locations() -> Iterator[None]:
    """Leave file:line locations out of the exported module, for this thread only.

    By default jax records the Python call stack of the *caller* in every op's
    location, so the same function called from two places (or from two checkouts)
    would export different bytes, get two program ids, and compile twice on the
    server. Op names (``jit(f)/sin``) stay. The switch is jax's thread-local
    config context (jax is pinned; without it, bytes are merely less shareable).
    """
    from jax._src import config

    limit = getattr(config, "traceback_in_locations_limit", None)
    with limit(0) if limit is not None else contextlib.nullcontext():
        yield
