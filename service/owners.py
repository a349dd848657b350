"""Whose is it: the one comparison of owners, for every store and every replica.

An owner is the digest of the API key that made a thing (``api.auth``), or
``None`` when auth is off. A future or a program is the caller's only when the
two are the same owner; the comparison takes the same time whatever the digests
share, so that an answer's timing tells a caller nothing of another's key.
"""

from __future__ import annotations

import hmac

__all__ = ["same_owner"]


def same_owner(have: str | None, want: str | None) -> bool:
    """Whether ``have`` (what a thing records) and ``want`` (the caller) are one owner.

    ``None`` (auth off) matches only ``None``: a thing made without a key is no
    keyed caller's, and the other way round.
    """
    if have is None or want is None:
        return have is want
    return hmac.compare_digest(have, want)
