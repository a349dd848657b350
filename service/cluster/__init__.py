"""Many replicas, one service: futures any replica can answer for, over Redis.

With ``REDIS_URL`` set, every ``jitserve serve`` process is a *replica* of one
service (docs/deploy.md, "Many replicas"). A future stays where it was computed:
its outputs live on its replica's device and are never copied into Redis. What
Redis holds is what the others need to answer for it (``keys`` names it all):

- **Who is alive** (``membership``). Each replica writes a heartbeat every
  ``heartbeat_s``, expiring after three periods. A replica whose heartbeat
  expired is *lost*: from then on its futures report ``failed`` with
  ``replica_lost`` everywhere.
- **Each future's metadata** (``mirror``): owner digest, status, avals, error,
  timings, mirrored as it changes and kept as long as the future. An execute is
  answered only once its future's metadata is written, so no replica ever denies
  a future that was accepted. Long-polls on another replica's future wait for
  its writes on Redis pub/sub, never polling (``watch``).
- **Who uploaded which program**, and the batching each caller set
  (``ownership``): a caller's requests may land on any replica.

A future's id starts with its replica's id (``<replica>.<token>``), so any
replica knows where its data is without asking. A request for another replica's
future is answered from the metadata (status, long-poll) or *forwarded* to that
replica (result, delete, release, and an execute whose inputs live there, which
then runs there: data moves only when one call reads futures of two replicas;
``relay``). Forwarded requests carry an HMAC that clients cannot make
(``signing``), and travel on kept-alive connections (``peers``).

Redis down: each replica keeps serving its own futures, ``/readyz`` says the
cluster is degraded, and another replica's futures answer ``503 unavailable``.

``Cluster`` (``cluster``) is one replica's whole part in this, built from those
modules in dependency order.
"""

from __future__ import annotations

from jitserve.wire import replica_of

from .cluster import Cluster, remote_replica, replica_header
from .keys import Keys
from .membership import Membership, Peer, ReplicaLost
from .mirror import Mirror, Mirrored
from .ownership import Ownership
from .relay import PeerRefusal, Relay
from .signing import OWNER_HEADER, PEER_HEADER, TO_HEADER, Signing, scope_path
from .watch import Watch

__all__ = [
    "Cluster",
    "Keys",
    "Membership",
    "Mirror",
    "Mirrored",
    "OWNER_HEADER",
    "Ownership",
    "PEER_HEADER",
    "Peer",
    "PeerRefusal",
    "Relay",
    "ReplicaLost",
    "Signing",
    "TO_HEADER",
    "Watch",
    "remote_replica",
    "replica_header",
    "replica_of",
    "scope_path",
]
