"""Future ids of a service with several replicas (docs/deploy.md, "Many replicas").

A future id is ``<replica>.<token>``: the id of the replica that holds its outputs
(``REPLICA_ID_HEX`` lowercase hex digits), then an unguessable token. Every answer
of such a service names the replica that gave it in ``REPLICA_HEADER``; a request
about futures may name the replica that holds them in the same header, so that a
balancer that learned which server answers as which replica (haproxy's stick
tables, docs/deploy.md) sends it there and no replica forwards it. The header is
only a hint: any replica serves any request.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

__all__ = ["REPLICA_HEADER", "REPLICA_ID_HEX", "replica_of", "replicas_of"]

#: The response header naming the replica that answered; on a request, the replica
#: that holds the futures it is about.
REPLICA_HEADER = "x-jitserve-replica"
#: A replica id: 40 random bits, as lowercase hex.
REPLICA_ID_HEX = 10

_HEX = frozenset("0123456789abcdef")


def replica_of(future_id: str) -> str | None:
    """The id of the replica that holds ``future_id`` (``None`` for an id of no replica).

    >>> replica_of("0123456789.abcDEF-_x"), replica_of("abcDEF-_x")
    ('0123456789', None)
    """
    head, sep, _ = future_id.partition(".")
    if sep and len(head) == REPLICA_ID_HEX and _HEX.issuperset(head):
        return head
    return None


def replicas_of(future_ids: Iterable[str]) -> collections.Counter[str]:
    """How many of ``future_ids`` each replica holds (ids of no replica left out)."""
    return collections.Counter(rid for fid in future_ids if (rid := replica_of(fid)) is not None)
