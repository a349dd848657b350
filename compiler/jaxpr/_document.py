"""The document as a whole: decode one into a ``DecodedJaxpr``; what the format allows.

``decode_document`` is the entry point (re-exported by ``compiler.jaxpr``, whose
docstring has an example); the decoding itself is ``_decode``'s, imported only
when a document arrives, since it needs JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jitserve.compiler.errors import InvalidProgram
from jitserve.compiler.jaxpr._limits import JaxprLimits
from jitserve.wire import (
    DTYPES,
    JAXPR_FORMAT_NAME,
    JAXPR_FORMAT_VERSION,
    JAXPR_MIN_SUPPORTED_VERSION,
    Aval,
)

__all__ = [
    "DecodedJaxpr",
    "decode_document",
    "refused_primitives",
    "supported_primitives",
]


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

    def as_function(self) -> Callable[..., list[Any]]:
        """A function of the flat inputs returning the list of flat outputs.

        It evaluates the jaxpr by binding its primitives, so ``jax.jit`` traces
        it into the same program the document describes::

            jax.jit(decoded.as_function(), keep_unused=True)(*arrays)
        """
        from jax.extend.core import jaxpr_as_fun

        fun: Callable[..., list[Any]] = jaxpr_as_fun(self.closed_jaxpr)
        return fun


def decode_document(data: bytes | bytearray | memoryview | Mapping[str, Any], *,
                    limits: JaxprLimits | None = None) -> DecodedJaxpr:
    """Decode and type-check a jaxpr document (untrusted input).

    Args:
      data: the document as JSON bytes, msgpack bytes (told apart by JSON's
        leading ``{``), or an already parsed mapping.
      limits: size bounds; ``JaxprLimits()`` when omitted. The compiler passes
        ``Limits.jaxpr`` (``compiler.safety``), which the server builds from its settings.

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
    from jitserve.compiler.jaxpr import _decode  # imported late: it needs JAX

    limits = limits or JaxprLimits()
    tree = _decode.parse(data, limits)
    version = _decode.check_header(tree, JAXPR_FORMAT_NAME, JAXPR_MIN_SUPPORTED_VERSION,
                                   JAXPR_FORMAT_VERSION)
    closed = _decode.rebuild(tree["jaxpr"], limits)
    return DecodedJaxpr(closed, _top_avals(closed.in_avals, "input"),
                        _top_avals(closed.out_avals, "output"), version)


def _top_avals(avals: Sequence[Any], what: str) -> tuple[Aval, ...]:
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
    from jitserve.compiler.jaxpr._prims import SPECS

    return {name: tuple(sorted(spec.params)) for name, spec in sorted(SPECS.items())}


def refused_primitives() -> dict[str, str]:
    """Primitives JAX exports that the decoder refuses, each with the reason."""
    from jitserve.compiler.jaxpr._prims import REFUSED

    return dict(sorted(REFUSED.items()))

