"""The program store with Redis beside it (a real one): uploads through one store
run through another, and the disk tier can be off."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from jitserve.compiler import Compiler
from jitserve.compiler.redis_tier import RedisSettings, RedisTier
from jitserve.service.errors import NotFound
from jitserve.service.programs import ProgramStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tier(redis_url: str, redis_prefix: str) -> Iterator[RedisTier]:
    t = RedisTier(RedisSettings.from_url(redis_url, prefix=redis_prefix))
    yield t
    t.close()


async def test_uploaded_through_one_store_found_by_another(
        compiler: Compiler, tier: RedisTier, programs: dict[str, bytes], tmp_path: Path) -> None:
    a = ProgramStore(tmp_path / "a", compiler, shared=tier)
    program, created = await a.put(programs["triple"], "jax_export")
    assert created
    b = ProgramStore(tmp_path / "b", compiler, shared=tier)
    found = await b.get(program.program_id)
    assert found.program_id == program.program_id and found.format == program.format
    assert (tmp_path / "b" / program.program_id).exists()  # kept on B's disk for restarts
    memory_only = ProgramStore(None, compiler, shared=tier)  # the disk tier off
    assert (await memory_only.get(program.program_id)).program_id == program.program_id


async def test_known_program_is_shared_again(compiler: Compiler, tier: RedisTier,
                                             programs: dict[str, bytes], tmp_path: Path,
                                             redis_url: str, redis_prefix: str) -> None:
    store = ProgramStore(tmp_path, compiler, shared=tier)
    program, _ = await store.put(programs["triple"])
    raw = redis.Redis.from_url(redis_url)
    key = f"jitserve:v1:{redis_prefix}:prog:{program.program_id}"
    raw.delete(key)  # evicted, or uploaded while Redis was down
    _, created = await store.put(programs["triple"])
    assert not created and raw.exists(key)
    raw.close()


async def test_no_disk_no_redis_keeps_programs_in_memory(
        compiler: Compiler, programs: dict[str, bytes]) -> None:
    store = ProgramStore(None, compiler)
    program, _ = await store.put(programs["triple"])
    assert (await store.get(program.program_id)) is program
    with pytest.raises(NotFound):
        await store.get(hashlib.sha256(b"nothing").hexdigest())
