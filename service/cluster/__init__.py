"""Many replicas, one service (docs/deploy.md, "Many replicas"); see ``_cluster``."""

from __future__ import annotations

from ._cluster import OWNER_HEADER, PEER_HEADER, Cluster, Peer, ReplicaLost, replica_of, scope_path

__all__ = ["OWNER_HEADER", "PEER_HEADER", "Cluster", "Peer", "ReplicaLost", "replica_of",
           "scope_path"]
