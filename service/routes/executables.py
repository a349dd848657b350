"""``/v1/executables``: what is cached, for operators — sizes, hits, compile seconds.

With Redis configured the records are the shared ones, kept beside each entry
in Redis (every process's compiles, hit counts across all of them); without it,
they are the executables loaded in this process. Redis configured but down is a
503 ``unavailable``: a local listing would silently answer another question.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from starlette.concurrency import run_in_threadpool

from jitserve.compiler import Compiler, Executable
from jitserve.compiler.redis_tier import RedisUnavailable
from jitserve.service.deps import CompilerDep, RedisDep, get_owner
from jitserve.service.errors import BadRequest, NotFound, Unavailable
from jitserve.service.schemas import ExecutableInfo, ExecutablePage

__all__ = ["router"]

router = APIRouter(prefix="/v1/executables", tags=["executables"],
                   dependencies=[Depends(get_owner)])

Cursor = Annotated[str | None, Query(max_length=40, description="next_cursor of the last page")]
Limit = Annotated[int, Query(ge=1, le=1000, description="about this many records per page")]


@router.get("", response_model=ExecutablePage)
async def list_executables(compiler: CompilerDep, redis: RedisDep, cursor: Cursor = None,
                           limit: Limit = 100) -> ExecutablePage:
    """A page of cached executables; follow ``next_cursor`` until it is null."""
    if redis is None:
        return _local_page(compiler, cursor, limit)
    try:
        page = await run_in_threadpool(redis.list_entries, cursor, limit)
    except ValueError as e:
        raise BadRequest(str(e)) from e
    except RedisUnavailable as e:
        raise Unavailable(f"the shared cache is unavailable: {e}") from e
    return ExecutablePage(executables=[_info(r, "redis") for r in page.entries],
                          next_cursor=page.next_cursor)


@router.get("/{executable_id}", response_model=ExecutableInfo)
async def get_executable(executable_id: str, compiler: CompilerDep,
                         redis: RedisDep) -> ExecutableInfo:
    """One cached executable's record; 404 when no tier has it."""
    if redis is not None:
        try:
            record = await run_in_threadpool(redis.metadata, executable_id)
        except RedisUnavailable as e:
            raise Unavailable(f"the shared cache is unavailable: {e}") from e
        if record is not None:
            return _info(record, "redis")
    for executable in compiler.loaded():
        if executable.executable_id == executable_id:
            return _info(_local_record(executable), "memory")
    raise NotFound(f"no cached executable {executable_id!r:.80}")


def _local_page(compiler: Compiler, cursor: str | None, limit: int) -> ExecutablePage:
    """This process's L1, by executable id; the cursor is an offset."""
    if cursor is not None and not cursor.isdigit():
        raise BadRequest(f"cursor {cursor!r:.40} is not one this listing returned")
    start = int(cursor or 0)
    loaded = sorted(compiler.loaded(), key=lambda e: e.executable_id)
    page = loaded[start:start + limit]
    more = start + limit < len(loaded)
    return ExecutablePage(executables=[_info(_local_record(e), "memory") for e in page],
                          next_cursor=str(start + limit) if more else None)


def _local_record(executable: Executable) -> dict[str, Any]:
    meta = executable.meta
    return {"executable_id": executable.executable_id, "program_id": meta.get("program_id"),
            "raw_size": executable.nbytes, "compile_seconds": meta.get("compile_seconds"),
            "created": meta.get("created"), "jaxlib_version": meta.get("jaxlib_version"),
            "platform": meta.get("platform"), "device_kind": meta.get("device_kind")}


def _info(record: dict[str, Any], source: str) -> ExecutableInfo:
    fields = ExecutableInfo.model_fields
    return ExecutableInfo(**{k: v for k, v in record.items() if k in fields and v != ""},
                          source=source)
