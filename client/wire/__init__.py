"""The contract the client and the service share: ``jitserve.wire``.

Both sides of the API import this, and it imports only numpy, msgpack and
ml_dtypes (no httpx, no jax), so the server core never pulls in the SDK:

- the array codec (``packb``/``unpackb``, ``dumps_json``/``loads_json``,
  ``encode_array``/``decode_array``) and ``WireError``;
- ``Aval`` and the dtype table (``DTYPES``);
- media types (``MSGPACK``, ``JSON``) and the program formats;
- the error codes with their HTTP statuses, and the statuses of a future;
- the jaxpr document's format constants and the cache-tier names;
- future ids' replica prefix (``replica_of``) and the header that names a replica.

Everything that decodes takes untrusted input and raises ``WireError`` (a
``ValueError``) naming the problem, never evaluating or unpickling anything.

Example::

    >>> import numpy as np
    >>> from jitserve import wire
    >>> wire.unpackb(wire.packb({"args": [np.arange(3, dtype=np.float32)]}))["args"][0]
    array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

from jitserve.wire._aval import Aval, Dim
from jitserve.wire._codec import (
    INLINE_OUTPUTS_BYTES,
    MAX_DEPTH,
    MAX_RANK,
    SMALL_OUTPUT_BYTES,
    STREAM_BYTES,
    PackedBody,
    carried_outputs,
    decode_array,
    dumps_json,
    encode_array,
    from_json_array,
    is_array,
    is_future_ref,
    loads_json,
    pack_pieces,
    packb,
    to_json_array,
    unpackb,
)
from jitserve.wire._codes import ERROR_STATUS, PROGRAM_ERRORS, ErrorCode, FutureStatus
from jitserve.wire._dtypes import DTYPES, WireError, dtype_from_name, dtype_name
from jitserve.wire._ids import REPLICA_HEADER, REPLICA_ID_HEX, replica_of, replicas_of
from jitserve.wire._media import (
    JAXPR_FORMAT_NAME,
    JAXPR_FORMAT_VERSION,
    JAXPR_MIN_SUPPORTED_VERSION,
    JAXPR_PRIMITIVES,
    JSON,
    MSGPACK,
    MSGPACK_TYPES,
    OCTET_STREAM,
    ProgramFormat,
    TierName,
)

__all__ = [
    "Aval",
    "DTYPES",
    "Dim",
    "ERROR_STATUS",
    "ErrorCode",
    "FutureStatus",
    "INLINE_OUTPUTS_BYTES",
    "JAXPR_FORMAT_NAME",
    "JAXPR_FORMAT_VERSION",
    "JAXPR_MIN_SUPPORTED_VERSION",
    "JAXPR_PRIMITIVES",
    "JSON",
    "MAX_DEPTH",
    "MAX_RANK",
    "MSGPACK",
    "MSGPACK_TYPES",
    "OCTET_STREAM",
    "PROGRAM_ERRORS",
    "PackedBody",
    "ProgramFormat",
    "REPLICA_HEADER",
    "REPLICA_ID_HEX",
    "SMALL_OUTPUT_BYTES",
    "STREAM_BYTES",
    "TierName",
    "WireError",
    "carried_outputs",
    "decode_array",
    "dtype_from_name",
    "dtype_name",
    "dumps_json",
    "encode_array",
    "from_json_array",
    "is_array",
    "is_future_ref",
    "loads_json",
    "pack_pieces",
    "packb",
    "replica_of",
    "replicas_of",
    "to_json_array",
    "unpackb",
]
