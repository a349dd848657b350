"""Signatures of forwarded requests: how a replica knows another sent a request.

Forwarded requests go to the public routes with an ``X-Jitserve-Peer`` header:
an HMAC of the time, method, path and owner under ``JITSERVE_PEER_SECRET`` (the
same on every replica), which clients cannot make. A signed request is served
locally, as the owner its ``X-Jitserve-Owner`` header names, and is never
forwarded again (``api.deps.request_owner``). Its ``X-Jitserve-To`` header names the
replica it is meant for: a process that answers at that replica's address but is
another one (a replica restarted there before the others knew the first was lost)
serves none of it (``Relay.request`` reads its refusal as that replica not answering).

A signature is good for a minute either way, so replicas must keep their clocks
within a minute of each other. A chain of calls signs one path again and again:
a signature is reused by its sender for a second, and remembered by its checker
while it is fresh, so neither pays an HMAC per call.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Mapping
from typing import Any

from ..errors import Unauthorized
from .membership import Membership

__all__ = ["OWNER_HEADER", "PEER_HEADER", "TO_HEADER", "Signing", "scope_path"]

PEER_HEADER = "x-jitserve-peer"
OWNER_HEADER = "x-jitserve-owner"
TO_HEADER = "x-jitserve-to"
_CLOCK_SKEW_S = 60.0  # a signed request older (or newer) than this is refused


class Signing:
    """``sign`` requests this replica forwards; ``check`` those forwarded to it.

    Args:
      secret: the key of the signatures (the same on every replica).
      membership: this replica's id (a signature names its signer).
    """

    def __init__(self, secret: bytes, membership: Membership) -> None:
        self._secret = secret
        self._membership = membership
        self._signatures: dict[tuple[str, str, str | None], tuple[float, str]] = {}
        self._checked: dict[str, tuple[tuple[str, str, str | None], float]] = {}

    def sign(self, method: str, path: str, owner: str | None) -> str:
        """The ``X-Jitserve-Peer`` value of a request this replica forwards.

        A signature is fresh for ``_CLOCK_SKEW_S``: one made for the same request in
        the last second is used again (a chain's calls all sign one path)."""
        now = time.time()
        key = (method, path, owner)
        made = self._signatures.get(key)
        if made is not None and now - made[0] < 1.0:
            return made[1]
        stamp = f"{now:.3f}"
        mac = hmac.new(self._secret, _signed(stamp, method, path, owner), hashlib.sha256)
        value = f"{self._membership.replica_id}.{stamp}.{mac.hexdigest()}"
        if len(self._signatures) >= 1024:
            self._signatures.clear()
        self._signatures[key] = (now, value)
        return value

    def check(self, value: str, method: str, path: str, owner: str | None) -> None:
        """``Unauthorized`` unless ``value`` is a fresh signature of this request.

        A signature found good is remembered, with what it signed, while it is fresh:
        senders reuse theirs for a second (``sign``), and each check costs an HMAC."""
        now, request = time.time(), (method, path, owner)
        seen = self._checked.get(value)
        if seen is not None and seen[0] == request and abs(now - seen[1]) <= _CLOCK_SKEW_S:
            return
        _, _, rest = value.partition(".")
        stamp, _, mac = rest.rpartition(".")
        try:
            made = float(stamp)
        except ValueError:
            made = math.nan  # never fresh
        want = hmac.new(self._secret, _signed(stamp, method, path, owner), hashlib.sha256)
        if not abs(now - made) <= _CLOCK_SKEW_S or not hmac.compare_digest(want.hexdigest(), mac):
            raise Unauthorized("bad or stale peer signature (replicas must share "
                               "JITSERVE_PEER_SECRET and keep their clocks within a minute)")
        if len(self._checked) >= 4096:
            self._checked.clear()
        self._checked[value] = (request, made)


def scope_path(scope: Mapping[str, Any]) -> str:
    """A request's path as ``Request.url.path`` gives it (what a signature covers),
    without building the whole URL."""
    return scope["path"].replace("?", "%3F").replace("#", "%23").replace("\\", "%5C")


def _signed(stamp: str, method: str, path: str, owner: str | None) -> bytes:
    return f"{stamp}\n{method.upper()}\n{path}\n{owner or ''}".encode()
