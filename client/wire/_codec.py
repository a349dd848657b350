"""The array codec shared by the client and the service.

Arrays travel as maps (see ``docs/api.md``, "Arrays on the wire")::

    {"dtype": "float32", "shape": [2, 3], "data": <bytes>}

``data`` is the C-order, little-endian buffer. In msgpack it is a ``bin``; in JSON
it is a base64 string of the same bytes or nested lists of numbers.

Everything that decodes (``decode_array``, ``unpackb``, ``from_json_array``,
``loads_json``) takes untrusted input: it never evaluates or unpickles anything,
bounds what it allocates, and raises ``WireError`` (a ``ValueError``) naming the
problem for any malformed input, never another exception type.

Example::

    >>> import numpy as np
    >>> blob = packb({"args": [np.arange(3, dtype=np.float32)]})
    >>> unpackb(blob)["args"][0]
    array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

from jitserve.wire._dtypes import DTYPES, WireError, dtype_from_name, dtype_name
from jitserve.wire._views import unpack_views

__all__ = [
    "INLINE_OUTPUTS_BYTES",
    "MAX_DEPTH",
    "MAX_RANK",
    "PackedBody",
    "STREAM_BYTES",
    "decode_array",
    "dumps_json",
    "encode_array",
    "from_json_array",
    "is_array",
    "is_future_ref",
    "loads_json",
    "pack_pieces",
    "packb",
    "to_json_array",
    "unpackb",
]

#: Most axes an array may have (XLA's own limit is far lower in practice).
MAX_RANK = 64
#: Deepest nesting of lists/maps a decoded message may have.
MAX_DEPTH = 128
#: Longest string a msgpack message may carry (ids, codes, messages, static keys).
MAX_STR_LEN = 16 * 1024 * 1024

_ARRAY_KEYS = frozenset({"dtype", "shape", "data"})
_LITTLE = sys.byteorder == "little"
_INT4: dict[str, ml_dtypes.iinfo] = {
    n: ml_dtypes.iinfo(DTYPES[n]) for n in ("int4", "uint4") if n in DTYPES}


# --------------------------------------------------------------------------- arrays


def _little_endian(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-contiguous little-endian array; the same object when it already is."""
    order = a.dtype.byteorder
    if order == ">" or (order == "=" and not _LITTLE):
        a = a.astype(a.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: that turns 0-d arrays into 1-d ones.
    return np.asarray(a, order="C")


def encode_array(a: Any) -> dict[str, Any]:
    """Encode an array (or array-like) as ``{"dtype", "shape", "data"}``.

    ``data`` is a read-only ``memoryview`` of the C-order little-endian bytes: no
    copy is made when ``a`` is already contiguous and little-endian, so do not
    mutate ``a`` until the message is packed. msgpack packs it as ``bin``.

    >>> encode_array(np.zeros((2,), np.int8))["shape"]
    [2]
    """
    arr = np.asarray(a)
    name = dtype_name(arr.dtype)
    arr = _little_endian(arr)
    # A uint8 view keeps the buffer export simple for ml_dtypes kinds and 0-d arrays.
    data = arr.reshape(-1).view(np.uint8).data.toreadonly()
    return {"dtype": name, "shape": [int(d) for d in arr.shape], "data": data}


def _check_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)):
        raise WireError(f"shape must be a list of non-negative ints, got {shape!r:.100}")
    if len(shape) > MAX_RANK:
        raise WireError(f"array rank {len(shape)} exceeds the limit of {MAX_RANK}")
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int):
            raise WireError(f"shape entries must be ints, got {d!r:.50} in {shape!r:.200}")
        if d < 0:
            raise WireError(f"negative dimension {d} in shape {list(shape)}")
    return tuple(shape)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype, max_bytes: int | None) -> int:
    # Python ints: a product of huge dims cannot overflow, it just fails the check.
    n = math.prod(shape) * dtype.itemsize
    if max_bytes is not None and n > max_bytes:
        raise WireError(f"array of shape {list(shape)} and dtype {dtype.name} is {n} bytes, "
                        f"over the limit of {max_bytes}")
    return n


def _check_keys(obj: Any) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise WireError(f"an array is a map {{dtype, shape, data}}, got {type(obj).__name__}")
    missing = _ARRAY_KEYS - obj.keys()
    extra = obj.keys() - _ARRAY_KEYS
    if missing or extra:
        raise WireError(f"an array is a map with keys dtype, shape, data; "
                        f"missing {sorted(missing)}, unexpected {sorted(map(str, extra))}")
    return obj


def decode_array(obj: Any, *, max_bytes: int | None = None) -> np.ndarray:
    """Decode ``{"dtype", "shape", "data": bytes}`` into a read-only numpy array.

    Zero-copy: the array is a view of ``data``. ``max_bytes`` bounds the array's
    size. Any malformed input raises ``WireError``.
    """
    if type(obj) is not dict or obj.keys() != _ARRAY_KEYS:  # a decoded message's dict: checked
        obj = _check_keys(obj)
    dtype = dtype_from_name(obj["dtype"])
    shape = _check_shape(obj["shape"])
    data = obj["data"]
    if type(data) is bytes:  # as msgpack decodes it
        size = len(data)
        n = _nbytes(shape, dtype, max_bytes)
    else:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WireError(f"array data must be bytes, got {type(data).__name__}")
        n = _nbytes(shape, dtype, max_bytes)
        with memoryview(data) as view:
            size = view.nbytes
    if size != n:
        raise WireError(f"array data is {size} bytes, but shape {list(shape)} of "
                        f"{dtype.name} needs {n}")
    return _from_buffer(data, dtype, shape)


def _from_buffer(data: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    wire_dtype = dtype if _LITTLE else dtype.newbyteorder("<")
    arr = np.frombuffer(data, dtype=wire_dtype).reshape(shape)
    if not _LITTLE:
        arr = arr.astype(dtype)
    _check_values(arr)
    return arr


def _check_values(arr: np.ndarray) -> None:
    # Only these kinds have byte patterns that are not valid values. (By ``kind``
    # first: numpy builds ``dtype.name`` anew, in Python, each time it is read.)
    kind = arr.dtype.kind
    if kind not in "bV":
        return
    name = dtype_name(arr.dtype)
    if name == "bool" and arr.size and arr.view(np.uint8).max() > 1:
        raise WireError("bool array data must hold only bytes 0 and 1")
    # ml_dtypes keeps an int4/uint4 in the low nibble of its byte (int4 as two's
    # complement: -1 is 0x0F) and ignores the high one; require it clear.
    if name in _INT4 and arr.size and arr.view(np.uint8).max() > 15:
        raise WireError(f"{name} array data must hold one value per byte in the low "
                        f"4 bits (bytes 0..15; int4 -1 is 0x0F)")


def is_array(obj: Any) -> bool:
    """Whether ``obj`` is shaped like a wire array (keys dtype, shape, data)."""
    return isinstance(obj, Mapping) and "dtype" in obj and "data" in obj


# Never a Mapping: told apart without the ABC check (a call's arguments are mostly these).
_NOT_MAPPINGS = (np.ndarray, list, tuple, str, bytes, int, float)


def is_future_ref(obj: Any) -> bool:
    """Whether ``obj`` is a future reference ``{"future": str, "output": int}``."""
    if type(obj) is dict:  # the common case, without the ABC check or a set of its keys
        if len(obj) != 2:
            return False
        future, output = obj.get("future"), obj.get("output")
        if type(future) is str and type(output) is int:
            return True
    elif isinstance(obj, _NOT_MAPPINGS):
        return False
    return (
        isinstance(obj, Mapping)
        and obj.keys() == {"future", "output"}
        and isinstance(obj["future"], str)
        and isinstance(obj["output"], int)
        and not isinstance(obj["output"], bool)
    )


# --------------------------------------------------------------------------- msgpack


def _pack_default(obj: Any) -> Any:
    # numpy scalars become 0-d arrays, like the rank-0 leaves jax traces.
    if isinstance(obj, (np.ndarray, np.generic)):
        return encode_array(obj)
    if hasattr(obj, "__array__") and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return encode_array(obj)  # jax arrays and other array-likes
    raise TypeError(f"cannot pack {type(obj).__name__}")


def packb(obj: Any) -> bytes:
    """msgpack ``obj``; numpy arrays (and numpy scalars) anywhere in it become wire arrays.

    Tuples pack as lists. Raises ``WireError`` for objects msgpack cannot carry.
    """
    try:
        packed: bytes = msgpack.packb(obj, default=_pack_default, use_bin_type=True)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode message: {e}") from e
    return packed


# Big buffers go out in slices of this size: HTTP servers and clients copy each
# chunk they frame, so a slice bounds that copy.
_SLICE = 4 << 20
# Pieces smaller than this are joined into one chunk; bigger ones go as views of
# their own buffer (joining a 1 MiB array would copy it twice more).
_JOIN_BELOW = 64 << 10
#: Bodies of at least this many bytes are streamed (requests and answers alike);
#: smaller ones are sent as one ``bytes``, which costs less than streaming.
STREAM_BYTES = 1 << 20
#: A run's outputs of at most this many bytes in all come back with its answer
#: from the runtime, so the server holds their values; the SDK asks for them
#: with the call itself (``Timeout.hold``) rather than in a second request.
INLINE_OUTPUTS_BYTES = 64 << 10
#: When a run's outputs are bigger than that, those of at most this many bytes each
#: still come back (``carried_outputs``): a training step's loss beside its model.
SMALL_OUTPUT_BYTES = 1 << 10


def carried_outputs(nbytes: Sequence[int]) -> tuple[int, ...]:
    """The outputs (of ``nbytes`` each) whose values come back with a run's answer: all
    of them when they total ``INLINE_OUTPUTS_BYTES`` or less, else, in order, those of
    at most ``SMALL_OUTPUT_BYTES`` while they total that."""
    if sum(nbytes) <= INLINE_OUTPUTS_BYTES:
        return tuple(range(len(nbytes)))
    carried, total = [], 0
    for index, n in enumerate(nbytes):
        if n <= SMALL_OUTPUT_BYTES and total + n <= INLINE_OUTPUTS_BYTES:
            carried.append(index)
            total += n
    return tuple(carried)


def pack_pieces(obj: Any) -> list[bytes | memoryview]:
    """msgpack ``obj`` as a list of pieces whose concatenation is ``packb(obj)``.

    Array data is not copied: each array is a ``bin`` header followed by a view
    of the array's own buffer, so a body of hundreds of MiB is sent as it lies
    in memory.
    """
    pieces: list[bytes | memoryview] = []
    # numpy scalars and other array-likes as packb takes them (``_pack_default``)
    _pack(msgpack.Packer(use_bin_type=True, autoreset=True, default=_pack_default), obj, pieces)
    return pieces


# Values msgpack's packer takes as they are (exact types): a dict or list of only these,
# such as a future reference, is packed whole by one call of it, in the same bytes.
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _pack(packer: msgpack.Packer, obj: Any, out: list[bytes | memoryview]) -> None:
    """Append ``obj``'s pieces to ``out`` (a list, not a generator: a batch of calls
    is thousands of small values, and resuming a generator per value cost more than
    packing them)."""
    if isinstance(obj, np.ndarray):
        obj = encode_array(obj)
    kind = type(obj)
    if kind is dict and all(type(v) in _SCALARS for v in obj.values()):
        out.append(packer.pack(obj))
    elif kind is list and all(type(v) in _SCALARS for v in obj):
        out.append(packer.pack(obj))
    elif isinstance(obj, Mapping):
        out.append(packer.pack_map_header(len(obj)))
        for key, value in obj.items():
            out.append(packer.pack(key))
            _pack(packer, value, out)
    elif isinstance(obj, (list, tuple)):
        out.append(packer.pack_array_header(len(obj)))
        for value in obj:
            _pack(packer, value, out)
    elif isinstance(obj, memoryview):
        out.append(_bin_header(obj.nbytes))
        out.append(obj)
    else:
        out.append(packer.pack(obj))


def _bin_header(n: int) -> bytes:
    """The msgpack ``bin 8/16/32`` header for ``n`` bytes (msgpack.Packer has no such call)."""
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    if n < 1 << 32:
        return struct.pack(">BI", 0xC6, n)
    raise WireError(f"an array of {n:,} bytes is too large for msgpack (at most 4 GiB)")


class PackedBody:
    """A msgpack message as pieces: iterate it (sync or async) to send it in slices.

    Re-iterable, so a request can be sent again; ``nbytes`` is its Content-Length.
    """

    def __init__(self, pieces: list[bytes | memoryview]) -> None:
        self.pieces = pieces
        self.nbytes = sum(memoryview(p).nbytes for p in pieces)

    def __iter__(self) -> Iterator[bytes | memoryview]:
        small = bytearray()
        for piece in self.pieces:
            view = memoryview(piece).cast("B")
            if view.nbytes < _JOIN_BELOW:  # join small pieces: few chunks
                small += view
                if len(small) >= _SLICE:
                    yield bytes(small)
                    small.clear()
                continue
            if small:
                yield bytes(small)
                small.clear()
            for start in range(0, view.nbytes, _SLICE):  # cut big ones
                yield view[start:start + _SLICE]
        if small:
            yield bytes(small)

    async def __aiter__(self) -> AsyncIterator[bytes | memoryview]:
        for chunk in self:
            yield chunk

    def join(self) -> bytes:
        return b"".join(self.pieces)


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension types are not allowed (got type {code})")


def _size_check(data: Any, max_bytes: int | None) -> int:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"a message must be bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if max_bytes is not None and size > max_bytes:
        raise WireError(f"message is {size} bytes, over the limit of {max_bytes}")
    return size


def unpackb(data: Any, *, max_bytes: int | None = None) -> Any:
    """Decode a msgpack message; wire arrays in it become numpy arrays (zero-copy).

    A map with ``dtype`` and ``data`` keys is taken as an array and validated
    strictly. ``max_bytes`` bounds the message and the arrays decoded from it.
    Malformed input of any kind raises ``WireError``.

    In a message of ``STREAM_BYTES`` or more, big arrays are read-only views of
    ``data`` itself (see ``_views``), which they keep alive; do not change
    ``data`` while they live.
    """
    size = _size_check(data, max_bytes)
    obj = None
    if size >= STREAM_BYTES:  # big: its arrays as views of ``data``, not copies
        view = memoryview(data)
        if view.c_contiguous:
            obj = unpack_views(view.cast("B"), max_str_len=MAX_STR_LEN, max_depth=MAX_DEPTH,
                               budget=max(64, size // _BYTES_PER_VIEWED_VALUE))
    if obj is not None:
        return _Decoder(max_bytes, _msgpack_array).walk(obj)
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext,
            max_str_len=min(size, MAX_STR_LEN), max_bin_len=size,
            max_array_len=size, max_map_len=size, max_ext_len=size,
        )
    except WireError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise WireError(f"malformed msgpack message: {type(e).__name__}: {e}") from e
    return _Decoder(max_bytes, _msgpack_array).walk(obj)


# The Python reader of ``_views`` costs about as much per value it reads as msgpack's
# C decoder costs per this many bytes it copies: a big message is read as views
# only while it is made of fewer values than its size over this (a batch of calls
# with a small array each, 2 MiB and 1,500 values, decoded 6x faster by the C
# decoder; a 256 MiB upload, a few values, still as views).
_BYTES_PER_VIEWED_VALUE = 8 << 10


def _msgpack_array(obj: Any, max_bytes: int | None) -> np.ndarray:
    return decode_array(obj, max_bytes=max_bytes)


class _Decoder:
    """Walk a decoded message, turning array maps into numpy arrays.

    Bounds nesting depth and the total bytes of all arrays, and rejects types no
    wire message carries (msgpack timestamps, for one). The walk keeps no path:
    the error names where it is, so only a message that fails is walked again,
    with one (a cached call's body decodes in a quarter of the time).
    """

    def __init__(self, max_bytes: int | None,
                 decode: Callable[[Any, int | None], np.ndarray]) -> None:
        self.budget = max_bytes
        self.decode = decode

    def walk(self, obj: Any) -> Any:
        budget = self.budget
        try:
            return self._walk(obj, 0)
        except WireError:
            self.budget = budget
            self._locate(obj, 0, "$")  # raises, naming where
            raise

    def _walk(self, obj: Any, depth: int) -> Any:
        # A decoder's output holds exact dicts, lists and scalars: ``type`` is enough.
        # Containers are changed in place (the decoder's own, fresh), and only their
        # containers and views are walked: a batch of calls is mostly scalars.
        if depth > MAX_DEPTH:
            raise WireError("too deep")
        kind = type(obj)
        if kind is dict:
            if "dtype" in obj and "data" in obj:
                return self._array(obj, "")
            for k, v in obj.items():  # values replaced, never keys: safe while iterating
                if type(v) not in _LEAVES:
                    obj[k] = self._walk(v, depth + 1)
            return obj
        if kind is list:
            for i, v in enumerate(obj):
                if type(v) not in _LEAVES:
                    obj[i] = self._walk(v, depth + 1)
            return obj
        if kind in _LEAVES:
            return obj
        if kind is memoryview:  # a big bin outside an array: bytes, as msgpack gives
            return bytes(obj)
        return self._locate(obj, depth, "")  # anything else: judged as _locate does

    def _locate(self, obj: Any, depth: int = 0, path: str = "$") -> Any:
        """The walk with the path of each value, for the error's message."""
        if depth > MAX_DEPTH:
            raise WireError(f"message nests deeper than {MAX_DEPTH} levels at {path}")
        if isinstance(obj, np.ndarray):  # decoded by the walk before it failed
            if self.budget is not None:
                self.budget -= obj.nbytes
            return obj
        if isinstance(obj, dict):
            if is_array(obj):
                return self._array(obj, path)
            return {k: self._locate(v, depth + 1, f"{path}.{k}") for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._locate(v, depth + 1, f"{path}[{i}]") for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        if isinstance(obj, memoryview):
            return bytes(obj)
        raise WireError(f"unsupported value of type {type(obj).__name__} at {path}")

    def _array(self, obj: Any, path: str) -> np.ndarray:
        try:
            arr = self.decode(obj, self.budget)
        except WireError as e:
            raise WireError(f"{path}: {e}") from None
        except (TypeError, ValueError, OverflowError, MemoryError) as e:
            # A safety net: decoders promise WireError for any bad input.
            raise WireError(f"{path}: cannot decode array: {e}") from e
        if self.budget is not None:
            self.budget -= arr.nbytes
        return arr


# What a decoded message holds that the walk leaves as it is.
_LEAVES = frozenset({bool, int, float, str, bytes, type(None)})


# --------------------------------------------------------------------------- JSON


def to_json_array(a: Any) -> dict[str, Any]:
    """Encode an array as ``{"dtype", "shape", "data": nested lists}`` for JSON.

    Floats of every width become Python floats (exact), complex numbers
    ``[re, im]``, bools ``true/false``. A 0-d array's ``data`` is a bare number.
    """
    arr = np.asarray(a)
    name = dtype_name(arr.dtype)
    kind = arr.dtype.kind
    if kind == "c":
        data = np.stack([arr.real, arr.imag], axis=-1).astype(np.float64).tolist()
    elif kind == "b":
        data = arr.astype(bool).tolist()
    elif kind in "iu" or name in _INT4:
        data = arr.astype(np.uint64 if kind == "u" else np.int64).tolist()
    else:  # float16/32/64, bfloat16, float8 kinds (kind "V" or "f")
        data = arr.astype(np.float64).tolist()
    return {"dtype": name, "shape": [int(d) for d in arr.shape], "data": data}


def from_json_array(obj: Any, *, max_bytes: int | None = None) -> np.ndarray:
    """Decode a JSON array map whose ``data`` is base64 or nested lists.

    Nested lists must match ``shape`` exactly (no ragged lists, no broadcasting).
    """
    obj = _check_keys(obj)
    dtype = dtype_from_name(obj["dtype"])
    shape = _check_shape(obj["shape"])
    data = obj["data"]
    if isinstance(data, str):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise WireError(f"array data is a string but not valid base64: {e}") from None
        return decode_array({"dtype": dtype.name, "shape": list(shape), "data": raw},
                            max_bytes=max_bytes)
    _nbytes(shape, dtype, max_bytes)
    leaves = _flatten(data, shape)
    return _leaves_to_array(leaves, dtype).reshape(shape)


def _flatten(data: Any, shape: tuple[int, ...]) -> list[Any]:
    """The leaves of nested lists ``data`` after checking they have exactly ``shape``."""
    level = [data]
    for axis, d in enumerate(shape):
        nxt: list[Any] = []
        for x in level:
            if not isinstance(x, list) or len(x) != d:
                got = f"a list of {len(x)}" if isinstance(x, list) else type(x).__name__
                raise WireError(f"array data does not match shape {list(shape)}: "
                                f"axis {axis} expects a list of {d}, got {got}")
            nxt.extend(x)
        level = nxt
    return level


def _leaves_to_array(leaves: list[Any], dtype: np.dtype) -> np.ndarray:
    kind, name = dtype.kind, dtype.name
    if kind == "b":
        if not all(x is True or x is False or (type(x) is int and x in (0, 1)) for x in leaves):
            raise WireError("bool array data must hold true/false (or 0/1)")
        return np.array(leaves, dtype=bool)
    if kind in "iu" or name in _INT4:
        return _int_array(leaves, dtype)
    if kind == "c":
        return np.array([_complex(x) for x in leaves], dtype=dtype)
    # Exactly int and float (what JSON parsers give): the set is C-speed, the check
    # below, which also takes their subclasses (never bool), ten times slower.
    if not set(map(type, leaves)) <= _REAL and not all(_is_real(x) for x in leaves):
        raise WireError(f"{name} array data must hold numbers")
    try:
        return np.array(leaves, dtype=np.float64).astype(dtype)
    except OverflowError as e:
        raise WireError(f"{name} array data holds a number too large: {e}") from None


_REAL = frozenset({int, float})


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int_array(leaves: list[Any], dtype: np.dtype) -> np.ndarray:
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in leaves):
        raise WireError(f"{dtype.name} array data must hold integers")
    info = _INT4.get(dtype.name) or np.iinfo(dtype)
    if leaves and (min(leaves) < int(info.min) or max(leaves) > int(info.max)):
        raise WireError(f"{dtype.name} array data must lie in [{info.min}, {info.max}]")
    wide = np.int64 if int(info.min) < 0 else np.uint64
    return np.array(leaves, dtype=wide).astype(dtype)


def _complex(x: Any) -> complex:
    if _is_real(x):
        return complex(x)
    if isinstance(x, list) and len(x) == 2 and all(_is_real(v) for v in x):
        return complex(x[0], x[1])
    raise WireError(f"complex array data must hold [re, im] pairs, got {x!r:.50}")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) or (
        hasattr(obj, "__array__") and hasattr(obj, "dtype") and hasattr(obj, "shape")
    ):
        return to_json_array(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def dumps_json(obj: Any) -> bytes:
    """JSON-encode ``obj`` (UTF-8); numpy arrays anywhere in it become nested-list arrays.

    Non-finite floats are written as ``NaN``/``Infinity``, as Python's json does.
    """
    try:
        return json.dumps(obj, default=_json_default, separators=(",", ":")).encode()
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode message as JSON: {e}") from e


def loads_json(data: Any, *, max_bytes: int | None = None,
               parse: Callable[[bytes], Any] = json.loads) -> Any:
    """Decode a JSON message; array maps in it (base64 or nested lists) become numpy arrays.

    ``parse``: the JSON parser (``json.loads``; the server passes a faster one that
    gives the same values).
    """
    if isinstance(data, str):
        data = data.encode()
    _size_check(data, max_bytes)
    try:
        obj = parse(bytes(data))
    except (ValueError, RecursionError) as e:
        raise WireError(f"malformed JSON message: {e}") from None
    return _Decoder(max_bytes, _json_array).walk(obj)


def _json_array(obj: Any, max_bytes: int | None) -> np.ndarray:
    return from_json_array(obj, max_bytes=max_bytes)
