"""``/v1/programs``: upload, describe, compile, execute and delete programs.

Each API key sees only the programs it uploaded (``service.programs``); another
key's program is ``404 not_found``, worded as for an unknown id.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from jitserve import wire
from jitserve.compiler.programs import ProgramFormat
from jitserve.service.bodies import outputs_response
from jitserve.service.cluster import Cluster, ReplicaLost, replica_of
from jitserve.service.deps import (
    AsJSON,
    Body,
    CallsDep,
    ClusterDep,
    MetricsDep,
    Owner,
    ProgramBody,
    ProgramStoreDep,
    RuntimesDep,
    WaitSeconds,
    get_owner,
)
from jitserve.service.errors import BadRequest
from jitserve.service.executables import CallOptions
from jitserve.service.openapi import errors, message_body, outputs_content
from jitserve.service.routes.replicas import pull, relay, remote_replica
from jitserve.service.schemas import (
    CompileRequest,
    CompileResult,
    ExecuteAccepted,
    ExecuteJSON,
    ExecuteMsgpack,
    ExecuteRequest,
    ProgramDeleted,
    ProgramInfo,
    parse,
)
from jitserve.service.v2.models import NAME_PATTERN, ModelsDep
from jitserve.wire import Aval, ErrorCode

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
    programs: ProgramStoreDep, body: ProgramBody, response: Response, owner: Owner,
    models: ModelsDep,
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
    program, created = await programs.put(bytes(await body.read()), fmt, owner)
    response.status_code = 201 if created else 200
    if name is None:
        return program.to_json()
    return {**program.to_json(), "name": name, "version": models.add(owner, name,
                                                                      program.program_id)}


@router.get("/{program_id}", response_model=ProgramInfo, responses=errors(ErrorCode.NOT_FOUND))
async def get_program(program_id: str, programs: ProgramStoreDep, owner: Owner) -> dict[str, Any]:
    """The program's signature and metadata."""
    return (await programs.get(program_id, owner)).to_json()


@router.delete("/{program_id}", response_model=ProgramDeleted,
               responses=errors(ErrorCode.NOT_FOUND))
async def delete_program(program_id: str, programs: ProgramStoreDep,
                         owner: Owner) -> ProgramDeleted:
    """Forget the caller's program (and its executables, for the caller's listing).

    Its bytes may stay stored for other keys that uploaded them too.
    """
    await programs.delete(program_id, owner)
    return ProgramDeleted(program_id=program_id)


@router.post("/{program_id}/compile", response_model=CompileResult, responses=errors(*_CALL_ERRORS),
             openapi_extra=message_body(CompileRequest, CompileRequest, required=False))
async def compile_program(program_id: str, programs: ProgramStoreDep, calls: CallsDep,
                          body: Body, owner: Owner) -> CompileResult:
    """Compile (or find in a cache) the executable for the given input avals."""
    program = await programs.get(program_id, owner)
    req = parse(CompileRequest, await body.message(), "compile request")
    in_avals = None if req.in_avals is None else [Aval.from_json(a.model_dump())
                                                   for a in req.in_avals]
    lookup = await calls.compile(program, in_avals, CallOptions(req.static_key), owner)
    exe = lookup.executable
    return CompileResult(
        executable_id=lookup.executable_id, tier=lookup.tier,
        compile_seconds=lookup.compile_seconds, in_avals=[a.to_json() for a in exe.in_avals],
        out_avals=[a.to_json() for a in exe.out_avals], out_tree=exe.out_tree,
        recompiled_because=exe.meta.get("recompiled_because"))


@router.post("/{program_id}/execute", status_code=202, response_model=ExecuteAccepted,
             openapi_extra=message_body(ExecuteJSON, ExecuteMsgpack, required=True),
             responses={200: {"description": "the outputs, when ?wait was long enough",
                              "content": outputs_content()},
                        **errors(*_CALL_ERRORS, ErrorCode.FUTURE_CANCELLED,
                                 ErrorCode.FUTURE_FAILED, ErrorCode.REPLICA_LOST,
                                 ErrorCode.UNAVAILABLE)})
async def execute_program(program_id: str, request: Request, programs: ProgramStoreDep,
                          calls: CallsDep, metrics: MetricsDep, runtimes: RuntimesDep,
                          body: Body, owner: Owner, cluster: ClusterDep, wait: WaitSeconds,
                          as_json: AsJSON) -> Response:
    """Run the program on arrays or future references; answers with a future.

    With ``?wait=<ms>``, answers ``200`` with the outputs if they are ready in time.
    With several replicas, a call whose inputs are futures runs where they are.
    """
    state = request.app.state
    state.drain.check_accepting()
    forwarded = cluster is None and state.cluster is not None
    program = await programs.get(program_id, owner, vouched=forwarded)
    raw, message = await body.raw_message()
    req = parse(ExecuteRequest, _required(message), "execute request")
    if cluster is not None and (holder := _holder(cluster, req.args)) is not None:
        with contextlib.suppress(ReplicaLost):  # gone: the call fails here, naming its input
            return await relay(cluster, holder, request, owner, content=bytes(raw),
                               wait_s=wait)
    del raw
    if state.cluster is not None:  # inputs held by other replicas come here
        await _pull_inputs(state.cluster, req.args, owner, state.settings.max_wait_ms / 1000)
    call = await calls.execute(program, req.args, req.static_key, owner, req.timeout_s,
                               req.donate)
    del req  # the executor holds the input arrays now; do not pin them while we wait
    fut = call.future
    if state.cluster is not None:
        await state.cluster.written(fut)  # any replica can answer for it from now on
    if wait and await fut.wait_final(wait) and fut.outputs is not None:
        return await outputs_response(fut, metrics, as_json, runtimes)
    accepted = ExecuteAccepted.of(fut, call.tier)
    return JSONResponse(accepted.model_dump(mode="json"), status_code=202)


def _required(message: Any) -> Any:
    if message is None:
        raise BadRequest("execute needs a body {'args': [...]}")
    return message


def _holder(cluster: Cluster, args: list[Any]) -> str | None:
    """The replica a call should run on: the one holding most of its input futures,
    unless that is this one, or it drains (then the inputs come here)."""
    held = collections.Counter(replica_of(str(a["future"])) for a in args
                               if wire.is_future_ref(a))
    held.pop(None, None)
    if not held:
        return None
    rid, count = held.most_common(1)[0]
    if rid == cluster.replica_id or held[cluster.replica_id] >= count or cluster.peer_draining(rid):
        return None
    return rid


async def _pull_inputs(cluster: Cluster, args: list[Any], owner: str | None,
                       wait_s: float) -> None:
    """Replace references to other replicas' futures in ``args`` by their arrays."""
    for i, arg in enumerate(args):
        if wire.is_future_ref(arg) and remote_replica(cluster, str(arg["future"])):
            args[i] = await pull(cluster, arg, owner, wait_s)
