"""Abstract values: the shape and dtype of an array, without its data.

A dimension is an ``int`` when known; ``None`` (a raw StableHLO ``?``) or a
``str`` (a jax.export symbolic dimension such as ``"b"`` or ``"2*b"``) when it is
only known once concrete inputs arrive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from client import wire

from compiler.errors import SignatureMismatch

__all__ = ["Aval", "DTYPES", "dtype_of", "dtype_name"]

Dim = int | str | None

# Every dtype jitserve moves, by its numpy name: the wire codec's table, so the
# compiler and the wire can never disagree on what an array may be.
DTYPES: dict[str, np.dtype] = wire.DTYPES


def dtype_of(name: str) -> np.dtype:
    """The numpy dtype called ``name``; a ``SignatureMismatch`` naming it if unknown."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise SignatureMismatch(
            f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}"
        ) from None


def dtype_name(dtype: Any) -> str:
    """The jitserve name of a numpy (or jax) dtype."""
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise SignatureMismatch(f"unsupported dtype {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class Aval:
    """The abstract value of one array.

    Attributes:
      shape: one entry per axis: an ``int`` size, or ``None``/``str`` when dynamic.
      dtype: the numpy name of the element type (``"float32"``, ``"bfloat16"``).
      weak_type: jax's weak-typing bit; part of the cache key, not of the data.
    """

    shape: tuple[Dim, ...]
    dtype: str
    weak_type: bool = False

    def __post_init__(self) -> None:
        dtype_of(self.dtype)
        for d in self.shape:
            if isinstance(d, bool) or not (d is None or isinstance(d, (int, str))):
                raise SignatureMismatch(f"bad dimension {d!r} in shape {self.shape}")
            if isinstance(d, int) and d < 0:
                raise SignatureMismatch(f"negative dimension {d} in shape {self.shape}")

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=object)) if self.is_static else -1

    @property
    def nbytes(self) -> int:
        """Bytes of a static aval; packed sub-byte types round up per element."""
        return self.size * dtype_of(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype}
        if self.weak_type:
            out["weak_type"] = True
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Aval:
        """Parse ``{"shape": [...], "dtype": str, "weak_type"?: bool}``; untrusted input."""
        if not isinstance(obj, Mapping) or "shape" not in obj or "dtype" not in obj:
            raise SignatureMismatch(f"an aval is {{'shape': [...], 'dtype': str}}, got {obj!r:.200}")
        shape = obj["shape"]
        if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)):
            raise SignatureMismatch(f"shape must be a list, got {shape!r:.200}")
        return cls(tuple(shape), obj["dtype"], bool(obj.get("weak_type", False)))

    @classmethod
    def of(cls, x: Any) -> Aval:
        """The aval of a concrete array (numpy or jax)."""
        return cls(tuple(int(d) for d in x.shape), dtype_name(x.dtype),
                   bool(getattr(getattr(x, "aval", None), "weak_type", False)))

    def matches(self, concrete: Aval) -> bool:
        """Whether ``concrete`` (static) fits this (possibly dynamic) aval."""
        if self.dtype != concrete.dtype or len(self.shape) != len(concrete.shape):
            return False
        return all(not isinstance(d, int) or d == c for d, c in zip(self.shape, concrete.shape))

    def __str__(self) -> str:
        dims = ",".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"
