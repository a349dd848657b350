"""jitserve's serialized jaxpr: a declarative, versioned document a client may send instead of StableHLO.

JAX has no official jaxpr serialization, and unpickling one would let a client
run code on the server. This package decodes jitserve's own format (specified in
``docs/jaxpr-format.md``): plain JSON or msgpack data naming allowlisted
primitives, typed params, variables and array constants. Nothing in a document
is unpickled, imported or evaluated. Decoded programs are untrusted input
until they have passed this decoder, and even then only as far as its checks go:
the compile path still applies its own limits.

Example::

    from jitserve.wire import dtype_from_name
    from jitserve.compiler.jaxpr import decode_document

    decoded = decode_document(request_body)           # bytes or a parsed dict
    lowered = jax.jit(decoded.as_function(), keep_unused=True).lower(
        *[jax.ShapeDtypeStruct(a.shape, dtype_from_name(a.dtype)) for a in decoded.in_avals])

The client side (``client.jaxpr``) writes documents from a ``ClosedJaxpr`` or
from a function and example arguments; a caller without JAX can write one by
hand. The document's name and version (and the versioning rule) are the wire
contract's: ``jitserve.wire.JAXPR_FORMAT_NAME`` and ``JAXPR_FORMAT_VERSION``.

Internals, each imported only when a document is decoded (they need JAX):
``_document`` (the document as a whole), ``_decode`` (jaxprs, variables,
equations), ``_params`` (typed param codecs), ``_prims`` (the primitive
allowlist), ``_data`` (arrays and scalars); ``_limits`` holds ``JaxprLimits``.
"""

from jitserve.compiler.jaxpr._document import (
    DecodedJaxpr,
    decode_document,
    refused_primitives,
    supported_primitives,
)
from jitserve.compiler.jaxpr._limits import JaxprLimits

__all__ = [
    "DecodedJaxpr",
    "JaxprLimits",
    "decode_document",
    "refused_primitives",
    "supported_primitives",
]
