"""Plain-data pieces of the jaxpr document: bytes to a tree, arrays, scalars.

Everything here reads untrusted input. Nothing is unpickled, imported or
evaluated: JSON and msgpack give dicts, lists, strings, numbers and bytes, and
this module turns only those into numpy values, checking every size first.

Arrays use the wire codec of ``docs/api.md`` (``client.wire``, shared with
execute requests): ``{"dtype", "shape", "data"}`` with ``data`` as
little-endian C-order bytes (msgpack), a base64 string, or nested lists of
numbers (hand-written JSON).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from jitserve import wire
from jitserve.compiler.errors import InvalidProgram, LimitExceeded, shorten
from jitserve.wire import DTYPES

__all__ = [
    "check_keys",
    "decode_array",
    "decode_scalar",
    "parse_document_bytes",
    "require",
]

_ARRAY_KEYS = frozenset({"dtype", "shape", "data"})

# Non-finite floats have no JSON number; both encodings spell them as strings.
_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def parse_document_bytes(data: bytes, *, max_bytes: int) -> Any:
    """JSON or msgpack bytes to a tree; JSON is told apart by a leading ``{``."""
    if len(data) > max_bytes:
        raise LimitExceeded(f"jaxpr document is {len(data)} bytes; the limit is {max_bytes}")
    try:
        if data.lstrip()[:1] == b"{":
            return json.loads(data)
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except RecursionError:
        raise LimitExceeded("jaxpr document is nested too deeply to parse") from None
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise InvalidProgram(f"jaxpr document is neither JSON nor msgpack: {e}") from None


def require(obj: Any, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    """``obj`` if it is a ``kind``, else an ``InvalidProgram`` naming ``where``."""
    if not isinstance(obj, kind) or (kind is int and isinstance(obj, bool)):
        raise InvalidProgram(f"{where}: {what} must be {_kind_name(kind)}, got {shorten(obj)}")
    return obj


def check_keys(obj: Any, where: str, *, required: frozenset[str],
               optional: frozenset[str] = frozenset()) -> Mapping[str, Any]:
    """``obj`` as a mapping with exactly the ``required`` keys and some ``optional`` ones."""
    mapping: Mapping[str, Any] = require(obj, Mapping, where, "this")
    missing = required - mapping.keys()
    if missing:
        raise InvalidProgram(f"{where}: missing {sorted(missing)}")
    extra = mapping.keys() - required - optional
    if extra:
        raise InvalidProgram(f"{where}: unknown field(s) {sorted(map(str, extra))[:5]}; "
                             f"expected {sorted(required | optional)}")
    return mapping


def wire_dtype(name: Any, where: str) -> np.dtype:
    """The numpy dtype of a wire dtype name (no PRNG key types)."""
    if not isinstance(name, str) or name not in DTYPES:
        raise InvalidProgram(f"{where}: unknown dtype {shorten(name)}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def decode_shape(shape: Any, where: str, *, max_rank: int, max_elements: int) -> tuple[int, ...]:
    """A static shape: a list of non-negative ints within the limits."""
    require(shape, list, where, "shape")
    if len(shape) > max_rank:
        raise LimitExceeded(f"{where}: rank {len(shape)} exceeds the limit of {max_rank}")
    dims = tuple(require(d, int, where, "a dimension") for d in shape)
    if any(d < 0 for d in dims):
        raise InvalidProgram(f"{where}: negative dimension in shape {list(dims)}")
    size = math.prod(dims)
    if size > max_elements:
        raise LimitExceeded(f"{where}: shape {list(dims)} has {size} elements; the limit is {max_elements}")
    return dims


def decode_array(obj: Any, where: str, *, max_elements: int, max_rank: int) -> np.ndarray:
    """An ``{"dtype", "shape", "data"}`` map to a numpy array (a private, writable copy).

    The size is checked against the limits before any data is touched; the data
    itself is decoded by the shared wire codec (``client.wire``), so documents
    spell arrays exactly as execute requests do.
    """
    check_keys(obj, where, required=_ARRAY_KEYS)
    wire_dtype(obj["dtype"], where)
    decode_shape(obj["shape"], where, max_rank=max_rank, max_elements=max_elements)
    try:
        if isinstance(obj["data"], (bytes, bytearray, memoryview)):
            array = wire.decode_array(obj)
        else:
            array = wire.from_json_array(obj)
    except (wire.WireError, TypeError, ValueError, OverflowError) as e:
        raise InvalidProgram(f"{where}: {e}") from None
    # A copy: the constant outlives the request buffer it was read from.
    return np.array(array)


def decode_scalar(value: Any, dtype: np.dtype, where: str) -> Any:
    """One element of ``dtype`` from its JSON/msgpack spelling, range-checked."""
    kind = dtype.kind
    if kind == "b":
        return require(value, bool, where, "a bool value")
    if kind in "iu":
        return _int_in_range(value, dtype, where)
    if kind == "c":
        if isinstance(value, list):
            if len(value) != 2:
                raise InvalidProgram(f"{where}: a complex value is [re, im], got {shorten(value)}")
            return complex(_float(value[0], where), _float(value[1], where))
        return complex(_float(value, where), 0.0)
    return _float(value, where)


def _int_in_range(value: Any, dtype: np.dtype, where: str) -> int:
    n: int = require(value, int, where, f"a {dtype.name} value")
    lo, hi = _int_bounds(dtype)
    if not lo <= n <= hi:
        raise InvalidProgram(f"{where}: {n} is out of range for {dtype.name}")
    return n


def _int_bounds(dtype: np.dtype) -> tuple[int, int]:
    if dtype.name in ("int4", "uint4"):  # ml_dtypes' iinfo does not cover these everywhere
        return (-8, 7) if dtype.name == "int4" else (0, 15)
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _float(value: Any, where: str) -> float:
    if isinstance(value, str) and value in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidProgram(f"{where}: expected a number (or 'nan', 'inf', '-inf'), got {shorten(value)}")
    try:
        return float(value)
    except OverflowError:
        raise InvalidProgram(f"{where}: {value} does not fit a float") from None


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {Mapping: "an object", list: "a list", str: "a string", int: "an integer",
             bool: "a bool", float: "a number", bytes: "bytes"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)
