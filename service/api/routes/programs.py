"""``/v1/programs``: upload, describe, compile and delete programs (execute: ``execute.py``).

Each API key sees only the programs it uploaded (``service.programs``); another
key's program is ``404 not_found``, worded as for an unknown id.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response

from jitserve import wire
from jitserve.compiler.options import check_compiler_options
from jitserve.compiler.records import check_donate
from jitserve.wire import Aval, ErrorCode, ProgramFormat

from ...calls.executables import CallOptions
from ...calls.models import NAME_PATTERN
from ..deps import Body, Owner, ProgramBody, ServicesDep, get_owner
from ..openapi import errors, message_body
from ..schemas import (
    CompileRequest,
    CompileResult,
    ProgramDeleted,
    ProgramInfo,
    parse,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1/programs", tags=["programs"], dependencies=[Depends(get_owner)],
                   responses=errors(ErrorCode.UNAUTHORIZED))

_RAW_BODY = {"requestBody": {"required": True, "content": {
    wire.OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}}}
# What a program can be refused for, once decoded (upload) or compiled (compile, execute).
_PROGRAM_ERRORS = (ErrorCode.BAD_REQUEST, ErrorCode.INVALID_PROGRAM, ErrorCode.PAYLOAD_TOO_LARGE,
                   ErrorCode.UNSAFE_PROGRAM, ErrorCode.LIMIT_EXCEEDED,
                   ErrorCode.PLATFORM_MISMATCH, ErrorCode.TOO_MANY_REQUESTS)
_CALL_ERRORS = (*_PROGRAM_ERRORS, ErrorCode.NOT_FOUND, ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                ErrorCode.SIGNATURE_MISMATCH, ErrorCode.COMPILE_FAILED,
                ErrorCode.COMPILE_TIMEOUT, ErrorCode.COMPILER_ERROR)


@router.post("", status_code=201, response_model=ProgramInfo, openapi_extra=_RAW_BODY,
             response_model_exclude_unset=True,  # name and version only when named
             responses={200: {"model": ProgramInfo, "description": "already known"},
                        **errors(*_PROGRAM_ERRORS)})
async def upload_program(
    services: ServicesDep, body: ProgramBody, response: Response, owner: Owner,
    format: Annotated[ProgramFormat | None, Query(description="detected when omitted")] = None,
    name: Annotated[str | None, Query(pattern=NAME_PATTERN, description=(
        "the Open Inference Protocol model this program is a version of (docs/v2.md)"))] = None,
) -> dict[str, Any]:
    """Upload program bytes; idempotent (the id is the sha256 of the bytes).

    ``201`` for the caller's first upload of these bytes, ``200`` for its re-upload.
    With ``name``, the program is a version of that model (``/v2``), and the answer
    says which (the same one for a re-upload under the same name).
    """
    fmt = format.value if format else None
    program, created = await services.programs.put(await body.read(), fmt, owner)
    response.status_code = 201 if created else 200
    if name is None:
        return program.to_json()
    return {**program.to_json(), "name": name, "version": services.models.add(owner, name,
                                                                      program.program_id)}


@router.get("/{program_id}", response_model=ProgramInfo, responses=errors(ErrorCode.NOT_FOUND))
async def get_program(program_id: str, services: ServicesDep, owner: Owner) -> dict[str, Any]:
    """The program's signature and metadata."""
    return (await services.programs.get(program_id, owner)).to_json()


@router.delete("/{program_id}", response_model=ProgramDeleted,
               responses=errors(ErrorCode.NOT_FOUND))
async def delete_program(program_id: str, services: ServicesDep,
                         owner: Owner) -> ProgramDeleted:
    """Forget the caller's program (and its executables, for the caller's listing).

    Its bytes may stay stored for other keys that uploaded them too.
    """
    await services.programs.delete(program_id, owner)
    return ProgramDeleted(program_id=program_id)


@router.post("/{program_id}/compile", response_model=CompileResult, responses=errors(*_CALL_ERRORS),
             openapi_extra=message_body(CompileRequest, CompileRequest, required=False))
async def compile_program(program_id: str, services: ServicesDep, body: Body,
                          owner: Owner) -> CompileResult:
    """Compile (or find in a cache) the executable for the given input avals, donated
    inputs and compiler options."""
    program = await services.programs.get(program_id, owner)
    req = parse(CompileRequest, await body.message(), "compile request")
    in_avals = None if req.in_avals is None else [Aval.from_json(a.model_dump())
                                                   for a in req.in_avals]
    options = CallOptions(req.static_key, check_donate(req.donate, len(program.in_avals)),
                          compiler_options=check_compiler_options(req.compiler_options))
    lookup = await services.calls.compile(program, in_avals, options, owner)
    exe = lookup.executable
    return CompileResult(
        executable_id=lookup.executable_id, tier=lookup.tier,
        compile_seconds=lookup.compile_seconds, in_avals=[a.to_json() for a in exe.in_avals],
        out_avals=[a.to_json() for a in exe.out_avals], out_tree=exe.out_tree,
        recompiled_because=exe.meta.get("recompiled_because"))
