"""Array futures: ``RemoteArray`` (sync) and ``AsyncRemoteArray``.

A future has one or more outputs; each output is a remote array. Siblings share
one ``_FutureState``, so the outputs are fetched once, by whichever sibling asks
first, and cached for all of them.

Memory is managed as jax manages device buffers: an output lives on the server
while its remote array lives here. When the array is garbage-collected its
output is queued for release (``ReleaseQueue``); ``delete()`` releases it at
once, and donating it to a call hands it over to the server. Either way the
array is then deleted, and using it raises ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import importlib.util
import logging
import operator
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jitserve import wire
from jitserve.client._models import Aval
from jitserve.client._release import ReleaseQueue
from jitserve.client.errors import JitserveError, JitserveTimeout, ProtocolError, _raised_anew

if TYPE_CHECKING:
    from jitserve.client._async import AsyncClient
    from jitserve.client._sync import Client

__all__ = ["AsyncRemoteArray", "KeyType", "RemoteArray", "local_value", "register_with_jax"]

logger = logging.getLogger("jitserve.client")


@dataclasses.dataclass(frozen=True)
class KeyType:
    """What makes an array of typed PRNG keys out of its ``uint32`` data.

    Attributes:
      impl: the PRNG implementation's name (``"threefry2x32"``).
      dtype: jax's key dtype (``key<fry>``).
      data_ndim: how many trailing axes of the data make one key (1 for threefry).
    """

    impl: str
    dtype: Any
    data_ndim: int

    def wrap(self, data: Any) -> Any:
        """The jax key array whose data is ``data``."""
        import jax

        return jax.random.wrap_key_data(data, impl=self.impl)


#: A sibling at most this big comes along when an output is fetched (``_FutureState``).
SIBLING_BYTES = 64 << 10


class _FutureState:
    """What the siblings of one future share: its id, client, fetched values, released outputs.

    ``values`` is ``None`` until fetched, then maps output index to value for each
    output fetched. A fetch brings the output asked for and its small siblings
    (``SIBLING_BYTES`` each; all of them when the sizes are not known), so that
    ``a, b = f(x)`` costs one round trip, and reading a training step's loss does not
    download the model beside it. ``released`` holds the outputs given back to the
    server (dropped, deleted or donated): a fetch never asks for them.
    """

    def __init__(self, client: Any, future_id: str | None, n_outputs: int, releases: ReleaseQueue,
                 *, values: dict[int, np.ndarray] | None = None, name: str = "",
                 nbytes: Sequence[int] | None = None) -> None:
        self.client = client
        # ``None`` while the call that makes it is still on its way (``Client(run_ahead=)``,
        # ``_ahead``): ``future_id`` waits for it, and raises the call's refusal.
        self._id = future_id
        self._sent: threading.Event | None = None if future_id is not None else threading.Event()
        self._asent: asyncio.Event | None = None  # for AsyncClient's callers (``waitable``)
        self._refusal: Exception | None = None
        self._dropped: list[int] = []  # outputs garbage before the call was sent
        self._drop_lock = threading.RLock()  # re-entrant: a finalizer may run under it
        self.n_outputs = n_outputs
        self.nbytes = None if nbytes is None else tuple(nbytes)
        self.releases = releases
        self.values = values
        self.name = name
        self.released: set[int] = set()
        # An output a reader waits for while the call is on its way: its batch asks
        # for it with the answer, when it is small enough to come (``_ahead``).
        self.awaited: int | None = None
        self.lock = threading.Lock()
        self.alock: asyncio.Lock | None = None  # made on first async use, in its loop
        self.tasks: set[asyncio.Task[Any]] = set()  # background fetches, kept alive

    @property
    def future_id(self) -> str:
        """The future's id; for a call still on its way, once the server has it (its
        refusal, if the server refused it: an asynchronous error, seen on first use)."""
        if self._id is None:
            assert self._sent is not None
            if self._asent is not None and not self._sent.is_set():
                # Its sender is a task of the loop this would block.
                raise RuntimeError(f"the call of {self.name or 'a program'} is still on its "
                                   "way: await the array's result() or block_until_ready() "
                                   "before asking for its future_id")
            # Bounded by the sender (``_ahead``): every batch it sends ends (answered,
            # refused, or failed by the request's timeout), and it settles each call.
            self._sent.wait()
            if self._refusal is not None:
                raise _raised_anew(self._refusal)
        assert self._id is not None
        return self._id

    def is_known(self) -> bool:
        """Whether the server answered the call that makes this future (always, but for
        a call still on its way)."""
        return self._sent is None or self._sent.is_set()

    def waitable(self) -> None:
        """Let ``settled()`` wait for this future's call: made by ``AsyncClient``'s sender,
        in its loop."""
        if self._asent is None and self._sent is not None and not self._sent.is_set():
            self._asent = asyncio.Event()

    async def settled(self) -> str:
        """``future_id``, waiting in the loop for a call on its way (``AsyncClient``)."""
        if self._asent is not None:
            await self._asent.wait()
        return self.future_id

    @property
    def label(self) -> str:
        """The future's id, or what stands for it while its call is on its way (no wait)."""
        return self._id or f"<{self.name or 'call'}, not sent yet>"

    def sent(self, future_id: str | None, refusal: Exception | None = None) -> None:
        """The call that makes this future reached the server (``future_id``), or was
        refused (``refusal``); the outputs dropped meanwhile go back now."""
        with self._drop_lock:
            self._id, self._refusal = future_id, refusal
            dropped, self._dropped = self._dropped, []
        assert self._sent is not None
        self._sent.set()
        if self._asent is not None:
            self._asent.set()
        if future_id is not None:  # not those donated: their call releases them
            for index in dropped:
                self.releases.put(future_id, index, 0)

    def fetched(self, index: int) -> bool:
        """Whether output ``index``'s value is here."""
        return self.values is not None and index in self.values

    def wanted(self, index: int) -> list[int] | None:
        """The outputs a fetch of output ``index`` asks for; ``None``: all of them."""
        sizes, have = self.nbytes, self.values or {}
        if sizes is None:
            if not self.released and not have:
                return None
            return [i for i in range(self.n_outputs) if i not in self.released and i not in have]
        return [i for i in range(self.n_outputs) if i == index or (
            i not in self.released and i not in have and sizes[i] <= SIBLING_BYTES)]

    def keep(self, outputs: list[np.ndarray], wanted: list[int] | None) -> None:
        """Cache the outputs a fetch of ``wanted`` brought back."""
        got = dict(zip(range(self.n_outputs) if wanted is None else wanted, outputs))
        self.values = got if self.values is None else {**self.values, **got}

    def output(self, index: int) -> np.ndarray:
        assert self.values is not None
        if index not in self.values:
            raise ProtocolError(f"future {self.future_id} sent {len(self.values)} outputs; "
                                f"output {index} is missing")
        return self.values[index]

    def forget(self, index: int) -> None:
        """Mark output ``index`` released, here only (the server knows, or is told by the caller)."""
        self.released.add(index)
        if self.values is not None:
            self.values.pop(index, None)

    def drop(self, index: int, nbytes: int = 0) -> None:
        """Output ``index`` (of ``nbytes``) is garbage: forget it and queue its release
        (a finalizer; never raises, never waits: a call on its way releases it once sent)."""
        self.forget(index)
        with self._drop_lock:
            if self._id is None:
                if self._sent is None or not self._sent.is_set():
                    self._dropped.append(index)
                return
        self.releases.put(self._id, index, nbytes)


def local_value(x: Any) -> Any:
    """A remote array's value here (see ``_RemoteBase._local``); anything else as it is."""
    return x._local() if isinstance(x, _RemoteBase) else x


def _owned(value: Any) -> Any:
    """``value``, or a copy of it where it is a fetched value or a view of one (read-only,
    and shared by every reader): ``v = y[0]; v += 1`` then changes ``v`` alone, as with a
    jax array, where ``+=`` makes a new array, rather than failing with numpy's
    ``output array is read-only`` (flax's ``nnx.Rngs`` counts that way on a model a
    jitted step returned)."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return value.copy()
    return value


def _binary(op: Callable[[Any, Any], Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """An operator method and its reflected twin, both on the fetched values."""
    def forward(self: _RemoteBase, other: Any) -> Any:
        return op(self._local(), local_value(other))

    def reflected(self: _RemoteBase, other: Any) -> Any:
        return op(local_value(other), self._local())

    return forward, reflected


def _unary(op: Callable[[Any], Any]) -> Callable[..., Any]:
    def method(self: _RemoteBase) -> Any:
        return op(self._local())

    return method


def _on_value(fn: Callable[..., Any], name: str, doc: str) -> Callable[..., Any]:
    """A method of remote arrays: ``fn`` of the fetched value (and the values of remote
    arguments)."""
    def method(self: _RemoteBase, *args: Any, **kwargs: Any) -> Any:
        return _owned(fn(self._local(), *map(local_value, args),
                         **{k: local_value(v) for k, v in kwargs.items()}))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"As ``jax.Array.{name}``: {doc} of the fetched value."
    return method


def _method(name: str) -> Callable[..., Any]:
    """``jax.Array``'s method ``name``, as numpy's method of the fetched value."""
    return _on_value(lambda value, *a, **k: getattr(value, name)(*a, **k), name,
                     f"numpy's ``ndarray.{name}``")


def _function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A method of ``jax.Array`` as numpy function ``fn`` of the fetched value: where
    numpy's method of the same name works in place (``sort``), or is gone (``ptp``)."""
    return _on_value(fn, fn.__name__, f"``numpy.{fn.__name__}``")


def _viewed(view: Callable[[Any], Any], name: str) -> Any:
    """``jax.Array``'s property ``name``, of the fetched value."""
    return property(lambda self: _owned(view(self._local())),
                    doc=f"As ``jax.Array.{name}``, of the fetched value (numpy).")


class _RemoteBase:
    """What sync and async remote arrays share: identity, metadata, lifetime, operators.

    Indexing, arithmetic, comparisons and ``jax.Array``'s array methods (``astype``,
    ``reshape``, ``sum``, ``T``...) fetch the value and apply numpy (see
    ``RemoteArray``); ``_local`` is how each kind gets the value.
    """

    __slots__ = ("__weakref__", "_future", "aval", "dtype", "index", "key_type", "shape",
                 "sharding")

    def __init__(self, future: _FutureState, index: int, aval: Aval,
                 key_type: KeyType | None = None, sharding: Any = None) -> None:
        self._future = future
        self.index = index
        self.aval = aval
        self.key_type = key_type
        # How the array is laid out on the server's devices: the ``NamedSharding`` (over
        # ``Client.mesh``'s abstract mesh) its program gave it; ``None`` for one device.
        self.sharding = sharding
        shape = tuple(aval.shape)
        self.shape: tuple[Any, ...] = shape[:len(shape) - key_type.data_ndim] if key_type else shape
        try:
            self.dtype: Any = key_type.dtype if key_type else wire.dtype_from_name(aval.dtype)
        except wire.WireError as e:
            raise ProtocolError(f"output {index} of future {future.label}: {e}") from None

    def __del__(self) -> None:
        # Garbage: the output goes back to the server (queued, sent in batches), as a
        # dropped jax.Array frees its memory. A __del__, not a weakref.finalize: one of
        # those costs several microseconds per output of every call. At interpreter exit
        # the server's TTL frees it: no IO then.
        try:
            future, index = self._future, self.index
        except AttributeError:  # __init__ did not finish
            return
        if index not in future.released and not sys.is_finalizing():
            future.drop(index, self.aval.nbytes)

    @property
    def future_id(self) -> str:
        """The id of the future this array is an output of."""
        return self._future.future_id

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes on the server (a key array's: its data's)."""
        data_shape: tuple[Any, ...] = tuple(self.aval.shape)
        return int(np.prod(data_shape, dtype=np.int64)) * wire.dtype_from_name(self.aval.dtype).itemsize

    def is_deleted(self) -> bool:
        """Whether this output was deleted or donated (as ``jax.Array.is_deleted``)."""
        return self.index in self._future.released

    def ref(self) -> dict[str, Any]:
        """The wire reference that stands in for this array in a later execute."""
        self._check_live()
        return {"future": self.future_id, "output": self.index}

    def _check_live(self) -> None:
        if self.is_deleted():
            dtype = getattr(self.dtype, "name", self.dtype)
            raise RuntimeError(f"Array has been deleted with shape={dtype}{list(self.shape)}"
                               f" (output {self.index} of future {self._future.label})")

    def _belongs_to(self, client: Any) -> bool:
        return self._future.client is client

    def _release_here(self) -> bool:
        """Mark this output released (deleted, or donated: the server released it) without
        queueing it; ``False`` if it already was."""
        if self.is_deleted():
            return False
        self._future.forget(self.index)
        return True

    def _as_value(self, data: np.ndarray) -> Any:
        """The user's value of fetched wire data: a key array for keys, else the numpy array."""
        return self.key_type.wrap(data) if self.key_type else data

    def _cached(self) -> np.ndarray | None:
        return self._future.output(self.index) if self._future.fetched(self.index) else None

    def _local(self) -> Any:
        """This array's value, here (fetching it if this kind of array can)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        state = ("deleted" if self.is_deleted() else
                 "fetched" if self._future.fetched(self.index) else "remote")
        dtype = getattr(self.dtype, "name", self.dtype)
        return (f"{type(self).__name__}(future={self._future.label!r}, index={self.index}, "
                f"shape={self.shape}, dtype={dtype}, {state})")

    # ------------------------------------------------------------------ the array API

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        value = self._local()
        if self.key_type is not None:
            return np.asarray(value)  # raises jax's TypeError, as a local key array does
        return _as_requested(value, dtype, copy)

    def __jax_array__(self) -> Any:
        import jax.numpy as jnp

        return jnp.asarray(self._local())

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return int(self.shape[0])

    def __iter__(self) -> Iterator[Any]:
        if not self.shape:
            raise TypeError("iteration over a 0-d array")
        return map(_owned, self._local())

    def __getitem__(self, idx: Any) -> Any:
        return _owned(self._local()[local_value(idx)])

    def __bool__(self) -> bool:
        return bool(self._local())

    def __int__(self) -> int:
        return int(self._local())

    def __float__(self) -> float:
        return float(self._local())

    def __complex__(self) -> complex:
        return complex(self._local())

    def __index__(self) -> int:
        return operator.index(self._local())

    def __str__(self) -> str:
        """The value, as jax prints an array (``print(loss)``, ``f"{loss}"``). ``repr``
        says where the array is instead, and never waits: a debugger or a traceback's
        locals show it as it is. An ``AsyncRemoteArray`` not fetched yet prints its
        ``repr`` (printing cannot ``await``)."""
        return str(self._printed())

    def _printed(self) -> Any:
        return self._local()

    def __format__(self, spec: str) -> str:
        return format(self._local(), spec) if spec else str(self)

    def item(self, *args: Any) -> Any:
        """The value of one element as a Python scalar, as ``numpy.ndarray.item``."""
        return self._local().item(*args)

    def tolist(self) -> Any:
        """The value as nested Python lists, as ``numpy.ndarray.tolist``."""
        return self._local().tolist()

    __add__, __radd__ = _binary(operator.add)
    __sub__, __rsub__ = _binary(operator.sub)
    __mul__, __rmul__ = _binary(operator.mul)
    __truediv__, __rtruediv__ = _binary(operator.truediv)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv)
    __mod__, __rmod__ = _binary(operator.mod)
    __pow__, __rpow__ = _binary(operator.pow)
    __matmul__, __rmatmul__ = _binary(operator.matmul)
    __and__, __rand__ = _binary(operator.and_)
    __or__, __ror__ = _binary(operator.or_)
    __xor__, __rxor__ = _binary(operator.xor)
    __lshift__, __rlshift__ = _binary(operator.lshift)
    __rshift__, __rrshift__ = _binary(operator.rshift)
    __eq__ = _binary(operator.eq)[0]
    __ne__ = _binary(operator.ne)[0]
    __lt__, __le__ = _binary(operator.lt)[0], _binary(operator.le)[0]
    __gt__, __ge__ = _binary(operator.gt)[0], _binary(operator.ge)[0]
    __divmod__, __rdivmod__ = _binary(divmod)
    __neg__, __pos__ = _unary(operator.neg), _unary(operator.pos)
    __abs__, __invert__ = _unary(operator.abs), _unary(operator.invert)
    __hash__ = None  # type: ignore[assignment]  # unhashable, like jax and numpy arrays

    def __round__(self, ndigits: int | None = None) -> Any:
        """``numpy.round`` of the value; integers without ``ndigits``, as jax rounds."""
        value = np.round(self._local(), ndigits or 0)
        return value if ndigits is not None else value.astype(int)

    def __contains__(self, value: Any) -> bool:
        return local_value(value) in self._local()

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError(f"{type(self).__name__} is immutable, as JAX arrays are: instead of "
                        "x[idx] = y, use x = x.at[idx].set(y) (in a jitted function, on the "
                        "server)")

    @property
    def weak_type(self) -> bool:
        """Whether the array is weakly typed, as ``jax.Array.weak_type`` (known at once)."""
        return bool(self.aval.weak_type)

    def tobytes(self, order: str = "C") -> bytes:
        """The value's bytes, as ``jax.Array.tobytes``."""
        return self._local().tobytes(order)

    # jax.Array's array methods, on the fetched value, as numpy computes them; not the
    # ones that say where an array lives (``devices``, ``addressable_shards``).
    all, any, argmax, argmin = (_method(n) for n in ("all", "any", "argmax", "argmin"))
    argpartition, argsort, astype, byteswap = (_method(n) for n in (
        "argpartition", "argsort", "astype", "byteswap"))
    choose, clip, compress, conj = (_method(n) for n in ("choose", "clip", "compress", "conj"))
    conjugate, copy, cumprod, cumsum = (_method(n) for n in (
        "conjugate", "copy", "cumprod", "cumsum"))
    diagonal, dot, flatten, max, mean = (_method(n) for n in (
        "diagonal", "dot", "flatten", "max", "mean"))
    min, nonzero, prod, ravel, repeat = (_method(n) for n in (
        "min", "nonzero", "prod", "ravel", "repeat"))
    reshape, round, searchsorted, squeeze = (_method(n) for n in (
        "reshape", "round", "searchsorted", "squeeze"))
    std, sum, swapaxes, take, trace = (_method(n) for n in (
        "std", "sum", "swapaxes", "take", "trace"))
    transpose, var, view = (_method(n) for n in ("transpose", "var", "view"))
    sort, ptp = _function(np.sort), _function(np.ptp)
    T = _viewed(lambda v: v.T, "T")
    mT = _viewed(lambda v: np.swapaxes(v, -1, -2), "mT")
    real = _viewed(lambda v: v.real, "real")
    imag = _viewed(lambda v: v.imag, "imag")
    flat = _viewed(lambda v: v.flat, "flat")

    @property
    def at(self) -> Any:
        """As ``jax.Array.at``: jax's indexed updates (``y.at[0].set(1)``) of the fetched
        value, whose results are local jax arrays, as ``jnp``'s results of remote
        arrays are. In a jitted function, ``at`` runs on the server."""
        import jax.numpy as jnp

        return jnp.asarray(self._local()).at

    def __dlpack__(self, **kwargs: Any) -> Any:
        """DLPack of a copy of the fetched value, on the CPU (``__dlpack_device__``), so
        that ``np.from_dlpack``, ``jnp.from_dlpack`` and ``torch.from_dlpack`` take a
        remote array; a key array has none, as in jax. A copy: the fetched value is
        read-only (every reader of this array shares it), and a consumer may write to
        what it is handed (jax asks for a DLPack version that cannot say read-only).
        Aligned as XLA aligns its buffers, so jax takes it without a copy of its own
        (jax 0.8 logged "DLPack buffer is not aligned" for one)."""
        return _aligned_copy(np.asarray(self)).__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # DLPack's kDLCPU, device 0: the value is fetched here

    def __copy__(self) -> Any:
        """The value, here: a copy must outlive this array, and an async one cannot be
        made on the server without an ``await`` (``RemoteArray`` makes its copies there)."""
        value = self._local()
        return value.copy() if isinstance(value, np.ndarray) else copy.copy(value)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self.__copy__()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its value, as a ``jax.Array`` is: the server's output and the client
        that holds it stay in this process."""
        return _unpickled, (self._local(),)

    @property
    def itemsize(self) -> int:
        """Bytes of one element (known without fetching, but of a key array)."""
        return int(self.dtype.itemsize) if self.key_type is None else int(self._local().itemsize)


def _unpickled(value: Any) -> Any:
    """A pickled remote array: its value."""
    return value


#: The alignment of XLA:CPU's buffers, which jax's DLPack import asks of what it takes.
_ALIGN = 64


def _aligned_copy(value: np.ndarray) -> np.ndarray:
    """A writable copy of ``value`` whose data starts at a multiple of ``_ALIGN`` bytes."""
    block = np.empty(value.nbytes + _ALIGN, np.uint8)
    start = -block.ctypes.data % _ALIGN
    out = block[start:start + value.nbytes].view(value.dtype).reshape(value.shape)
    out[...] = value
    return out


def _as_requested(a: np.ndarray, dtype: Any, copy: bool | None) -> np.ndarray:
    """numpy's ``__array__(dtype, copy)`` protocol on a fetched array."""
    if dtype is not None and np.dtype(dtype) != a.dtype:
        if copy is False:
            raise ValueError(f"converting {a.dtype} to {np.dtype(dtype)} needs a copy")
        return a.astype(dtype)
    return a.copy() if copy else a


class RemoteArray(_RemoteBase):
    """One output of a future on the server; it acts as an array.

    Pass it to a later call and the data never leaves the server::

        y = f(x)                 # RemoteArray, at once
        z = f(y)                 # y is sent as a reference
        z.result(timeout=10)     # numpy array
        float(loss), jnp.sum(z), z[0], z + 1

    ``shape``, ``dtype``, ``ndim``, ``size`` and ``nbytes`` are known at once.
    Everything that needs the value fetches it (once for all outputs of the
    future) and computes here: ``np.asarray``, ``jnp`` functions, indexing,
    arithmetic, comparisons and ``jax.Array``'s array methods (with numpy: ``y + 1``
    and ``y.mean()`` are numpy values), ``float()``, ``item()``. To compute on the
    server, do it inside a jitted function. ``copy.copy`` and ``copy.deepcopy`` make
    new arrays on the server; ``pickle`` writes the value.

    An output of typed PRNG keys has the key dtype and shape; its value is a jax
    key array. The output is released on the server when this object is
    garbage-collected, or at once by ``delete()``.
    """

    __slots__ = ()

    @property
    def _client(self) -> Client:
        return self._future.client

    def result(self, timeout: float | None = None) -> Any:
        """The array's value (read-only), waiting up to ``timeout`` seconds (``None``: no limit).

        Raises ``JitserveTimeout`` when the future is not done in time, the
        future's error (``FutureFailed``, ``CompileError``...) if it failed, and
        ``RuntimeError`` if this array was deleted.
        """
        self._check_live()
        st = self._future
        if not st.fetched(self.index):
            deadline = None if timeout is None else time.monotonic() + timeout
            if not st.lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                raise JitserveTimeout(f"future {st.label} not done after {timeout} s")
            try:
                # A call on its way: its batch's answer may bring the values (``_ahead``).
                st.awaited = self.index
                if st._sent is not None and not st._sent.wait(
                        None if deadline is None else max(deadline - time.monotonic(), 0.0)):
                    raise JitserveTimeout(f"future {st.label} not done after {timeout} s")
                future_id = st.future_id
                if not st.fetched(self.index):
                    client = self._client
                    client._drive(client._op_fetch(st, self.index, future_id, deadline))
            finally:
                st.lock.release()
        return self._as_value(st.output(self.index))

    def _local(self) -> Any:
        return self.result()

    def __copy__(self) -> Any:
        """A new array of the same value, made on the server, as copying a ``jax.Array``
        makes a new one on its device: deleting, donating or dropping either leaves the
        other (a second handle on the same output would free it with the first). Without
        jax (``pip install jitserve`` alone), which makes the copy's program, the value."""
        self._check_live()
        if importlib.util.find_spec("jax") is None:
            return super().__copy__()
        return self._client._placer(self.sharding)(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self.__copy__()

    def is_ready(self) -> bool:
        """Whether the value is computed (done, failed or cancelled), without waiting for it."""
        self._check_live()
        st = self._future
        if not st.is_known():
            return False  # a call on its way (``_ahead``): not even started
        if st._refusal is not None:
            return True  # refused: ready to raise, as a failed computation is
        return st.values is not None or self._client.future(self.future_id).done

    def done(self) -> bool:
        """Same as ``is_ready()``."""
        return self.is_ready()

    def block_until_ready(self) -> RemoteArray:
        """Wait until the value is computed, like ``jax.Array.block_until_ready``; returns self.

        The value stays on the server (nothing is downloaded); a failed future raises.
        """
        self._check_live()
        future_id = self.future_id  # a call on its way: its answer may bring the values
        if self._future.values is None:
            info = self._client.wait(future_id, name=self._future.name)
            if info.status != wire.FutureStatus.DONE:
                self.result()  # raises the future's error
        return self

    def copy_to_host_async(self) -> None:
        """Start fetching the value in a background thread; ``result()`` then finds it here."""
        self._check_live()
        if not self._future.fetched(self.index):
            threading.Thread(target=self._prefetch, name="jitserve-prefetch", daemon=True).start()

    def _prefetch(self) -> None:
        try:
            self.result()
        except Exception as e:  # noqa: BLE001 - result() raises it again to whoever asks
            logger.debug("prefetching %r failed: %s", self, e)

    def delete(self) -> None:
        """Free this output on the server now, as ``jax.Array.delete``; its siblings stay."""
        if self._release_here():
            try:
                future_id = self.future_id
            except JitserveError:  # its call was refused: nothing of it is on the server
                return
            self._client.release([(future_id, self.index)])


class AsyncRemoteArray(_RemoteBase):
    """``RemoteArray`` for ``AsyncClient``: the methods that talk to the server are awaitable.

    ``await a`` is ``await a.result()``. ``np.asarray(a)``, indexing, arithmetic
    and ``float(a)`` work once the value is fetched (``await a.result()``, or
    ``copy_to_host_async()`` and a moment); before, they raise ``TypeError``.
    """

    __slots__ = ()

    @property
    def _client(self) -> AsyncClient:
        return self._future.client

    async def result(self, timeout: float | None = None) -> Any:
        """The array's value, waiting up to ``timeout`` seconds (``None``: no limit)."""
        self._check_live()
        st = self._future
        if not st.fetched(self.index):
            deadline = None if timeout is None else time.monotonic() + timeout
            st.alock = st.alock or asyncio.Lock()
            try:
                async with asyncio.timeout(timeout):
                    await st.alock.acquire()
            except TimeoutError:
                raise JitserveTimeout(f"future {st.label} not done after {timeout} s") from None
            try:
                # A call on its way: its batch's answer may bring the values (``_ahead``).
                st.awaited = self.index
                scope = asyncio.timeout(None if deadline is None
                                        else max(deadline - time.monotonic(), 0.0))
                try:
                    async with scope:
                        future_id = await st.settled()
                except TimeoutError:
                    if not scope.expired():  # the call's own error (a JitserveTimeout)
                        raise
                    raise JitserveTimeout(f"future {st.label} not done after {timeout} s") from None
                if not st.fetched(self.index):
                    client = self._client
                    await client._drive(client._op_fetch(st, self.index, future_id, deadline))
            finally:
                st.alock.release()
        return self._as_value(st.output(self.index))

    def __await__(self) -> Any:
        return self.result().__await__()

    def _local(self) -> Any:
        self._check_live()
        value = self._cached()
        if value is None:
            raise TypeError(f"{self!r} is not fetched yet: `await x.result()` first")
        return self._as_value(value)

    def _printed(self) -> Any:
        return self._local() if self._cached() is not None or self.is_deleted() else repr(self)

    async def is_ready(self) -> bool:
        """Whether the value is computed (done, failed or cancelled), without waiting for it."""
        self._check_live()
        st = self._future
        if not st.is_known():
            return False  # a call on its way (``_ahead``): not even started
        if st.values is not None or st._refusal is not None:
            return True  # a refused call is ready to raise, as a failed computation is
        return (await self._client.future(self.future_id)).done

    async def done(self) -> bool:
        """Same as ``is_ready()``."""
        return await self.is_ready()

    async def block_until_ready(self) -> AsyncRemoteArray:
        """Wait until the value is computed, without downloading it; returns self."""
        self._check_live()
        future_id = await self._future.settled()  # its answer may bring the values
        if self._future.values is None:
            info = await self._client.wait(future_id, name=self._future.name)
            if info.status != wire.FutureStatus.DONE:
                await self.result()  # raises the future's error
        return self

    def copy_to_host_async(self) -> None:
        """Start fetching the value in a task of the running loop; ``await x`` then finds it here."""
        self._check_live()
        if not self._future.fetched(self.index):
            task = asyncio.get_running_loop().create_task(self.result())
            self._future.tasks.add(task)
            task.add_done_callback(self._prefetched)

    def _prefetched(self, task: asyncio.Task[Any]) -> None:
        self._future.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # result() raises it again
            logger.debug("prefetching %r failed: %s", self, task.exception())

    async def delete(self) -> None:
        """Free this output on the server now; its siblings stay."""
        if self._release_here():
            try:
                future_id = await self._future.settled()
            except JitserveError:  # its call was refused: nothing of it is on the server
                return
            await self._client.release([(future_id, self.index)])


@functools.cache
def register_with_jax() -> None:
    """Let jax functions take remote arrays as they take numpy arrays: by their fetched value.

    jax (0.9 on) no longer calls ``__jax_array__`` when it abstracts the argument of
    a jitted function (``jnp.sum`` is one), so the remote array types join jax's
    tables of array types, with the aval and value of the fetched value. The tables
    are jax internals, the same from jax 0.8 to 0.11; if they move, only
    ``jnp.asarray(y)`` and operators with jax arrays keep working, and this says so
    once in the log.

    ``jax.random``'s functions tell a typed key from raw ``uint32`` key data by
    ``isinstance(key, jax.Array)``, so a remote array of typed keys looked like key
    data to them ("invalid PRNG key data"), and jax 0.8 wrapped remote raw key data
    itself into a key array that failed on first use. Their check of a key
    (``_check_prng_key``) and their wrap of key data (``prng.random_wrap``, also
    ``jax.random.wrap_key_data``'s), the same from jax 0.8 to 0.11, now take a remote
    array as its fetched value (a jax key array, or numpy key data), as ``jnp`` takes
    any remote array. So does ``jax.device_get``'s per leaf (``api._device_get``): it
    fetches a remote key as a key array, as it does a local one, where ``__array__``
    raises jax's "PRNGKey dtype cannot be converted" (a ``TrainState``'s rng, a flax
    ``nnx.Rngs``).
    """
    try:
        from jax._src import core, dtypes

        core.pytype_aval_mappings[_RemoteBase] = lambda x: core.shaped_abstractify(x._local())
        # A plain dict before jax 0.10, a shim over register_canonicalize_value_handler since.
        dtypes.canonicalize_value_handlers[_RemoteBase] = (
            lambda x: dtypes.canonicalize_value(x._local()))
    except (ImportError, AttributeError) as e:
        logger.warning("jax functions will not take remote arrays (jnp.asarray(y) will): %s", e)
    _let_jax_random_take_remote_keys()


def _let_jax_random_take_remote_keys() -> None:
    import jax

    # jax._src.random (0.8, 0.9) or jax._src.random.core (0.10 on), and the prng module
    # it calls random_wrap (raw key data -> keys) of, by attribute.
    module = sys.modules.get(getattr(jax.random.split, "__module__", ""))
    prng = getattr(module, "prng", None)
    from jax._src import api

    patched = [_take_local_keys(module, "_check_prng_key", 1),
               _take_local_keys(prng, "random_wrap", 0), _take_local_keys(api, "_device_get", 0)]
    if not all(patched):
        logger.warning("jax.random functions and jax.device_get will not take remote keys "
                       "(jax.random.split(y.result()) will): jax moved its key checks")


def _take_local_keys(module: Any, name: str, position: int) -> bool:
    """Make ``module.name`` take a remote array at argument ``position`` as its fetched
    value (a jax key array, or numpy key data); whether ``module`` has it."""
    fn = getattr(module, name, None)
    if fn is None:
        return False
    if getattr(fn, "takes_remote_keys", False):
        return True

    @functools.wraps(fn)
    def local_keys(*args: Any, **kwargs: Any) -> Any:
        if len(args) > position and isinstance(args[position], _RemoteBase):
            args = (*args[:position], args[position]._local(), *args[position + 1:])
        return fn(*args, **kwargs)

    local_keys.takes_remote_keys = True  # type: ignore[attr-defined]
    setattr(module, name, local_keys)
    return True
