"""jitserve's serialized jaxpr: a declarative, versioned document a client may send instead of StableHLO.

JAX has no official jaxpr serialization, and unpickling one would let a client
run code on the server. This module decodes jitserve's own format (specified in
``docs/jaxpr-format.md``): plain JSON or msgpack data naming allowlisted
primitives, typed params, variables and array constants. Nothing in a document
is unpickled, imported or evaluated. Decoded programs are untrusted input
until they have passed this decoder, and even then only as far as its checks go:
the compile path still applies its own limits.

Example::

    from jitserve.wire import dtype_from_name
    from jitserve.compiler.jaxpr_format import decode_document

    decoded = decode_document(request_body)           # bytes or a parsed dict
    lowered = jax.jit(decoded.as_function(), keep_unused=True).lower(
        *[jax.ShapeDtypeStruct(a.shape, dtype_from_name(a.dtype)) for a in decoded.in_avals])

The client side (``client.jaxpr``) writes documents from a ``ClosedJaxpr`` or
from a function and example arguments; a caller without JAX can write one by
hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jitserve.compiler.errors import InvalidProgram
from jitserve.wire import (
    DTYPES,
    JAXPR_FORMAT_NAME,
    JAXPR_FORMAT_VERSION,
    JAXPR_MIN_SUPPORTED_VERSION,
    Aval,
)

__all__ = [
    "DecodedJaxpr",
    "JaxprLimits",
    "decode_document",
    "refused_primitives",
    "supported_primitives",
]

# The document's name and version (and the versioning rule) are the wire
# contract's: jitserve.wire.JAXPR_FORMAT_NAME and JAXPR_FORMAT_VERSION.


@dataclasses.dataclass(frozen=True)
class JaxprLimits:
    """Bounds on one document, so that a small upload cannot become a huge program.

    Exceeding any of them raises ``LimitExceeded`` naming the equation.

    Attributes:
      max_document_bytes: size of the encoded document.
      max_eqns: equations, counted over all nested jaxprs.
      max_depth: nesting of jaxprs inside params (a while inside a cond inside a scan...).
      max_vars: bound variables, counted over all nested jaxprs.
      max_literal_elements: elements of one constant array (consts and array params).
      max_array_elements: elements of any array the program names or computes,
        so that a broadcast or iota cannot ask for an absurd buffer.
      max_rank: axes of any array.
      max_unroll: the ``unroll`` of a scan, which copies the body at compile time.
    """

    max_document_bytes: int = 64 << 20
    max_eqns: int = 100_000
    max_depth: int = 32
    max_vars: int = 1_000_000
    max_literal_elements: int = 1 << 20
    max_array_elements: int = 1 << 32
    max_rank: int = 32
    max_unroll: int = 1024


@dataclasses.dataclass(frozen=True)
class DecodedJaxpr:
    """A jaxpr document rebuilt as a JAX program, type-checked by JAX's own checker.

    Attributes:
      closed_jaxpr: the program as a ``jax.extend.core.ClosedJaxpr``: flat
        array inputs, flat outputs, constants closed over; no effects.
      in_avals: the shape and dtype of each input, in order.
      out_avals: the shape and dtype of each output, in order.
      version: the format version the document was written in.
    """

    closed_jaxpr: Any
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...]
    version: int = JAXPR_FORMAT_VERSION

    def as_function(self) -> Callable[..., list]:
        """A function of the flat inputs returning the list of flat outputs.

        It evaluates the jaxpr by binding its primitives, so ``jax.jit`` traces
        it into the same program the document describes::

            jax.jit(decoded.as_function(), keep_unused=True)(*arrays)
        """
        from jax.extend.core import jaxpr_as_fun

        return jaxpr_as_fun(self.closed_jaxpr)


def decode_document(data: bytes | bytearray | memoryview | Mapping[str, Any], *,
                    limits: JaxprLimits | None = None) -> DecodedJaxpr:
    """Decode and type-check a jaxpr document (untrusted input).

    Args:
      data: the document as JSON bytes, msgpack bytes (told apart by JSON's
        leading ``{``), or an already parsed mapping.
      limits: size bounds; ``JaxprLimits()`` when omitted.

    Returns:
      the rebuilt program, checked by ``jax.core.check_jaxpr``.

    Raises:
      InvalidProgram: malformed document, unknown primitive or param, a param
        of the wrong type, an ill-typed equation, an undefined or redefined
        variable, an unsupported format version.
      UnsafeProgram: an effectful or host-side primitive.
      LimitExceeded: a document, nesting, equation count or array over its limit.

    Every message names where the problem is (``eqn 3 > while body > eqn 1 (add): ...``).
    """
    from jitserve.compiler import _jaxpr_decode

    limits = limits or JaxprLimits()
    tree = _jaxpr_decode.parse(data, limits)
    version = _jaxpr_decode.check_header(tree, JAXPR_FORMAT_NAME, JAXPR_MIN_SUPPORTED_VERSION,
                                            JAXPR_FORMAT_VERSION)
    closed = _jaxpr_decode.rebuild(tree["jaxpr"], limits)
    return DecodedJaxpr(closed, _top_avals(closed.in_avals, "input"),
                        _top_avals(closed.out_avals, "output"), version)


def _top_avals(avals: list, what: str) -> tuple[Aval, ...]:
    out = []
    for i, aval in enumerate(avals):
        name = str(aval.dtype)
        if name not in DTYPES:
            raise InvalidProgram(f"jaxpr {what} {i} is {aval.str_short()}; program {what}s must "
                                 f"have a wire dtype (pass PRNG keys as jax.random.key_data)")
        out.append(Aval(tuple(aval.shape), name, bool(aval.weak_type)))
    return tuple(out)


def supported_primitives() -> dict[str, tuple[str, ...]]:
    """Every primitive the decoder accepts, with the params it takes (sorted)."""
    from jitserve.compiler._jaxpr_prims import SPECS

    return {name: tuple(sorted(spec.params)) for name, spec in sorted(SPECS.items())}


def refused_primitives() -> dict[str, str]:
    """Primitives JAX exports that the decoder refuses, each with the reason."""
    from jitserve.compiler._jaxpr_prims import REFUSED

    return dict(sorted(REFUSED.items()))

