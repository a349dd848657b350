"""Optional bearer-token auth for the ``/v1`` routes.

With ``JITSERVE_API_KEYS`` unset every caller is anonymous (owner ``None``). With
keys set, a request needs ``Authorization: Bearer <key>`` matching one of them;
its owner is then the sha256 hex of the key, which is what futures remember, so
the keys themselves are never stored.
"""

from __future__ import annotations

import hashlib
import hmac

from ..errors import Unauthorized
from ..settings import Settings

__all__ = ["authenticate", "owner_of"]


def owner_of(key: str) -> str:
    """The owner id of an API key: its sha256 hex digest."""
    return hashlib.sha256(key.encode()).hexdigest()


def authenticate(token: str | None, settings: Settings) -> str | None:
    """The owner behind the bearer ``token`` of a request; ``Unauthorized`` when refused.

    ``token`` is ``None`` when the request has no ``Authorization: Bearer`` header.
    Returns ``None`` when auth is off.
    """
    if not settings.auth_enabled:
        return None
    if token is None or not token.strip():
        raise Unauthorized("this server needs 'Authorization: Bearer <api key>'")
    digest = hashlib.sha256(token.strip().encode()).digest()
    # Compare against every key, so the time taken does not say which one matched.
    matched = False
    for known in settings.key_digests():
        matched |= hmac.compare_digest(digest, known)
    if not matched:
        raise Unauthorized("the API key is not valid")
    return digest.hex()
