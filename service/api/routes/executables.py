"""``/v1/executables``: what is cached, for operators — sizes, hits, compile seconds.

The records come from the compiler's catalog (``jitserve.compiler.Catalog``):
with Redis configured they are the shared ones, kept beside each entry in Redis
(every process's compiles, hit counts across all of them); without it, the
executables loaded in this process. Redis configured but down is a 503
``unavailable`` (the catalog's ``CacheUnavailable``, mapped in ``service.errors``):
a local listing would silently answer another question.

With API keys on, a key lists and reads only its own executables (those looked
up for its programs, ``service.tenants``); another key's is ``404 not_found``,
worded as for an unknown id.

``GET /v1/executables/{id}/text`` is its optimized HLO, as XLA prints it (read by a
runtime, which loads the executable by id).

``DELETE /v1/executables/{id}`` is an admin route: with API keys on, only the
keys in ``JITSERVE_ADMIN_KEYS`` may use it (``403 forbidden`` for the others);
it drops the executable from every tier, so the next call compiles it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from jitserve.compiler import Catalog, EntryPage
from jitserve.compiler.catalog import parse_cursor
from jitserve.wire import ErrorCode

from ...errors import BadRequest, Forbidden, NotFound
from ..deps import Owner, ServicesDep, get_owner
from ..openapi import errors
from ..schemas import ExecutableDeleted, ExecutableInfo, ExecutablePage

__all__ = ["router"]

router = APIRouter(prefix="/v1/executables", tags=["executables"],
                   dependencies=[Depends(get_owner)],
                   responses=errors(ErrorCode.UNAUTHORIZED, ErrorCode.UNAVAILABLE))

Cursor = Annotated[str | None, Query(max_length=40, description="next_cursor of the last page")]
Limit = Annotated[int, Query(ge=1, le=1000, description="about this many records per page")]


@router.get("", response_model=ExecutablePage, responses=errors(ErrorCode.BAD_REQUEST))
async def list_executables(services: ServicesDep, owner: Owner,
                           cursor: Cursor = None, limit: Limit = 100) -> ExecutablePage:
    """A page of cached executables; follow ``next_cursor`` until it is null."""
    catalog, tenants = services.catalog, services.tenants
    try:
        if tenants.sees_everything(owner):
            page = await run_in_threadpool(catalog.page, cursor, limit)
        else:
            owned = tenants.executables_of(owner)  # on the loop, where the index changes
            page = await run_in_threadpool(_owned_page, catalog, owned, cursor, limit)
    except ValueError as e:  # a cursor this listing never returned
        raise BadRequest(str(e)) from e
    return ExecutablePage(executables=[_info(r) for r in page.entries],
                          next_cursor=page.next_cursor)


@router.get("/{executable_id}", response_model=ExecutableInfo,
            responses=errors(ErrorCode.NOT_FOUND))
async def get_executable(executable_id: str, services: ServicesDep,
                         owner: Owner) -> ExecutableInfo:
    """One cached executable's record; 404 when no tier has it (or it is another key's)."""
    record = None
    if services.tenants.sees_executable(owner, executable_id):
        record = await run_in_threadpool(services.catalog.describe, executable_id)
    if record is None:
        raise NotFound(f"no cached executable {executable_id!r:.80}")
    return _info(record)


@router.get("/{executable_id}/text", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "the optimized HLO, as XLA prints it"},
                       **errors(ErrorCode.NOT_FOUND)})
async def get_executable_text(executable_id: str, services: ServicesDep,
                              owner: Owner) -> PlainTextResponse:
    """The executable's optimized HLO, as XLA prints it (``jax.stages.Compiled.as_text``):
    what the program became after XLA's passes (fusions, layouts, schedule). 404 as for
    its record."""
    text = None
    if services.tenants.sees_executable(owner, executable_id) and _is_id(executable_id):
        text = await services.calls.text(executable_id, owner)
    if text is None:
        raise NotFound(f"no cached executable {executable_id!r:.80}")
    return PlainTextResponse(text)


@router.delete("/{executable_id}", response_model=ExecutableDeleted,
               responses=errors(ErrorCode.FORBIDDEN, ErrorCode.NOT_FOUND))
async def delete_executable(executable_id: str, services: ServicesDep,
                            owner: Owner) -> ExecutableDeleted:
    """Drop an executable from every tier (each runtime's memory, disk, Redis); admin only.

    The next call that needs it compiles it again. 404 when no tier held it.
    """
    if not services.settings.is_admin(owner):
        raise Forbidden("deleting executables needs an admin key (JITSERVE_ADMIN_KEYS)")
    if not _is_id(executable_id):
        raise NotFound(f"no cached executable {executable_id!r:.80}")
    tiers = await services.calls.forget(executable_id)
    if not tiers:
        raise NotFound(f"no cached executable {executable_id!r:.80}")
    return ExecutableDeleted(executable_id=executable_id, tiers=tiers)


def _is_id(executable_id: str) -> bool:
    """Whether ``executable_id`` could be one: 64 lowercase hex digits (a sha256)."""
    return len(executable_id) == 64 and all(c in "0123456789abcdef" for c in executable_id)


def _owned_page(catalog: Catalog, owned: Sequence[str], cursor: str | None,
                limit: int) -> EntryPage:
    """A page of the records of ``owned`` (sorted ids); the cursor is an offset into them.

    Ids no tier describes any more (evicted) are left out, so a page may be short.
    """
    start = parse_cursor(cursor)
    records = [catalog.describe(i) for i in owned[start:start + limit]]
    more = start + limit < len(owned)
    return EntryPage([r for r in records if r is not None], str(start + limit) if more else None)


def _info(record: dict[str, Any]) -> ExecutableInfo:
    fields = ExecutableInfo.model_fields
    return ExecutableInfo(**{k: v for k, v in record.items() if k in fields and v != ""})
