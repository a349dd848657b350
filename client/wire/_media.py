"""Media types, and the format constants both sides of the API name."""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "JAXPR_FORMAT_NAME",
    "JAXPR_FORMAT_VERSION",
    "JAXPR_MIN_SUPPORTED_VERSION",
    "JSON",
    "MSGPACK",
    "MSGPACK_TYPES",
    "OCTET_STREAM",
    "ProgramFormat",
    "TierName",
]

MSGPACK: Final = "application/msgpack"
JSON: Final = "application/json"
OCTET_STREAM: Final = "application/octet-stream"
#: Content types read as msgpack (the registered name and the common variants).
MSGPACK_TYPES: Final = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")


class ProgramFormat(enum.StrEnum):
    """The ``format`` of an upload (docs/api.md, "Programs")."""

    JAX_EXPORT = "jax_export"
    STABLEHLO = "stablehlo"
    JAXPR = "jaxpr"


#: The value of a jaxpr document's ``"format"`` field (docs/jaxpr-format.md).
JAXPR_FORMAT_NAME: Final = "jitserve.jaxpr"

# The jaxpr document version. Bump it on any change an older decoder would misread:
# a field renamed, removed or reinterpreted, a param's spelling changed, or a JAX
# upgrade that changes a primitive's params. Adding an optional field, a primitive,
# or a param with a default does not bump it.
#
# Compatibility window: a server decodes every version from
# JAXPR_MIN_SUPPORTED_VERSION to JAXPR_FORMAT_VERSION. After a bump, the previous
# version stays readable for at least six months (the minimum trails by one), so
# that clients can upgrade on their own schedule.
#
# 1 (2026-11-21): the first version, written against jax 0.10.2.
JAXPR_FORMAT_VERSION: Final = 1
JAXPR_MIN_SUPPORTED_VERSION: Final = 1


class TierName(enum.StrEnum):
    """Who answered a lookup: the ``tier`` of a compile or execute answer.

    ``memory`` is a loaded executable in the runtime (L1); ``disk`` and ``redis``
    are the serialized tiers (L2); ``compiled`` means XLA compiled it just now.
    """

    MEMORY = "memory"
    DISK = "disk"
    REDIS = "redis"
    COMPILED = "compiled"
