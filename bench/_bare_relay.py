"""A bare HTTP relay, the floor under a replica's forwarding (bench/replicas.py).

    python bench/_bare_relay.py PORT TARGET_URL

uvicorn (httptools, uvloop, as ``jitserve serve`` runs) and the replicas' own
client (service/cluster/peers.py), as a replica forwards: each request's method, path,
query, body, ``Accept`` and ``Content-Type`` go to ``TARGET_URL``, and its answer
comes back. Nothing else: no authentication, parsing, limits or metrics. What a
chained call costs through this, over the call sent straight to the target, is
what any relay built from these parts costs on this machine.
"""

from __future__ import annotations

import sys
from typing import Any

import uvicorn
from _asgi import read_body

from jitserve.service.cluster.peers import PeerClient

_HEADERS = (b"accept", b"content-type")
_PASSED = ("content-type", "content-length")
_client = PeerClient(idle_s=2.0)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = await read_body(receive)
    query = scope["query_string"].decode("latin-1")
    target = scope["raw_path"].decode("latin-1") + ("?" + query if query else "")
    headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _HEADERS}
    answer = await _client.request(scope["method"], TARGET, target, headers, body, read_s=60)
    try:
        data = await answer.read()
    finally:
        answer.release()
    await send({"type": "http.response.start", "status": answer.status,
                "headers": [(k.encode(), v.encode("latin-1")) for k in _PASSED
                            if (v := answer.headers.get(k)) is not None]})
    await send({"type": "http.response.body", "body": data})


if __name__ == "__main__":
    TARGET = sys.argv[2].rstrip("/")
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                http="httptools", loop="uvloop")
