"""A bare HTTP relay, the floor under a replica's forwarding (bench/replicas.py).

    python bench/_bare_relay.py PORT TARGET_URL

uvicorn (httptools, uvloop, as ``jitserve serve`` runs) and one aiohttp session,
as a replica forwards: each request's method, path, query, body, ``Accept`` and
``Content-Type`` go to ``TARGET_URL``, and its answer comes back. Nothing else:
no authentication, no parsing, no limits, no metrics. What a chained call costs
through this, over the call sent straight to the target, is what any relay built
from these parts costs on this machine.
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import uvicorn
import yarl

_HEADERS = (b"accept", b"content-type")
_session: aiohttp.ClientSession | None = None


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global _session
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if _session is None:
        _session = aiohttp.ClientSession(
            auto_decompress=False, skip_auto_headers=("Content-Type", "Accept-Encoding", "User-Agent"))
    query = scope["query_string"].decode()
    url = yarl.URL(TARGET + scope["path"] + ("?" + query if query else ""), encoded=True)
    headers = {k.decode(): v.decode() for k, v in scope["headers"] if k in _HEADERS}
    async with _session.request(scope["method"], url, data=body, headers=headers) as answer:
        data = await answer.read()
        kind = answer.headers.get("content-type", "application/octet-stream")
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": [(b"content-type", kind.encode()),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


if __name__ == "__main__":
    TARGET = sys.argv[2].rstrip("/")
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                http="httptools", loop="uvloop")
