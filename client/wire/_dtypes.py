"""The dtype table: every element type jitserve moves, by its numpy name."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["DTYPES", "WireError", "dtype_from_name", "dtype_name"]


class WireError(ValueError):
    """A message, array or aval that does not follow the wire format; the text says why."""


# ml_dtypes supplies the kinds numpy lacks; a kind the installed ml_dtypes does not
# know is left out rather than guessed.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
        "uint64", "float16", "float32", "float64", "complex64", "complex128",
    )
}
DTYPES.update(
    {
        name: np.dtype(getattr(ml_dtypes, name))
        for name in (
            "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz",
            "float8_e5m2", "float8_e5m2fnuz", "float8_e4m3", "float8_e3m4",
            "float8_e8m0fnu", "int4", "uint4",
        )
        if hasattr(ml_dtypes, name)
    }
)


def dtype_from_name(name: Any) -> np.dtype:
    """The numpy dtype called ``name`` (``"bfloat16"`` -> ``ml_dtypes.bfloat16``)."""
    if not isinstance(name, str):
        raise WireError(f"dtype must be a string naming one of {sorted(DTYPES)}, got {name!r:.100}")
    try:
        return DTYPES[name]
    except KeyError:
        raise WireError(f"unsupported dtype {name!r:.100}; expected one of {sorted(DTYPES)}") from None


def dtype_name(dtype: Any) -> str:
    """The wire name of a numpy, ml_dtypes or jax dtype (byte order is ignored)."""
    try:
        return _NAMES[dtype]  # numpy builds ``dtype.name`` anew each time: 5 us
    except (KeyError, TypeError):  # TypeError: an unhashable spec
        pass
    if dtype is None:  # np.dtype(None) would quietly mean float64
        raise WireError("not a dtype: None")
    try:
        name: str = np.dtype(dtype).name
    except (TypeError, ValueError) as e:
        raise WireError(f"not a dtype: {dtype!r:.100}") from e
    if name not in DTYPES:
        raise WireError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}")
    if isinstance(dtype, np.dtype):  # a bounded set of keys
        _NAMES[dtype] = name
    return name


_NAMES: dict[Any, str] = {}
