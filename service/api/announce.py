"""``AnnounceReplica``: with replicas, every answer names the one that gave it.

A balancer that keeps the name it saw from each server (haproxy's
``stick store-response``, docs/deploy.md) can then send a request that names
the replica holding its futures (the SDK's do) straight there, and no replica
has to forward it. Without Redis it adds nothing. The execute lane
(``api.lane``), in front of the stack, names the replica in the answers it
gives itself.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..cluster import replica_header

__all__ = ["AnnounceReplica"]


class AnnounceReplica:
    """ASGI middleware: with replicas, every answer names the one that gave it
    (``wire.REPLICA_HEADER``).

    Without Redis it adds nothing. ``ExecuteLane``, in front of the stack, names
    the replica in the answers it gives itself.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cluster = scope["app"].services.cluster if scope["type"] == "http" else None
        if cluster is None:
            await self.app(scope, receive, send)
            return
        header = replica_header(cluster)

        async def announce(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, announce)
