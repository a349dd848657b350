"""``client.jit``: trace and export locally, compile and run on the server.

A traced signature travels as a ``jax.export`` artifact (``format="jax_export"``,
the default) or as a jaxpr document (``format="jaxpr"``, ``docs/jaxpr-format.md``).

jax is imported here lazily, on the first call, so the client installs and imports
without it (``pip install jitserve[jit]`` brings it for ``jit``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jitserve import wire
from jitserve.client._base import BaseClient, Op
from jitserve.client._models import Aval
from jitserve.client._remote import _RemoteBase
from jitserve.client.errors import NotFound

if TYPE_CHECKING:
    import jax

__all__ = ["AsyncRemoteFunction", "JIT_FORMATS", "RemoteFunction"]

#: The program formats ``Client.jit(fn, format=...)`` can send.
JIT_FORMATS = ("jax_export", "jaxpr")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One traced signature of a remote function.

    Attributes:
      program_id: sha256 hex of ``program`` (the server's id for it too).
      program: the program bytes (``Exported.serialize()``, or a msgpack jaxpr
        document), kept to upload again if the server has lost them.
      out_tree: the jax ``PyTreeDef`` of the outputs.
      out_avals: the outputs' avals, known without asking the server.
    """

    program_id: str
    program: bytes
    out_tree: Any
    out_avals: tuple[Aval, ...]


@dataclasses.dataclass(frozen=True)
class _Split:
    """A call's arguments: hashable statics, and dynamic leaves with their tree."""

    static_pos: tuple[tuple[int, Any], ...]
    static_kw: tuple[tuple[str, Any], ...]
    treedef: Any
    leaves: list[Any]


def _as_tuple(x: Any, kind: type) -> tuple[Any, ...]:
    return (x,) if isinstance(x, kind) else tuple(x)


def check_jit_format(format: str) -> str:
    """``format`` if ``Client.jit`` can send it; otherwise a ``ValueError`` naming those it can."""
    if format not in JIT_FORMATS:
        raise ValueError(f"jit format must be one of {JIT_FORMATS}, got {format!r:.100}")
    return format


def _resolve_statics(fn: Callable[..., Any], nums: tuple[int, ...],
                     names: tuple[str, ...]) -> tuple[tuple[int, ...], frozenset[str]]:
    """Complete static argnums from argnames and back, through ``fn``'s signature, as jax.jit does."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return nums, frozenset(names)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    both = [i for i, p in enumerate(positional) if p.kind is p.POSITIONAL_OR_KEYWORD]
    out_nums = set(nums) | {i for i in both if positional[i].name in names}
    out_names = set(names) | {positional[i].name for i in both
                              if i in nums or i - len(positional) in nums}
    return tuple(sorted(out_nums)), frozenset(out_names)


def _no_source_locations() -> contextlib.AbstractContextManager[Any]:
    """Leave file:line locations out of the exported module, for this thread only.

    By default jax records the Python call stack of the *caller* in every op's
    location, so the same function called from two places (or from two checkouts)
    would export different bytes, get two program ids, and compile twice on the
    server. Op names (``jit(f)/sin``) stay. The switch is jax's thread-local
    config context (jax is pinned; without it, bytes are merely less shareable).
    """
    from jax._src import config

    limit = getattr(config, "traceback_in_locations_limit", None)
    return limit(0) if limit is not None else contextlib.nullcontext()


class _RemoteFunctionBase:
    """What sync and async remote functions share: splitting, tracing, the cache."""

    def __init__(self, client: BaseClient, fn: Callable[..., Any], *,
                 static_argnums: int | Sequence[int] = (),
                 static_argnames: str | Iterable[str] = (),
                 format: str = "jax_export") -> None:
        if not callable(fn):
            raise TypeError(f"jit needs a callable, got {fn!r:.100}")
        self._client = client
        self._fn = fn
        self._format = check_jit_format(format)
        self._static_argnums, self._static_argnames = _resolve_statics(
            fn, _as_tuple(static_argnums, int), _as_tuple(static_argnames, str))
        self._cache: dict[Hashable, Compiled] = {}
        self._known: set[str] = set()  # program ids the server is known to have
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self._fn, '__qualname__', self._fn)!r}>"

    def _cache_size(self) -> int:
        """How many signatures have been traced (like ``jax.jit``'s ``_cache_size``)."""
        return len(self._cache)

    def clear_cache(self) -> None:
        """Forget traced signatures; the next calls trace (and check the server) again."""
        self._cache.clear()
        self._known.clear()

    # ------------------------------------------------------------------ arguments

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Split:
        import jax

        n = len(args)
        nums = {i + n if i < 0 else i for i in self._static_argnums}
        static_pos = tuple((i, args[i]) for i in sorted(nums) if 0 <= i < n)
        static_kw = tuple(sorted(((k, v) for k, v in kwargs.items()
                                  if k in self._static_argnames), key=lambda kv: kv[0]))
        dyn_args = tuple(a for i, a in enumerate(args) if i not in nums)
        dyn_kw = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kw))
        try:
            hash((static_pos, static_kw))
        except TypeError as e:
            raise ValueError(f"Non-hashable static arguments are not supported ({e}); "
                             "static arguments must be hashable, as with jax.jit") from e
        return _Split(static_pos, static_kw, treedef, leaves)

    def _leaf(self, leaf: Any) -> tuple[Any, jax.ShapeDtypeStruct]:
        """A leaf's wire value and its spec: a reference for our own remote arrays."""
        import jax

        if isinstance(leaf, _RemoteBase) and leaf._belongs_to(self._client):
            return leaf.ref(), jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        if isinstance(leaf, _RemoteBase):
            leaf = np.asarray(leaf)
        # jax.typeof gives the aval jax.jit would see: canonical dtype (x64 or not),
        # and weak_type for Python scalars.
        aval = jax.typeof(leaf)
        value = np.asarray(leaf)
        if value.dtype != aval.dtype:
            value = value.astype(aval.dtype)
        return value, jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)

    # ------------------------------------------------------------------ tracing

    def _key(self, split: _Split, specs: list[Any], platforms: Any) -> Hashable:
        import jax

        avals = tuple((tuple(s.shape), s.dtype.name, bool(s.weak_type)) for s in specs)
        return (split.static_pos, split.static_kw, split.treedef, avals, platforms,
                bool(jax.config.jax_enable_x64))

    def _trace(self, split: _Split, specs: list[Any],
               platforms: tuple[str, ...] | None) -> Compiled:
        import jax

        bound = self._bound(split)
        spec_args, spec_kw = jax.tree_util.tree_unflatten(split.treedef, specs)
        if self._format == "jaxpr":
            return _trace_jaxpr(bound, spec_args, spec_kw)
        with _no_source_locations():
            exported = jax.export.export(jax.jit(bound), platforms=platforms)(*spec_args, **spec_kw)
        program = bytes(exported.serialize())
        out_avals = tuple(_aval(a) for a in exported.out_avals)
        return Compiled(hashlib.sha256(program).hexdigest(), program, exported.out_tree, out_avals)

    def _bound(self, split: _Split) -> Callable[..., Any]:
        """``fn`` of the dynamic arguments alone, the statics put back in their places."""
        fn, static_pos, static_kw = self._fn, split.static_pos, dict(split.static_kw)

        def bound(*dyn_args: Any, **dyn_kw: Any) -> Any:
            args = list(dyn_args)
            for i, v in static_pos:  # ascending, so each lands at its own index
                args.insert(i, v)
            return fn(*args, **dyn_kw, **static_kw)

        bound.__name__ = getattr(fn, "__name__", "fn")
        bound.__qualname__ = getattr(fn, "__qualname__", bound.__name__)
        return bound

    # ------------------------------------------------------------------ the call

    def _op_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Op[Any]:
        import jax

        split = self._split(args, kwargs)
        values, specs = zip(*map(self._leaf, split.leaves)) if split.leaves else ((), ())
        # A jaxpr names no platform; an export is made for the server's.
        platforms = None if self._format == "jaxpr" else (yield from self._client._op_platforms())
        key = self._key(split, list(specs), platforms)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._cache.setdefault(key, self._trace(split, list(specs), platforms))
        yield from self._op_ensure_uploaded(compiled)
        ex = yield from self._op_execute(compiled, list(values))
        arrays = self._client._wrap(ex, compiled.out_avals)
        return jax.tree_util.tree_unflatten(compiled.out_tree, arrays)

    def _op_ensure_uploaded(self, compiled: Compiled, check: bool = True) -> Op[None]:
        """Upload the program unless the server has it (``check``: ask first, it is cheap)."""
        if compiled.program_id in self._known:
            return
        if not check or (yield from self._client._op_get_program(compiled.program_id)) is None:
            yield from self._client._op_upload(compiled.program, self._format)
        self._known.add(compiled.program_id)

    def _op_execute(self, compiled: Compiled, values: list[Any]) -> Op[Any]:
        op = self._client._op_execute
        try:
            return (yield from op(compiled.program_id, values, None, ""))
        except NotFound:
            # The server may have lost the program (a restart); a missing future
            # reference is the other 404, and re-raises below.
            self._known.discard(compiled.program_id)
            if (yield from self._client._op_get_program(compiled.program_id)) is not None:
                raise
        yield from self._op_ensure_uploaded(compiled, check=False)
        return (yield from op(compiled.program_id, values, None, ""))


def _aval(aval: Any) -> Aval:
    return Aval(tuple(int(d) for d in aval.shape), wire.dtype_name(aval.dtype), bool(aval.weak_type))


def _trace_jaxpr(bound: Callable[..., Any], spec_args: Any, spec_kw: Any) -> Compiled:
    """Trace to a jaxpr on the flat leaves and encode it (msgpack: the smaller encoding).

    ``trace_flat`` flattens ``(args, kwargs)`` exactly as ``_split`` did, so the
    document's inputs are the call's dynamic leaves in order; the pytree
    structure of the outputs stays here, as with ``jax.export``.
    """
    from jitserve.client.jaxpr import encode_jaxpr, trace_flat

    closed, _, out_tree = trace_flat(bound, *spec_args, **spec_kw)
    program = encode_jaxpr(closed, format="msgpack")
    out_avals = tuple(_aval(a) for a in closed.out_avals)
    return Compiled(hashlib.sha256(program).hexdigest(), program, out_tree, out_avals)


class RemoteFunction(_RemoteFunctionBase):
    """A function jitted on the server, made by ``Client.jit``; call it like ``jax.jit(fn)``.

    A call splits static from dynamic arguments, traces and exports ``fn`` once per
    signature (static values, pytree structure, shapes, dtypes, weak types) as a
    ``jax.export`` artifact or, with ``format="jaxpr"``, a jaxpr document, uploads
    the program if the server lacks it, and runs it. It returns at once: the outputs'
    pytree with a ``RemoteArray`` per leaf, shapes and dtypes already known.

    Example::

        f = client.jit(lambda x, y: {"sum": x + y}, static_argnums=())
        out = f(np.ones(3, np.float32), 2.0)     # {"sum": RemoteArray}
        np.asarray(out["sum"])
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._client._drive(self._op_call(args, kwargs))  # type: ignore[attr-defined]


class AsyncRemoteFunction(_RemoteFunctionBase):
    """``RemoteFunction`` for ``AsyncClient``: ``await f(x)`` gives the pytree of ``AsyncRemoteArray``.

    Tracing runs in the event loop's thread (it is CPU work, as with ``jax.jit``),
    once per signature.
    """

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return await self._client._drive(self._op_call(args, kwargs))  # type: ignore[attr-defined]
