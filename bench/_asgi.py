"""What the plain ASGI servers of bench/ share (``_baseline_app.asgi_app``, ``_bare_relay``)."""

from __future__ import annotations

from typing import Any


async def read_body(receive: Any) -> bytes:
    """A request's whole body, from its ASGI ``receive``."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body
