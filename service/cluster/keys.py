"""Every Redis key and channel the replicas use, named in one table.

All live under the deployment's prefix (``JITSERVE_REDIS_PREFIX``, which the
compiler's cache shares) and ``cluster:``; docs/redis.md lists them for
operators. Each, with its type, its lifetime and who writes it:

- ``replica:<replica>``, a string expiring after 3 heartbeats: the replica's
  heartbeat (JSON: peer URL, whether it drains, when it started), written by
  that replica at each beat (``membership``).
- ``replicas``, a sorted set without expiry: the replicas that joined, by last
  heartbeat. Each adds itself as it beats; a lost one is removed by whoever
  finds it lost, or by itself as it leaves (``membership``).
- ``lost:<replica>``, a string kept twice the futures' TTL plus a minute: why
  the replica is lost. Written once, by the first replica to find it gone, or by
  the replica itself as it leaves (``membership``).
- ``events``, a pub/sub channel: ``lost <replica>`` with each ``lost:`` key, so
  that every replica forgets it at once (``membership`` publishes, ``watch``
  hears).
- ``future:<future>``, a string expiring a second after its future: the
  future's metadata (JSON: owner digest, replica, status, avals, error,
  timings; never its arrays), written and deleted by the future's replica
  (``mirror``).
- ``changed:<future>``, a pub/sub channel: ``changed`` with each write of
  ``future:<future>`` (``mirror``), heard only by replicas with a long-poll on
  that future (``watch``).
- ``programs:<owner>``, a set kept 30 days after the owner's last upload: the
  programs an API key (by digest) uploaded, added by the replica that took the
  upload (``ownership``).
- ``batching:<owner>``, a hash kept 30 days after its last change: program id to
  its batching (JSON), set by the replica that was asked (``ownership``);
  ``<owner>`` is empty when auth is off.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Keys"]


@dataclasses.dataclass(frozen=True, slots=True)
class Keys:
    """The names of one deployment's keys (the table above).

    Args:
      prefix: the deployment's Redis key prefix (``RedisSettings.key_prefix``).
    """

    prefix: str

    def replica(self, replica_id: str) -> str:
        return f"{self.prefix}cluster:replica:{replica_id}"

    def replicas(self) -> str:
        return f"{self.prefix}cluster:replicas"

    def lost(self, replica_id: str) -> str:
        return f"{self.prefix}cluster:lost:{replica_id}"

    def events(self) -> str:
        return f"{self.prefix}cluster:events"

    def future(self, future_id: str) -> str:
        return f"{self.prefix}cluster:future:{future_id}"

    def changed(self, future_id: str) -> str:
        return f"{self.prefix}cluster:changed:{future_id}"

    def changed_future(self, channel: str) -> str:
        """The future whose ``changed`` channel ``channel`` is."""
        return channel.removeprefix(self.changed(""))

    def programs(self, owner: str) -> str:
        return f"{self.prefix}cluster:programs:{owner}"

    def batching(self, owner: str | None) -> str:
        return f"{self.prefix}cluster:batching:{owner or ''}"
