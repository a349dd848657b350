"""How to reach the deployment's Redis and how to use it; and the layout version of its keys.

This module imports neither ``redis`` nor jax: the service's settings read it at
every start, and a deployment without Redis never loads the Redis client.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from typing import Any

__all__ = ["LAYOUT_VERSION", "RedisSettings"]

# Layout of keys and records in Redis. A new layout gets a new key prefix, so old
# and new servers never read each other's records.
# 2026-11-21: 1, first layout.
# 2026-11-23: 2, a program is one string ``prog:<id>``, the framed blob the disk
#   tier keeps too (``compiler.program_store``), instead of a hash of data and
#   format: programs and executables go through one blob tier. ``exe:`` and
#   ``meta:`` records are unchanged.
# 2026-11-23: 3, ``exe:`` entries are signed (``compiler.cache.ENTRY_VERSION`` 2).
#   A server reads only its own entry version and drops the others, so without a
#   new prefix old and new servers would drop each other's entries all through a
#   rolling upgrade; with it they keep apart (programs are uploaded again).
LAYOUT_VERSION = 3

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # no glob characters: the prefix goes into SCAN MATCH
_SCHEMES = ("redis", "rediss", "unix")


@dataclasses.dataclass(frozen=True)
class RedisSettings:
    """How to reach Redis and how to use it.

    Attributes:
      url: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS) or
        ``unix:///path.sock``. A password or ACL user goes in the URL.
      prefix: the deployment's name inside the key prefix
        ``jitserve:v<LAYOUT_VERSION>:<prefix>:``; deployments sharing a Redis keep
        apart by it.
      ttl_s: entries and programs expire this long after their last write or hit;
        ``None`` keeps them until Redis evicts them (``maxmemory`` + ``allkeys-lru``).
      lock_ttl_s: a compile lock's expiry; the holder renews it every third of
        that, so a dead holder blocks others for at most this long.
      wait_s: how long a process waits for another's compile of the same key
        before compiling itself.
      connect_timeout_s, socket_timeout_s: small, so a dead Redis costs little.
      max_backoff_s: the longest pause between probes of a Redis that is down.
    """

    url: str
    prefix: str = "default"
    ttl_s: float | None = None
    lock_ttl_s: float = 10.0
    wait_s: float = 60.0
    connect_timeout_s: float = 0.5
    socket_timeout_s: float = 5.0
    max_backoff_s: float = 30.0

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisSettings:
        """Settings for ``url``; ``options`` are the other fields, checked here.

        Example: ``RedisSettings.from_url("rediss://jitserve:pw@cache:6380/0", prefix="prod")``.
        """
        settings = cls(url=url, **options)
        settings.check()
        return settings

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field that is wrong."""
        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme not in _SCHEMES:
            raise ValueError(f"Redis URL scheme is {scheme!r}; expected one of {', '.join(_SCHEMES)}")
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"Redis key prefix {self.prefix!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"Redis ttl_s is {self.ttl_s}; expected a positive number or None")
        for name in ("lock_ttl_s", "connect_timeout_s", "socket_timeout_s", "max_backoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Redis {name} is {getattr(self, name)}; expected > 0")
        if self.wait_s < 0:
            raise ValueError(f"Redis wait_s is {self.wait_s}; expected >= 0")

    @property
    def key_prefix(self) -> str:
        """What every key of this deployment starts with: ``jitserve:v<layout>:<prefix>:``."""
        return f"jitserve:v{LAYOUT_VERSION}:{self.prefix}:"

    @property
    def ttl_ms(self) -> int:
        """``ttl_s`` in milliseconds, 0 for none (the form ``PX`` and ``PEXPIRE`` take)."""
        return int(self.ttl_s * 1000) if self.ttl_s else 0

    @property
    def redacted_url(self) -> str:
        """The URL with its password masked, for logs and status pages."""
        parts = urllib.parse.urlsplit(self.url)
        if parts.password is None:
            return self.url
        user = parts.username or ""
        host = parts.hostname or ""
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
