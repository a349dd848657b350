"""The cache key: a sha256 over a named list of parts.

Each part is logged at debug level, so that a miss can be explained by diffing
two logs. The key is also the ``executable_id`` the API reports.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence

import jax
import jaxlib

from jitserve.wire import Aval

__all__ = ["KEY_SCHEMA_VERSION", "cache_key", "key_parts"]

logger = logging.getLogger("jitserve.compiler.keys")

# Bump when anything that goes into an executable changes meaning.
# 2026-11-21: 1, first schema.
KEY_SCHEMA_VERSION = 1

# Options every compile uses (compiler.compile); they are part of the key.
COMPILE_OPTIONS = "num_replicas=1;num_partitions=1;x64=1"


def key_parts(
    *,
    program_id: str,
    in_avals: Sequence[Aval],
    static_key: str,
    platform: str,
    platform_version: str,
    device_kind: str,
    device_count: int,
) -> list[tuple[str, str]]:
    """The named parts of a key, in a fixed order."""
    return [
        ("schema", str(KEY_SCHEMA_VERSION)),
        ("program", program_id),
        ("in_avals", ";".join(f"{a}{'~weak' if a.weak_type else ''}" for a in in_avals)),
        ("static", static_key),
        ("compile_options", COMPILE_OPTIONS),
        ("platform", f"{platform} {platform_version}"),
        ("device_kind", device_kind),
        ("device_count", str(device_count)),
        ("jax", jax.__version__),
        ("jaxlib", jaxlib.__version__),
        ("xla_flags", os.environ.get("XLA_FLAGS", "")),
    ]


def cache_key(parts: Sequence[tuple[str, str]]) -> str:
    """sha256 hex over ``parts``; each part is logged at debug level."""
    h = hashlib.sha256()
    for name, value in parts:
        h.update(f"{name}={len(value)}:{value}\n".encode())
    key = h.hexdigest()
    if logger.isEnabledFor(logging.DEBUG):
        for name, value in parts:
            logger.debug("cache key %s part %s = %.500s", key[:16], name, value)
    return key
