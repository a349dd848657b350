"""Tensors of the Open Inference Protocol: datatypes, JSON ``data`` and raw bytes.

The protocol names element types by its own datatypes; ``DATATYPES`` maps each
one jitserve runs to the wire's dtype name (``jitserve.wire.DTYPES``). Raw
tensors (the binary extension on REST, ``raw_input_contents`` on gRPC) are the
elements in row-major order, little-endian, with nothing between them; a
``BOOL`` is one byte, 0 or 1. Every conversion checks what the client sent
against what it declared (element counts, byte counts, value ranges) and
refuses with a ``BadRequest`` naming the tensor.

    >>> array = from_raw(b"\\x01\\x00\\x00\\x00", "INT32", [1], "input 'x'")
    >>> json_data(array).tolist()
    [1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jitserve import wire

from ..errors import BadRequest

__all__ = ["DATATYPES", "datatype_of", "dtype_of", "from_data", "from_raw", "json_data",
           "raw_bytes", "shape_of"]

#: v2 datatype -> the wire's dtype name. BYTES (strings) has no JAX counterpart.
DATATYPES: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
    "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "BF16": "bfloat16", "FP32": "float32", "FP64": "float64",
}
_BY_DTYPE = {dtype: datatype for datatype, dtype in DATATYPES.items()}

# JSON numbers (as numpy infers them) each datatype accepts: a float is no integer,
# and only true/false are BOOL.
_ACCEPTED_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "V": "iuf"}


def datatype_of(dtype: str) -> str | None:
    """The v2 datatype of the wire dtype ``dtype``, or ``None`` when v2 has none (complex, float8)."""
    return _BY_DTYPE.get(dtype)


def dtype_of(datatype: Any, where: str) -> np.dtype:
    """The numpy dtype of the v2 ``datatype``; ``BadRequest`` naming ``where`` if none."""
    name = DATATYPES.get(datatype) if isinstance(datatype, str) else None
    if name is None:
        raise BadRequest(f"{where}: datatype {datatype!r:.40} is not one jitserve runs; "
                         f"expected one of {', '.join(DATATYPES)}")
    return wire.dtype_from_name(name)


def shape_of(shape: Any, where: str) -> tuple[int, ...]:
    """``shape`` as a tuple of sizes; ``BadRequest`` unless it is a list of integers >= 0."""
    if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadRequest(f"{where}: shape must be a list of sizes >= 0, got {shape!r:.80}")
    if len(shape) > 64:
        raise BadRequest(f"{where}: shape has {len(shape)} dimensions, at most 64")
    return tuple(shape)


def from_data(data: Any, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    """The tensor whose elements are the JSON ``data`` (row-major; nested lists are
    flattened), as ``dtype`` in ``shape``."""
    if not isinstance(data, (list, np.ndarray)):
        raise BadRequest(f"{where}: data must be a list of the tensor's elements, row-major, "
                         f"got {type(data).__name__}")
    try:
        flat = np.asarray(data).reshape(-1)
    except (ValueError, TypeError, OverflowError):
        raise BadRequest(f"{where}: data must be a list of numbers (nested lists of equal "
                         "lengths at most)") from None
    count = math.prod(shape)
    if flat.size != count:
        raise BadRequest(f"{where}: data has {flat.size} elements, shape {list(shape)} "
                         f"needs {count}")
    if count == 0:
        return np.zeros(shape, dtype)
    if dtype.kind in "iu" and flat.dtype.kind in "fO":
        flat = _python_ints(data, flat, where)  # numpy reads ints past int64 as floats
    accepted = _ACCEPTED_KINDS.get(dtype.kind, "")
    if flat.dtype.kind not in accepted:
        want = {"b": "true or false", "iu": "integers", "iuf": "numbers"}[accepted]
        raise BadRequest(f"{where}: {datatype_of(dtype.name)} data must be {want}, "
                         f"got {_kind_name(flat.dtype)}")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = min(flat.tolist()), max(flat.tolist())  # Python ints: no overflow
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise BadRequest(f"{where}: {bad} is out of the range of "
                             f"{datatype_of(dtype.name)} ({info.min}..{info.max})")
        return np.array(flat.tolist(), dtype).reshape(shape)
    return flat.astype(dtype).reshape(shape)


def from_raw(raw: Any, datatype: str, shape: Sequence[int], where: str) -> np.ndarray:
    """The tensor in the raw bytes ``raw`` (a view of them, no copy)."""
    dtype = dtype_of(datatype, where)
    count = math.prod(shape)
    view = memoryview(raw).cast("B")
    if view.nbytes != count * dtype.itemsize:
        raise BadRequest(f"{where}: {view.nbytes} bytes of data, but a {datatype} tensor of "
                         f"shape {list(shape)} is {count * dtype.itemsize} bytes")
    if dtype.kind == "b":
        octets = np.frombuffer(view, np.uint8)
        if count and octets.max() > 1:
            raise BadRequest(f"{where}: a BOOL element is one byte, 0 or 1; got "
                             f"{int(octets.max())}")
    little = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
    return np.frombuffer(view, little).reshape(shape)


def json_data(array: np.ndarray) -> np.ndarray:
    """The elements of ``array``, row-major, as a flat array a JSON encoder writes as
    numbers (or booleans): BF16, which JSON encoders do not know, as float32."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.kind == "V" or flat.dtype.name == "bfloat16":  # ml_dtypes' kinds
        flat = flat.astype(np.float32)
    return flat


def raw_bytes(array: np.ndarray) -> memoryview:
    """The elements of ``array`` as raw tensor bytes (no copy when already contiguous)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.byteorder == ">":
        flat = flat.astype(flat.dtype.newbyteorder("<"))
    return flat.view(np.uint8).data


def _python_ints(data: Any, flat: np.ndarray, where: str) -> np.ndarray:
    """``data`` as Python ints in an int64 or uint64 array when they fit one (numpy
    infers float64 for ints past int64), else ``flat`` as it was."""
    try:
        ints = np.asarray(data, dtype=object).reshape(-1).tolist()
    except ValueError:
        return flat
    if not all(type(v) is int for v in ints):
        return flat
    if min(ints) >= 0 and max(ints) < 1 << 64:
        return np.array(ints, np.uint64)
    if -(1 << 63) <= min(ints) and max(ints) < 1 << 63:
        return np.array(ints, np.int64)
    bad = max(ints) if max(ints) >= 1 << 63 else min(ints)
    raise BadRequest(f"{where}: {bad} is out of the range of every integer datatype")


def _kind_name(dtype: np.dtype) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "fractional numbers",
            "U": "strings", "S": "strings", "O": "mixed or non-numeric values"}.get(
                dtype.kind, dtype.name)
