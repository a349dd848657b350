"""Session-wide test setup: x64 on, as the server runs it, and a private Redis.

``redis_url`` is a real Redis for the whole session: ``REDIS_URL`` when set,
else a ``redis-server`` this fixture starts on a free port (and stops at the
end). Each test keeps to its own key prefix (``redis_prefix``), whose keys are
deleted after it, so tests never see each other's entries. Tests that kill
Redis on purpose start their own with ``redis_server``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import pytest

jax.config.update("jax_enable_x64", True)

if TYPE_CHECKING:
    from redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a real Redis for this session (``REDIS_URL``, or a private server)."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    from redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix (deployment name) of this test's own; its keys are deleted afterwards."""
    from redis_server import delete_prefix

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield prefix
    delete_prefix(redis_url, prefix)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """A factory of private ``redis-server`` processes this test may kill and restart.

    Keyword arguments go to ``RedisServer`` (``password``, ``tls_dir``, ``port``).
    """
    from redis_server import RedisServer

    started: list[RedisServer] = []

    def start(**options: Any) -> RedisServer:
        started.append(RedisServer(tmp_path / f"redis-{len(started)}", **options).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()
