"""The program store with Redis beside it (a real one): uploads through one store
run through another, the disk tier can be off, and Redis refills."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import redis

from jitserve.compiler.redis import LAYOUT_VERSION
from jitserve.service.app import start_pool
from jitserve.service.calls.programs import ProgramStore
from jitserve.service.errors import NotFound
from jitserve.service.runtimes import RuntimePool
from jitserve.service.settings import Settings

pytestmark = pytest.mark.timeout(60)

MakeStore = Callable[..., Awaitable[ProgramStore]]
CACHE_SECRET = "service-test-cache-secret-" + "a5e1" * 8  # shared by the stores' servers


@pytest.fixture
async def make_store(redis_url: str, redis_prefix: str) -> AsyncIterator[MakeStore]:
    """Program stores of servers of their own (``cache_dir=None``: no disk; ``shared``: Redis),
    each with a runtime of its own."""
    made: list[RuntimePool] = []

    async def make(cache_dir: Path | None, shared: bool = True) -> ProgramStore:
        settings = Settings(env="test", cache_dir=cache_dir or Path("unused"),
                            disk_cache=cache_dir is not None, redis_prefix=redis_prefix,
                            redis_url=redis_url if shared else None,
                            cache_secret=CACHE_SECRET, runtimes=1)
        made.append(await start_pool(settings))
        return ProgramStore(made[-1])

    yield make
    for pool in made:
        pool.close()


async def test_uploaded_through_one_store_found_by_another(
        make_store: MakeStore, programs: dict[str, bytes], tmp_path: Path) -> None:
    a = await make_store(tmp_path / "a")
    program, created = await a.put(programs["triple"], "jax_export")
    assert created
    b = await make_store(tmp_path / "b")
    pid = program.program_id
    found = await b.get(pid)
    assert found.program_id == pid and found.format == program.format
    assert (tmp_path / "b" / "programs" / pid[:2] / pid).exists()  # kept on B's disk for restarts
    memory_only = await make_store(None)  # the disk tier off
    assert (await memory_only.get(pid)).program_id == pid


async def test_known_program_is_shared_again(make_store: MakeStore, programs: dict[str, bytes],
                                             tmp_path: Path, redis_url: str,
                                             redis_prefix: str) -> None:
    store = await make_store(tmp_path)
    program, _ = await store.put(programs["triple"])
    raw = redis.Redis.from_url(redis_url)
    key = f"jitserve:v{LAYOUT_VERSION}:{redis_prefix}:prog:{program.program_id}"
    raw.delete(key)  # evicted, or uploaded while Redis was down
    _, created = await store.put(programs["triple"])
    assert not created and raw.exists(key)
    raw.close()


async def test_no_disk_no_redis_keeps_programs_in_memory(
        make_store: MakeStore, programs: dict[str, bytes]) -> None:
    store = await make_store(None, shared=False)
    program, _ = await store.put(programs["triple"])
    assert (await store.get(program.program_id)) is program
    with pytest.raises(NotFound):
        await store.get(hashlib.sha256(b"nothing").hexdigest())
