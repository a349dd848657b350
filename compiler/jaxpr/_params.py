"""Typed codecs for the params of jaxpr equations.

A JAX equation's params are Python objects: ints, dtypes, enums, named tuples of
dimension numbers, nested jaxprs. The document spells each as plain data, and
every param of every allowed primitive has a codec here that turns exactly one
spelling back into the object JAX expects, or raises ``BadParam`` saying what
was wrong. There is no fallback: a value no codec accepts is refused, so a
document can never smuggle in an object of a type its schema did not name.

A codec is a callable ``(value, ctx) -> object``; ``ctx`` decodes nested
jaxprs on the decoder's behalf (counting them against the limits) and names
dtypes. Codecs that need JAX's own types live in ``_prims``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from jitserve.compiler.errors import shorten

__all__ = ["BadParam", "Codec", "DecodeCtx", "Param", "REQUIRED"]

# Bounds for plain integers in params: anything outside int64 is never a valid
# size, axis or count, and would overflow the C++ side.
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


class BadParam(Exception):
    """A param value its codec does not accept; the message says why."""


class DecodeCtx(Protocol):
    """What codecs need from the decoder."""

    max_rank: int
    max_unroll: int

    def jaxpr(self, doc: Any, label: str) -> Any: ...

    def dtype(self, name: Any) -> Any: ...


Codec = Callable[[Any, DecodeCtx], Any]
_T = TypeVar("_T")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


class Param:
    """One param of a primitive: its codec, and its default when the document omits it.

    A default that is a string is in the document's spelling (an enum name) and
    goes through the codec; any other default is used as it is.
    """

    __slots__ = ("codec", "default")

    def __init__(self, codec: Codec, default: Any = REQUIRED) -> None:
        self.codec, self.default = codec, default


# -- scalars -------------------------------------------------------------------


def INT(v: Any, ctx: DecodeCtx) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadParam(f"expected an integer, got {shorten(v, 60)}")
    if not _INT_MIN <= v <= _INT_MAX:
        raise BadParam(f"{v} does not fit int64")
    return v


def NAT(v: Any, ctx: DecodeCtx) -> int:
    n = INT(v, ctx)
    if n < 0:
        raise BadParam(f"expected a non-negative integer, got {n}")
    return n


def BOOL(v: Any, ctx: DecodeCtx) -> bool:
    if not isinstance(v, bool):
        raise BadParam(f"expected true or false, got {shorten(v, 60)}")
    return v


def STR(v: Any, ctx: DecodeCtx) -> str:
    if not isinstance(v, str) or len(v) > 256:
        raise BadParam(f"expected a string of at most 256 characters, got {shorten(v, 60)}")
    return v


def NONE(v: Any, ctx: DecodeCtx) -> None:
    # Shardings, layouts, meshes: only the default ("let the compiler choose")
    # is in scope, spelled null.
    if v is not None:
        raise BadParam(f"only null (the default) is supported, got {shorten(v, 60)}")
    return None


_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def FLOAT(v: Any, ctx: DecodeCtx) -> float:
    if isinstance(v, str) and v in _SPECIAL:
        return _SPECIAL[v]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadParam(f"expected a number, got {shorten(v, 60)}")
    try:
        return float(v)
    except OverflowError:
        raise BadParam(f"{v} does not fit a float") from None


def NUMBER(v: Any, ctx: DecodeCtx) -> int | float | complex | bool:
    """A scalar of any kind: bool, int, float (or 'nan'/'inf'/'-inf'), or [re, im]."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return INT(v, ctx)
    if isinstance(v, list) and len(v) == 2:
        return complex(FLOAT(v[0], ctx), FLOAT(v[1], ctx))
    return FLOAT(v, ctx)


def opt(codec: Codec) -> Codec:
    """``null`` or what ``codec`` accepts."""
    def decode(v: Any, ctx: DecodeCtx) -> Any:
        return None if v is None else codec(v, ctx)
    return decode


def one_of(*codecs: Codec) -> Codec:
    """The first of ``codecs`` that accepts the value."""
    def decode(v: Any, ctx: DecodeCtx) -> Any:
        errors = []
        for codec in codecs:
            try:
                return codec(v, ctx)
            except BadParam as e:
                errors.append(str(e))
        raise BadParam(" / ".join(errors))
    return decode


def tuple_of(codec: Callable[[Any, DecodeCtx], _T], *, length: int | None = None,
             max_length: int = 1 << 16) -> Callable[[Any, DecodeCtx], tuple[_T, ...]]:
    """A list of values, each decoded by ``codec``, as a tuple."""
    def decode(v: Any, ctx: DecodeCtx) -> tuple[_T, ...]:
        if not isinstance(v, list):
            raise BadParam(f"expected a list, got {shorten(v, 60)}")
        if length is not None and len(v) != length:
            raise BadParam(f"expected a list of {length}, got {len(v)} items")
        if len(v) > max_length:
            raise BadParam(f"a list of {len(v)} items is longer than {max_length}")
        out: list[_T] = []
        for i, item in enumerate(v):
            try:
                out.append(codec(item, ctx))
            except BadParam as e:
                raise BadParam(f"item {i}: {e}") from None
        return tuple(out)
    return decode


def enum_of(cls: type[enum.Enum], allowed: tuple[str, ...] | None = None) -> Codec:
    """An enum member, spelled by its name (``"HIGHEST"``)."""
    names = tuple(allowed if allowed is not None else cls.__members__)

    def decode(v: Any, ctx: DecodeCtx) -> enum.Enum:
        if not isinstance(v, str) or v not in names:
            raise BadParam(f"expected one of {list(names)}, got {shorten(v, 60)}")
        return cls[v]
    return decode


def record(make: Callable[..., Any], fields: Mapping[str, Codec]) -> Codec:
    """An object with exactly ``fields``, each decoded, passed to ``make``."""
    def decode(v: Any, ctx: DecodeCtx) -> Any:
        if not isinstance(v, Mapping):
            raise BadParam(f"expected an object with {sorted(fields)}, got {shorten(v, 60)}")
        if set(v) != set(fields):
            raise BadParam(f"expected exactly the fields {sorted(fields)}, got {sorted(map(str, v))}")
        out = {}
        for name, codec in fields.items():
            try:
                out[name] = codec(v[name], ctx)
            except BadParam as e:
                raise BadParam(f"field {name!r}: {e}") from None
        return make(**out)
    return decode


def DTYPE(v: Any, ctx: DecodeCtx) -> Any:
    return ctx.dtype(v)


def AXES(v: Any, ctx: DecodeCtx) -> tuple[int, ...]:
    return tuple_of(NAT, max_length=ctx.max_rank)(v, ctx)


def SHAPE(v: Any, ctx: DecodeCtx) -> tuple[int, ...]:
    return tuple_of(NAT, max_length=ctx.max_rank)(v, ctx)


def PAIRS(v: Any, ctx: DecodeCtx) -> tuple[tuple[int, ...], ...]:
    """Low/high padding per axis: ``[[lo, hi], ...]``."""
    return tuple_of(tuple_of(INT, length=2), max_length=ctx.max_rank)(v, ctx)


def TRIPLES(v: Any, ctx: DecodeCtx) -> tuple[tuple[int, ...], ...]:
    """``lax.pad``'s config: ``[[lo, hi, interior], ...]``."""
    return tuple_of(tuple_of(INT, length=3), max_length=ctx.max_rank)(v, ctx)


# -- nested programs ---------------------------------------------------------------


def closed_jaxpr(label: str) -> Codec:
    """A nested jaxpr document; errors inside it are labelled ``"<primitive> <label>"``.

    Every nested jaxpr in a document is closed (carries its own consts); params
    that JAX keeps as an open jaxpr plus a consts tuple are split afterwards.
    """
    def decode(v: Any, ctx: DecodeCtx) -> Any:
        return ctx.jaxpr(v, label)
    return decode


def closed_jaxprs(label: str) -> Codec:
    """A list of closed jaxprs (``cond`` branches), labelled ``"<label> <i>"``."""
    def decode(v: Any, ctx: DecodeCtx) -> tuple[Any, ...]:
        if not isinstance(v, list) or not v:
            raise BadParam(f"expected a non-empty list of jaxprs, got {shorten(v, 60)}")
        return tuple(ctx.jaxpr(item, f"{label} {i}") for i, item in enumerate(v))
    return decode
