"""Many replicas, one service (docs/deploy.md, "Many replicas"); see ``_cluster``."""

from __future__ import annotations

from ._cluster import OWNER_HEADER, PEER_HEADER, Cluster, Peer, ReplicaLost, replica_of, scope_path
from .relay import replica_header

__all__ = ["Cluster", "OWNER_HEADER", "PEER_HEADER", "Peer", "ReplicaLost", "replica_header",
           "replica_of", "scope_path"]
