"""``client.jit``: trace and export locally, compile and run on the server.

A traced signature travels as a ``jax.export`` artifact (``format="jax_export"``,
the default) or as a jaxpr document (``format="jaxpr"``, ``docs/jaxpr-format.md``).

jax is imported here lazily, on the first call, so the client installs and imports
without it (``pip install jitserve[jit]`` brings it for ``jit``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from jitserve import wire
from jitserve.client._ahead import Submit, _Queued
from jitserve.client._aot import RemoteLowered, RemoteTraced, check_options, out_info_of
from jitserve.client._base import BaseClient, Op, _Acquire, _Execution
from jitserve.client._remote import _FutureState, _RemoteBase, local_value
from jitserve.client._trace import Compiled, local_input, trace, trace_jaxpr, wire_aval
from jitserve.client.errors import NotFound, PayloadTooLarge

__all__ = ["AsyncRemoteFunction", "JIT_FORMATS", "RemoteFunction"]

#: The program formats ``Client.jit(fn, format=...)`` can send.
JIT_FORMATS = ("jax_export", "jaxpr")


@dataclasses.dataclass(frozen=True)
class _Split:
    """A call's arguments: hashable statics, and dynamic leaves with their tree.

    ``donated`` says, per leaf, whether it belongs to a donated argument.
    """

    static_pos: tuple[tuple[int, Any], ...]
    static_kw: tuple[tuple[str, Any], ...]
    treedef: Any
    leaves: list[Any]
    donated: tuple[bool, ...]


class _Hold:
    """Whether the calls of one signature ask the server to hold the answer (``Timeout.hold``).

    A call that asked and got a 202 (a compile, a long run, a queue) spent the
    hold for nothing, so after ``k`` such calls in a row the next ``2**k`` calls of
    the signature (at most ``_MAX_SKIP``) do not ask; then one asks again.
    """

    __slots__ = ("misses", "skip")

    def __init__(self) -> None:
        self.misses = 0
        self.skip = 0

    def ask(self) -> bool:
        if self.skip:
            self.skip -= 1
            return False
        return True

    def answered(self, with_outputs: bool) -> None:
        if with_outputs:  # also when a reader asked for them while skipping (``_ahead``)
            self.misses = self.skip = 0
        else:
            self.misses += 1
            self.skip = min(1 << self.misses, _MAX_SKIP)


_MAX_SKIP = 1024


class _Input:
    """One leaf as the program sees it: the wire value (or our remote array), its
    signature (shape, dtype name, weak type, key impl) and, made only when a trace
    needs it, its ``jax.ShapeDtypeStruct`` (``spec``)."""

    __slots__ = ("_spec", "key", "signature", "value")

    def __init__(self, value: Any, signature: tuple[Any, ...], key: str | None,
                 spec: Any = None) -> None:
        self.value, self.signature, self.key, self._spec = value, signature, key, spec

    @property
    def spec(self) -> Any:
        if self._spec is None:
            import jax

            shape, dtype, weak, _ = self.signature
            self._spec = jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
        return self._spec


def _as_tuple(x: Any, kind: type) -> tuple[Any, ...]:
    return (x,) if isinstance(x, kind) else tuple(x)


def check_jit_format(format: str) -> str:
    """``format`` if ``Client.jit`` can send it; otherwise a ``ValueError`` naming those it can."""
    if format not in JIT_FORMATS:
        raise ValueError(f"jit format must be one of {JIT_FORMATS}, got {format!r:.100}")
    return format


def _resolve_argnums(fn: Callable[..., Any], nums: tuple[int, ...],
                     names: tuple[str, ...]) -> tuple[tuple[int, ...], frozenset[str]]:
    """Complete argnums from argnames and back, through ``fn``'s signature, as jax.jit does."""
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


@functools.cache
def _tracer_type() -> type[Any]:
    """jax's ``Tracer``: an argument of a call made inside a jax transformation."""
    import jax

    return jax.core.Tracer


def _donated_leaves(flags: Any, tree: Any) -> tuple[bool, ...]:
    """Per leaf of ``tree``, the flag of the argument it belongs to (``flags`` is a prefix of ``tree``)."""
    import jax

    per_arg = jax.tree_util.tree_map(
        lambda flag, sub: [flag] * len(jax.tree_util.tree_leaves(sub)), flags, tree)
    return tuple(jax.tree_util.tree_leaves(per_arg))


class _RemoteFunctionBase:
    """What sync and async remote functions share: splitting, tracing, the cache."""

    def __init__(self, client: BaseClient, fn: Callable[..., Any], *,
                 static_argnums: int | Sequence[int] = (),
                 static_argnames: str | Iterable[str] = (),
                 donate_argnums: int | Sequence[int] = (),
                 donate_argnames: str | Iterable[str] = (),
                 format: str = "jax_export", in_shardings: Any = None,
                 out_shardings: Any = None, keep_unused: bool = False, inline: bool = False,
                 compiler_options: Mapping[str, Any] | None = None, device: Any = None,
                 backend: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"jit needs a callable, got {fn!r:.100}")
        if device is not None or backend is not None:
            raise TypeError(
                "a function of client.jit runs on the jitserve server's devices, so it takes "
                "no device= or backend= (both deprecated in jax.jit too): give in_shardings= "
                "over c.mesh(...) to choose the server's devices")
        self._client = client
        # jax.jit's: they shape the trace (keep_unused keeps unused arguments as the
        # program's inputs; inline matters only inside another trace, where a function
        # of client.jit is never called) and the server's compile (compiler_options).
        self._keep_unused, self._inline = bool(keep_unused), bool(inline)
        self._compiler_options = check_options(compiler_options)
        self._fn = fn
        self._name = str(getattr(fn, "__name__", "fn"))
        self._format = check_jit_format(format)
        # jax.jit's: a prefix of the dynamic positional arguments, and of the outputs.
        self._in_shardings, self._out_shardings = in_shardings, out_shardings
        self._static_argnums, self._static_argnames = _resolve_argnums(
            fn, _as_tuple(static_argnums, int), _as_tuple(static_argnames, str))
        self._donate_argnums, self._donate_argnames = _resolve_argnums(
            fn, _as_tuple(donate_argnums, int), _as_tuple(donate_argnames, str))
        self._cache: dict[Hashable, Compiled] = {}
        self._locks: dict[Hashable, Any] = {}  # one per signature: trace and upload it once
        self._holds: dict[str, _Hold | None] = {}  # by program id; None: never asks
        self._started: set[str] = set()  # program ids the server took a call of (run_ahead)
        # The subclasses are the callables (sync and async ``__call__``).
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self._fn, '__qualname__', self._fn)!r}>"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """Bound as a method, as ``jax.jit``'s functions are: a class attribute
        ``step = functools.partial(c.jit, static_argnums=0)(fn)`` gets its instance
        first when called as ``trainer.step(x)``."""
        return self if obj is None else types.MethodType(self, obj)  # type: ignore[arg-type]

    def _cache_size(self) -> int:
        """How many signatures have been traced (like ``jax.jit``'s ``_cache_size``)."""
        return len(self._cache)

    def clear_cache(self) -> None:
        """Forget traced signatures; the next calls trace (and check the server) again."""
        self._client._forget_programs(c.program_id for c in self._cache.values())
        self._cache.clear()
        self._holds.clear()
        self._started.clear()

    # ------------------------------------------------------------------ arguments

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Split:
        import jax

        n = len(args)
        nums = {i + n if i < 0 else i for i in self._static_argnums}
        static_pos = tuple((i, args[i]) for i in sorted(nums) if 0 <= i < n)
        static_kw = tuple(sorted(((k, v) for k, v in kwargs.items()
                                  if k in self._static_argnames), key=lambda kv: kv[0]))
        dyn_pos = [i for i in range(n) if i not in nums]
        dyn = (tuple(args[i] for i in dyn_pos),
               {k: v for k, v in kwargs.items() if k not in self._static_argnames})
        leaves, treedef = jax.tree_util.tree_flatten(dyn)
        try:
            hash((static_pos, static_kw))
        except TypeError as e:
            raise ValueError(f"Non-hashable static arguments are not supported ({e}); "
                             "static arguments must be hashable, as with jax.jit") from e
        return _Split(static_pos, static_kw, treedef, leaves, self._donated(n, dyn_pos, dyn))

    def _donated(self, n: int, dyn_pos: list[int], dyn: tuple[tuple[Any, ...], dict[str, Any]]
                 ) -> tuple[bool, ...]:
        """Per dynamic leaf, whether it is donated (``n``: how many positional arguments)."""
        if not self._donate_argnums and not self._donate_argnames:
            return ()
        nums = {i + n if i < 0 else i for i in self._donate_argnums}
        flags = (tuple(i in nums for i in dyn_pos), {k: k in self._donate_argnames for k in dyn[1]})
        return _donated_leaves(flags, dyn)

    def _input(self, leaf: Any) -> _Input:
        """A leaf's wire value and signature: our own remote arrays go as themselves
        (references), their signature read from what the server said of them."""
        if isinstance(leaf, _RemoteBase) and leaf._belongs_to(self._client):
            leaf._check_live()  # a deleted array raises RuntimeError before anything is traced
            a, impl = leaf.aval, leaf.key_type.impl if leaf.key_type else None
            return _Input(leaf, (tuple(a.shape), a.dtype, bool(a.weak_type), impl), impl)
        if isinstance(leaf, _tracer_type()):
            raise TypeError(
                f"{self._name} was called with a jax tracer ({leaf.aval.str_short()}) as an "
                "argument: a function of client.jit runs on the jitserve server and takes "
                "concrete arrays, so it cannot be called inside jax.jit, jax.grad, jax.vmap "
                "or another jax transformation. Apply the transformation inside it instead, "
                "as in client.jit(jax.grad(fn)) or client.jit(jax.vmap(fn))")
        value, spec, key = local_input(local_value(leaf))
        impl = key.impl if key else None
        return _Input(value, (tuple(spec.shape), spec.dtype.name, bool(spec.weak_type), impl),
                      impl, spec)

    # ------------------------------------------------------------------ tracing

    def _key(self, split: _Split, inputs: list[_Input], platforms: Any) -> Hashable:
        import jax

        avals = tuple(i.signature for i in inputs)
        return (split.static_pos, split.static_kw, split.treedef, avals, platforms,
                # jax adds its options to Config as it defines them, unseen by mypy
                bool(jax.config.jax_enable_x64))  # type: ignore[attr-defined]

    def _bound(self, split: _Split) -> Callable[..., Any]:
        """``fn`` of the dynamic arguments alone, the statics put back in their places."""
        fn, static_pos, static_kw = self._fn, split.static_pos, dict(split.static_kw)

        def bound(*dyn_args: Any, **dyn_kw: Any) -> Any:
            args = list(dyn_args)
            for i, v in static_pos:  # ascending, so each lands at its own index
                args.insert(i, v)
            return fn(*args, **dyn_kw, **static_kw)

        return bound

    def _leaf_shardings(self, split: _Split) -> list[Any] | None:
        """``in_shardings`` per dynamic leaf, as ``jax.jit`` reads it: one entry per
        dynamic positional argument (a prefix of its pytree), or one for all of them;
        keyword arguments unspecified."""
        import jax

        if self._in_shardings is None:
            return None
        args, kwargs = split.treedef.unflatten([0] * split.treedef.num_leaves)
        prefix = self._in_shardings
        if not isinstance(prefix, (tuple, list)):
            prefix = (prefix,) * len(args)
        elif len(prefix) != len(args):
            raise ValueError(f"in_shardings has {len(prefix)} entries; {self._name} was called "
                             f"with {len(args)} positional arguments that are not static")
        full = jax.tree.broadcast((tuple(prefix), {k: None for k in kwargs}), (args, kwargs),
                                  is_leaf=lambda x: x is None)
        return list(split.treedef.flatten_up_to(full))

    # ------------------------------------------------------------------ the call

    def _op_call(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 expect: Hashable | None = None,
                 options: dict[str, Any] | None = None) -> Op[Any]:
        """A call; ``expect``: the signature it must have, and ``options`` the compiler
        options it runs with (a ``RemoteCompiled``'s; the function's by default)."""
        import jax

        options = self._compiler_options if options is None else options

        split, inputs, platforms, key = yield from self._op_signature(args, kwargs)
        if expect is not None and key != expect:
            raise TypeError(_mismatch(self._name, expect, key))
        compiled = self._cache.get(key)
        if compiled is None or not self._client._knows_program(compiled.program_id):
            compiled = yield from self._op_prepare(key, split, inputs, platforms)
        values = [i.value for i in inputs]
        donate = _donated_refs(split, inputs)
        ahead = self._client._ahead
        # Queued, sent in order with others (Client(run_ahead=N)); a signature's first
        # call waits for the server to take it, so that what it refuses in a program
        # (its platform, its signature) raises here, as jax raises tracing errors.
        if ahead is not None and compiled.program_id in self._started:
            state = _FutureState(self._client, None, len(compiled.out_avals),
                                 self._client._releases, name=self._name,
                                 nbytes=[a.nbytes for a in compiled.out_avals])
            queued = _Queued(compiled.program_id, values, donate, state, self._hold(compiled),
                             lambda: self._op_ensure_uploaded(compiled, check=False),
                             compiler_options=options)
            arrays = self._client._arrays(state, compiled.out_avals, compiled.out_keys,
                                          compiled.out_shardings)
            return Submit(queued, jax.tree_util.tree_unflatten(compiled.out_tree, arrays))
        ex = yield from self._op_execute(compiled, values, donate, options)
        self._started.add(compiled.program_id)
        arrays = self._client._wrap(ex, compiled.out_avals, compiled.out_keys, self._name,
                                    compiled.out_shardings)
        return jax.tree_util.tree_unflatten(compiled.out_tree, arrays)

    def _op_signature(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> Op[tuple[_Split, list[_Input], tuple[str, ...] | None, Hashable]]:
        """A call's arguments split, its inputs, the server's platforms and its signature."""
        split = self._split(args, kwargs)
        inputs = [self._input(leaf) for leaf in split.leaves]
        # A jaxpr names no platform; an export is made for the server's.
        platforms = None if self._format == "jaxpr" else (yield from self._client._op_platforms())
        return split, inputs, platforms, self._key(split, inputs, platforms)

    def _op_prepare(self, key: Hashable, split: _Split, inputs: list[_Input],
                    platforms: tuple[str, ...] | None, upload: bool = True) -> Op[Compiled]:
        """Trace and upload signature ``key`` once, however many calls want it at the same
        time (``upload=False``: trace only, for ``lower``)."""
        lock = self._locks.setdefault(key, self._client._new_lock())
        yield _Acquire(lock)
        try:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._cache[key] = trace(
                    self._bound(split), self._name, split.treedef, [i.spec for i in inputs],
                    [i.key for i in inputs], format=self._format, platforms=platforms,
                    in_shardings=self._leaf_shardings(split), out_shardings=self._out_shardings,
                    keep_unused=self._keep_unused, inline=self._inline)
            if upload:
                yield from self._op_ensure_uploaded(compiled)
        finally:
            lock.release()
        return compiled

    def _op_ensure_uploaded(self, compiled: Compiled, check: bool = True) -> Op[None]:
        """Upload the program unless the server has it (``check``: ask first, it is cheap)."""
        client = self._client
        if client._knows_program(compiled.program_id):
            return
        if not check or (yield from client._op_get_program(compiled.program_id)) is None:
            try:
                yield from client._op_upload(compiled.program, self._format)
            except PayloadTooLarge as e:
                raise PayloadTooLarge(
                    f"{e.message}: {self._name}'s program is {len(compiled.program):,} bytes. "
                    "The arrays a function closes over are constants of its program: pass "
                    "big ones as arguments (device_put them once to keep them on the server)",
                    status_code=e.status_code, code=e.code, details=e.details,
                    request=e.request, response=e.response) from None
        client._remember_program(compiled.program_id)

    def _op_execute(self, compiled: Compiled, values: list[Any], donate: list[int],
                    options: dict[str, Any]) -> Op[_Execution]:
        hold = self._hold(compiled)
        wait = self._client.timeout.hold if hold is not None and hold.ask() else None
        op = functools.partial(self._client._op_execute, compiler_options=options)
        try:
            ex = yield from op(compiled.program_id, values, wait, "", donate, compiled.out_avals)
        except NotFound:
            # The server may have lost the program (a restart); a missing future
            # reference is the other 404, and re-raises below.
            self._client._forget_programs([compiled.program_id])
            if (yield from self._client._op_get_program(compiled.program_id)) is not None:
                raise
            yield from self._op_ensure_uploaded(compiled, check=False)
            ex = yield from op(compiled.program_id, values, wait, "", donate, compiled.out_avals)
        if wait is not None:
            assert hold is not None
            hold.answered(ex.outputs is not None)
        return ex

    # ------------------------------------------------------------------ ahead of time

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Trace for these arguments' signature, as ``jax.jit(fn).lower``: a
        ``RemoteLowered`` (``as_text()``, ``out_info``), whose ``compile()`` has the server
        compile it (``client/_aot.py``). Sends nothing but, once per client, a question
        of the server's platforms. ``AsyncClient``'s is awaited."""
        return self._client._drive(self._op_lower(args, kwargs))  # type: ignore[attr-defined]

    def trace(self, *args: Any, **kwargs: Any) -> RemoteTraced:
        """Trace for these arguments, as ``jax.jit(fn).trace``, here and now: a
        ``RemoteTraced`` whose ``jaxpr`` is the traced jaxpr and whose ``lower()`` is
        ``lower(*args)``. Sends nothing (``lower`` and ``out_info`` ask the server its
        platforms, once per client); not awaited, with either client."""
        split = self._split(args, kwargs)
        inputs = [self._input(leaf) for leaf in split.leaves]
        jaxpr, flat = trace_jaxpr(self._bound(split), self._name, split.treedef,
                                  [i.spec for i in inputs], [i.key for i in inputs],
                                  keep_unused=self._keep_unused, inline=self._inline)
        out_info = out_info_of(flat.out_tree, [wire_aval(a) for a in jaxpr.out_avals],
                               flat.out_keys)
        return RemoteTraced(self, args, kwargs, jaxpr, out_info)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The outputs' pytree of ``jax.ShapeDtypeStruct`` for these arguments, as
        ``jax.jit(fn).eval_shape``; the trace is the one a call of them then uses.
        ``AsyncClient``'s is awaited."""
        return self._client._drive(self._op_eval_shape(args, kwargs))  # type: ignore[attr-defined]

    def _op_lower(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Op[RemoteLowered]:
        split, inputs, platforms, key = yield from self._op_signature(args, kwargs)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = yield from self._op_prepare(key, split, inputs, platforms, upload=False)
        return RemoteLowered(self, key, compiled, tuple(_donated_refs(split, inputs)),
                             self._format)

    def _op_eval_shape(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Op[Any]:
        lowered = yield from self._op_lower(args, kwargs)
        return lowered.out_info

    def _hold(self, compiled: Compiled) -> _Hold | None:
        """The hold state of ``compiled``'s calls; ``None`` when they never ask: a
        hold of 0, or outputs too big to come back with the answer."""
        if not self._client.timeout.hold:
            return None
        pid = compiled.program_id
        if pid not in self._holds:
            small = all(a.is_static for a in compiled.out_avals) and sum(
                a.nbytes for a in compiled.out_avals) <= wire.INLINE_OUTPUTS_BYTES
            self._holds[pid] = _Hold() if small else None
        return self._holds[pid]


class RemoteFunction(_RemoteFunctionBase):
    """A function jitted on the server, made by ``Client.jit``; call it like ``jax.jit(fn)``.

    A call splits static from dynamic arguments, traces ``fn`` once per signature
    (static values, pytree structure, shapes, dtypes, weak types, key types) into a
    program of flat leaves, a ``jax.export`` artifact or, with ``format="jaxpr"``, a
    jaxpr document, uploads the program if the server lacks it, and runs it. It
    returns the outputs' pytree with a ``RemoteArray`` per leaf, shapes and dtypes
    already known: at once, the call queued and sent in order with others (running
    ahead, the client's default: ``_ahead``), or, for a signature's first call and
    with ``run_ahead=0``, as soon as the server has queued the run (before any
    compile ends). When the outputs are small (``wire.INLINE_OUTPUTS_BYTES`` in all),
    the call lets the server hold its answer up to ``Timeout.hold`` for them, so a
    quick call comes back with its values and ``np.asarray(f(x))`` is one round trip
    (``_Hold``: a signature that keeps missing the hold stops asking for a while).

    Arguments and outputs may be any pytree ``jax.jit`` takes (optax states, flax
    structs, typed PRNG keys...): the trees stay here, only leaves travel. Leaves
    of ``donate_argnums`` arguments that are remote arrays of this client are
    donated: the server may reuse their memory, and they are deleted here.
    A function with host callbacks (``jax.debug.print``...) raises
    ``HostCallbackError`` before anything is sent. ``lower(*args)`` (then
    ``compile()``) and ``eval_shape(*args)`` are ``jax.jit``'s, ahead of time
    (``client/_aot.py``); as a class attribute it binds as a method.

    Example::

        f = client.jit(lambda x, y: {"sum": x + y}, static_argnums=())
        out = f(np.ones(3, np.float32), 2.0)     # {"sum": RemoteArray}
        np.asarray(out["sum"])
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any],
              expect: Hashable | None = None, options: dict[str, Any] | None = None) -> Any:
        client = self._client
        out = client._drive(self._op_call(args, kwargs, expect, options))  # type: ignore[attr-defined]
        return out.to(client._ahead, client.timeout.request) if type(out) is Submit else out


class AsyncRemoteFunction(_RemoteFunctionBase):
    """``RemoteFunction`` for ``AsyncClient``: ``await f(x)`` gives the pytree of ``AsyncRemoteArray``.

    Tracing runs in the event loop's thread (it is CPU work, as with ``jax.jit``),
    once per signature.
    """

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call(args, kwargs)

    async def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                    expect: Hashable | None = None, options: dict[str, Any] | None = None) -> Any:
        client = self._client
        out = await client._drive(self._op_call(args, kwargs, expect, options))  # type: ignore[attr-defined]
        if type(out) is Submit:
            return await out.ato(client._ahead, client.timeout.request)
        return out


def _donated_refs(split: _Split, inputs: list[_Input]) -> list[int]:
    """The inputs a call donates: its remote arrays among the donated leaves (a host
    array has no buffer on the server to give)."""
    return [n for n, (d, i) in enumerate(zip(split.donated, inputs))
            if d and isinstance(i.value, _RemoteBase)]


def _mismatch(name: str, compiled: Any, called: Any) -> str:
    """Why a call does not fit the signature a ``RemoteCompiled`` was compiled for
    (signatures are ``_key``s: statics, tree, leaf avals, platforms, x64)."""
    c_static_pos, c_static_kw, c_tree, c_avals = compiled[:4]
    static_pos, static_kw, tree, avals = called[:4]
    if (c_static_pos, c_static_kw) != (static_pos, static_kw):
        what = "other static arguments"
    elif c_tree != tree:
        what = f"another pytree of arguments ({tree}, compiled for {c_tree})"
    elif len(c_avals) == len(avals) and c_avals != avals:
        n = next(i for i, (a, b) in enumerate(zip(c_avals, avals)) if a != b)
        what = (f"argument leaf {n} of shape {avals[n][0]} and dtype {avals[n][1]}, compiled for "
                f"shape {c_avals[n][0]} and dtype {c_avals[n][1]}")
    else:
        what = "another signature (jax_enable_x64 or the server's platforms changed)"
    return (f"{name} was compiled for other arguments than it was called with: {what}. A "
            "compiled function takes the arguments it was lowered for; call the function "
            "itself for others, as with jax.jit")
