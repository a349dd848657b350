"""``Aval``: the shape and dtype of an array, without its data."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jitserve.wire._dtypes import DTYPES, WireError, dtype_from_name, dtype_name

__all__ = ["Aval", "Dim"]

#: One axis: an ``int`` when known; ``None`` (a raw StableHLO ``?``) or a ``str``
#: (a jax.export symbolic dimension such as ``"b"`` or ``"2*b"``) when it is only
#: known once concrete inputs arrive.
Dim = int | str | None


@dataclasses.dataclass(frozen=True)
class Aval:
    """The abstract value of one array; construction checks it (``WireError``).

    Attributes:
      shape: one entry per axis: an ``int`` size, or ``None``/``str`` when dynamic.
      dtype: the numpy name of the element type (``"float32"``, ``"bfloat16"``).
      weak_type: jax's weak-typing bit; part of the cache key, not of the data.

    >>> str(Aval((2, None), "float32"))
    'float32[2,?]'
    """

    shape: tuple[Dim, ...]
    dtype: str
    weak_type: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise WireError(f"unsupported dtype {self.dtype!r:.100}; expected one of {sorted(DTYPES)}")
        for d in self.shape:
            if isinstance(d, bool) or not (d is None or isinstance(d, (int, str))):
                raise WireError(f"bad dimension {d!r:.100} in shape {self.shape!r:.200}")
            if isinstance(d, int) and d < 0:
                raise WireError(f"negative dimension {d} in shape {self.shape!r:.200}")

    def __hash__(self) -> int:
        # Kept once worked out: calls look executables up by their inputs' avals.
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.shape, self.dtype, self.weak_type))
        return h

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # Kept once worked out (an aval never changes): a server reads an executable's
    # output avals' sizes on every call.
    @functools.cached_property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    @functools.cached_property
    def size(self) -> int:
        """Elements of a static aval; -1 when a dimension is dynamic."""
        return math.prod(self.shape) if self.is_static else -1  # type: ignore[arg-type]

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of a static aval; packed sub-byte types round up per element."""
        return self.size * dtype_from_name(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype}
        if self.weak_type:
            out["weak_type"] = True
        return out

    @classmethod
    def from_json(cls, obj: Any) -> Aval:
        """Parse ``{"shape": [...], "dtype": str, "weak_type"?: bool}``; untrusted input."""
        if not isinstance(obj, Mapping) or "shape" not in obj or "dtype" not in obj:
            raise WireError(f"an aval is {{'shape': [...], 'dtype': str}}, got {obj!r:.200}")
        shape = obj["shape"]
        if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)):
            raise WireError(f"shape must be a list, got {shape!r:.200}")
        return cls(tuple(shape), obj["dtype"], bool(obj.get("weak_type", False)))

    @classmethod
    def of(cls, x: Any) -> Aval:
        """The aval of an ``Aval``, a mapping, or anything with ``shape`` and ``dtype``."""
        if isinstance(x, Aval):
            return x
        if isinstance(x, Mapping):
            return cls.from_json(x)
        weak = getattr(x, "weak_type", getattr(getattr(x, "aval", None), "weak_type", False))
        return cls(tuple(int(d) for d in x.shape), dtype_name(x.dtype), bool(weak))

    def matches(self, concrete: Aval) -> bool:
        """Whether ``concrete`` (static) fits this (possibly dynamic) aval."""
        if self.dtype != concrete.dtype or len(self.shape) != len(concrete.shape):
            return False
        return all(not isinstance(d, int) or d == c for d, c in zip(self.shape, concrete.shape))

    def __str__(self) -> str:
        dims = ",".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"
