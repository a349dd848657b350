"""Fixtures: a ``FakeServer`` and clients wired to it through ``httpx.MockTransport``."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

# client_fakes sits next to this file; import it whatever the import mode.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from client_fakes import FAST, FakeServer  # noqa: E402

from jitserve.client import AsyncClient, Client  # noqa: E402


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def client(server: FakeServer) -> Iterator[Client]:
    with Client("http://jitserve.test", api_key=None, timeout=FAST,
                transport=httpx.MockTransport(server)) as c:
        yield c


@pytest.fixture
def waits(server: FakeServer) -> Iterator[Client]:
    """A client whose jitted calls each wait for the server to take them (``run_ahead=0``)."""
    with Client("http://jitserve.test", api_key=None, timeout=FAST, run_ahead=0,
                transport=httpx.MockTransport(server)) as c:
        yield c


@pytest.fixture(params=["runs ahead", "waits"])
def each_client(request: pytest.FixtureRequest, client: Client, waits: Client) -> Client:
    """The default client (it runs ahead), then one whose calls wait."""
    return client if request.param == "runs ahead" else waits


@pytest.fixture
async def aclient(server: FakeServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient("http://jitserve.test", api_key=None, timeout=FAST,
                           transport=httpx.MockTransport(server)) as c:
        yield c
