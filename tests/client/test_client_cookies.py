"""The SDK's HTTP clients offer an answer to their cookie jar only when it sets a
cookie (client/_transport.py, ``lean_cookies``), against a real HTTP server: the
standard library's, on loopback, which sets a cookie on ``/login`` only and
echoes the ``Cookie`` header it got."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator

import httpx
import pytest

from jitserve.client import AsyncClient, Client

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                 "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = (self.headers.get("cookie") or "").encode()
            self.send_response(200)
            if self.path == "/login":
                self.send_header("Set-Cookie", "session=abc; Path=/")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def no_offers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs whose answers were offered to a cookie jar."""
    offered: list[str] = []
    offer = httpx.Cookies.extract_cookies

    def spy(self: httpx.Cookies, response: httpx.Response) -> None:
        offered.append(response.request.url.path)
        offer(self, response)

    monkeypatch.setattr(httpx.Cookies, "extract_cookies", spy)
    return offered


def test_the_sync_client_keeps_cookies_it_is_sent_and_skips_answers_without(
        url: str, no_offers: list[str]) -> None:
    with Client(url) as c:
        http_ = c._http
        assert http_.get("/plain").content == b""
        assert http_.get("/login").status_code == 200
        assert http_.get("/plain").content == b"session=abc"  # sent back, as before
    assert no_offers == ["/login"]


def test_the_async_clients_keep_cookies_too(url: str, no_offers: list[str]) -> None:
    async def main() -> None:
        async with AsyncClient(url) as c:
            assert (await c._http.get("/login")).status_code == 200
            assert (await c._http.get("/plain")).content == b"session=abc"
            assert c._release_http.get("/login").status_code == 200
            assert c._release_http.get("/plain").content == b"session=abc"

    asyncio.run(main())
    assert no_offers == ["/login", "/login"]
