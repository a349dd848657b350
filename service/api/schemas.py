"""Wire schemas: the JSON documents of requests and answers (docs/api.md).

Stored state lives in ``futures.Future`` and ``compiler.Program``; these models are
only what crosses the wire, built from that state by the ``of`` constructors.
Array payloads never go through pydantic: the wire codec handles them.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from jitserve.compiler.options import MAX_OPTIONS
from jitserve.wire import FutureStatus

from ..calls.futures import Future
from ..errors import BadRequest

__all__ = [
    "ArrayJSON",
    "ArrayMsgpack",
    "ArraysJSON",
    "ArraysMsgpack",
    "ArraysRequest",
    "AvalModel",
    "CompileRequest",
    "CompileResult",
    "ConsoleCompile",
    "ConsoleCompiles",
    "ConsoleDevice",
    "ConsoleDevices",
    "ConsoleExit",
    "ConsoleHolder",
    "ConsoleProgram",
    "ConsoleQuotaRefusal",
    "ConsoleRuntime",
    "ConsoleSession",
    "ConsoleSessions",
    "ConsoleTierPoint",
    "ConsoleTierTotals",
    "ConsoleTiers",
    "ConsoleViewer",
    "ConsoleWork",
    "ConsoleWorkPoint",
    "ConsoleWorkTotals",
    "CostInfo",
    "CallRef",
    "CallRefused",
    "CallStarted",
    "CallsAnswer",
    "CallsJSON",
    "CallsMsgpack",
    "CallsRequest",
    "CarriedOutputs",
    "DeleteResult",
    "ErrorBody",
    "ErrorDetail",
    "ExecutableDeleted",
    "ExecutableInfo",
    "ExecutablePage",
    "ExecuteAccepted",
    "ExecuteJSON",
    "ExecuteMsgpack",
    "ExecuteRequest",
    "FutureRef",
    "FutureView",
    "MAX_CALLS",
    "MemoryInfo",
    "OutputsJSON",
    "ProgramDeleted",
    "ProgramInfo",
    "ReleaseRequest",
    "ReleaseResult",
    "TimingsView",
    "parse",
]

AvalJSON = dict[str, Any]
M = TypeVar("M", bound="BaseModel")


#: The most outputs one release (or arrays one put) may name.
MAX_RELEASE = 10_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(BaseModel):
    """The ``error`` of an error answer; some codes add fields (``quota``, ``limit``, ...)."""

    model_config = ConfigDict(extra="allow")

    code: str = Field(description="one of jitserve.wire.ErrorCode (docs/api.md, Errors)")
    message: str = Field(description="what was wrong, in the caller's terms")


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: ``{"error": {"code", "message", ...}}``."""

    error: ErrorDetail


# Request bodies as documented in the OpenAPI. The handlers parse the decoded
# message with ``ExecuteRequest``/``CompileRequest`` (arrays arrive decoded by the
# wire codec); these models only describe the bytes a caller sends.
class AvalModel(BaseModel):
    """An abstract value: ``null`` for a raw ``?`` dimension, a string for a symbolic one."""

    shape: list[int | str | None]
    dtype: str = Field(description="a name in jitserve.wire.DTYPES, e.g. float32")
    weak_type: bool = False


class ArrayJSON(BaseModel):
    """An array in JSON: ``data`` is base64 of the C-order little-endian bytes, or nested lists."""

    dtype: str = Field(description="a name in jitserve.wire.DTYPES, e.g. float32")
    shape: list[int] = Field(description="[] for a scalar")
    data: str | list[Any] | float | bool = Field(
        description="base64 of the buffer, or nested lists of numbers ([re, im] for complex)")


class ArrayMsgpack(BaseModel):
    """An array in msgpack: ``data`` is a ``bin`` of the C-order little-endian bytes."""

    dtype: str = Field(description="a name in jitserve.wire.DTYPES, e.g. float32")
    shape: list[int] = Field(description="[] for a scalar")
    data: bytes = Field(description="msgpack bin: the C-order little-endian buffer")


class FutureRef(_Strict):
    """An input that is output ``output`` of an earlier future, kept on the device."""

    future: str = Field(description="a future_id of the same API key")
    output: int = Field(ge=0, description="which output of that future")


# XLA option names to their values (``compiler.options`` says which names are taken).
CompilerOptions = dict[str, StrictBool | StrictInt | StrictFloat | StrictStr]
_COMPILER_OPTIONS = (
    "XLA options for the executable, as jax.jit's compiler_options (for example "
    "{\"xla_cpu_enable_fast_math\": true}): part of its cache key. Only the names "
    "jitserve.compiler.options allows (numerics and optimization effort); any other "
    "is refused with 400 invalid_program naming it")


class _ExecuteOptions(_Strict):
    """What an execute's body says besides its arguments."""

    static_key: str = Field("", max_length=4096)
    timeout_s: float | None = Field(
        None, gt=0, description="seconds this execution may run (at most the server's "
        "JITSERVE_EXECUTION_TIMEOUT_S, which also applies when this is omitted); past it "
        "the future fails with execution_timeout")
    donate: list[int] = Field(
        default_factory=list, max_length=MAX_RELEASE, description="indices of args the "
        "run may consume (jax.jit's donate_argnums): an output of the same type reuses "
        "its buffer; the future outputs they name are released")
    compiler_options: CompilerOptions = Field(
        default_factory=dict, max_length=MAX_OPTIONS, description=_COMPILER_OPTIONS)


class ExecuteJSON(_ExecuteOptions):
    """Body of an execute, in JSON: the flattened input leaves, in order."""

    args: list[ArrayJSON | FutureRef]


class ExecuteMsgpack(_ExecuteOptions):
    """Body of an execute, in msgpack: the flattened input leaves, in order."""

    args: list[ArrayMsgpack | FutureRef]


MAX_CALLS = 1024  # calls in one POST /v1/calls


class CallRef(_Strict):
    """An input that is output ``output`` of call ``call`` of the same batch (an earlier one)."""

    call: int = Field(ge=0, description="the index of an earlier call of this batch")
    output: int = Field(ge=0, description="which output of that call")


class _Call(_ExecuteOptions):
    program_id: str = Field(max_length=256)
    inline: bool = Field(False, description=(
        "with ?wait: the answer waits for this call too, and carries its outputs if "
        "they are small and it ended in time (its future is kept)"))


class CallJSON(_Call):
    """One call of ``POST /v1/calls``, in JSON."""

    args: list[ArrayJSON | FutureRef | CallRef]


class CallMsgpack(_Call):
    """One call of ``POST /v1/calls``, in msgpack."""

    args: list[ArrayMsgpack | FutureRef | CallRef]


class _CallsBody(_Strict):
    release: list[FutureRef] = Field(
        default_factory=list, max_length=MAX_RELEASE, description=(
            "outputs the caller lets go of, as ``POST /v1/futures/release`` takes them; "
            "released once the calls have started (a call still reads those it takes)"))


class CallsJSON(_CallsBody):
    """Body of ``POST /v1/calls``, in JSON: calls to start in order."""

    calls: list[CallJSON] = Field(max_length=MAX_CALLS)


class CallsMsgpack(_CallsBody):
    """Body of ``POST /v1/calls``, in msgpack: calls to start in order."""

    calls: list[CallMsgpack] = Field(max_length=MAX_CALLS)


class CallsItem(_Call):
    """One call as the route reads it (arrays stay as decoded by the codec)."""

    args: list[Any]


class CallsRequest(_CallsBody):
    calls: list[CallsItem] = Field(max_length=MAX_CALLS)


class CarriedOutputs(BaseModel):
    """The small outputs of an ``inline`` call whose other outputs are big."""

    outputs: list[int] = Field(description="which outputs, in order")
    values: list[ArrayJSON]


class CallStarted(BaseModel):
    """A call of the batch that was accepted: its future, to poll, fetch or pass on."""

    future_id: str
    status: str
    executable_id: str
    tier: str
    outputs: list[ArrayJSON] | None = Field(None, description=(
        "the outputs of an ``inline`` call that ended within ?wait (small ones only)"))
    carried: CarriedOutputs | None = Field(None, description=(
        "when some of those outputs are big: the small ones (a loss beside a model)"))


class CallRefused(BaseModel):
    """A call of the batch that was refused, with the error its own execute would get."""

    error: dict[str, Any] = Field(description='{"code": ..., "message": ...}, as any error')


class CallsAnswer(BaseModel):
    """The answer of ``POST /v1/calls``: one entry per call, in order."""

    calls: list[CallStarted | CallRefused]
    released: int = Field(0, description=(
        "the outputs of ``release`` let go of (its others, ``unknown``, are not "
        "the caller's); always there, so a client knows the server takes ``release``"))
    unknown: int = 0


class OutputsJSON(BaseModel):
    """The outputs of a done future (``200`` of a result, or of an execute that waited)."""

    future_id: str
    outputs: list[ArrayJSON]
    out_tree: Any = None


class ProgramInfo(BaseModel):
    """An uploaded program (``Program.to_json``)."""

    program_id: str
    format: str
    in_avals: list[AvalJSON]
    out_avals: list[AvalJSON] | None
    in_tree: Any = None
    out_tree: Any = None
    platforms: list[str]
    nr_devices: int = Field(1, description="the devices one run takes: more than 1 for a "
                            "sharded program (docs/runtimes.md, 'Devices')")
    sharding: dict[str, Any] | None = Field(
        None, description="a sharded jax_export's mesh ({axis: size}) and its inputs' and "
        "outputs' shardings as exported ('in', 'out': PartitionSpec text, or HLO sharding "
        "text; null unspecified)")
    name: str | None = Field(None, description="the model it is a version of (upload with "
                             "?name=, docs/v2.md)")
    version: int | None = Field(None, description="its version of that model: 1, 2, ...")


_REASONS = ("why it compiled: the parts of its key that differed from the nearest earlier "
            "key of the same program, e.g. 'shape: arg 0 float32[8] -> float32[16]'; null "
            "for a program's first executable")


class CostInfo(BaseModel):
    """XLA's cost analysis of an executable (estimates for one run)."""

    flops: float | None = None
    transcendentals: float | None = None
    bytes_accessed: float | None = None


class MemoryInfo(BaseModel):
    """XLA's memory analysis of an executable: device bytes of one run."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int = Field(description="outputs that reuse a donated input's buffer")
    temp_bytes: int = Field(description="intermediates, allocated for the run")
    generated_code_bytes: int = 0


class ShardingInfo(BaseModel):
    """How a sharded executable runs on its devices (docs/runtimes.md, 'Devices')."""

    device_count: int
    partitions: int
    replicas: int
    in_: list[str] = Field(alias="in", description="each input's HLO sharding, e.g. "
                           "'{devices=[2,2]<=[4]}'")
    out: list[str] = Field(description="each output's HLO sharding")
    out_device_bytes: list[int] = Field(
        default_factory=list, description="the device bytes each output takes on all its "
        "devices together (what a future counts against device-bytes limits): a replicated "
        "output counts once per copy")

    model_config = {"populate_by_name": True, "serialize_by_alias": True}


class ExecutableInfo(BaseModel):
    """A cached executable, as ``GET /v1/executables`` lists it.

    ``source`` says where the record comes from: ``redis`` (shared by every
    process; sizes, hits and last hit are kept there) or ``memory`` (this
    process's L1, when no Redis is configured; no hit counts).
    """

    executable_id: str
    program_id: str | None = None
    size: int | None = Field(None, description="stored bytes (compressed) in Redis")
    raw_size: int | None = Field(None, description="bytes of the serialized executable")
    compile_seconds: float | None = None
    created: float | None = Field(None, description="Unix seconds")
    last_hit: float | None = Field(None, description="Unix seconds; null before the first hit")
    hits: int | None = None
    jax_version: str | None = None
    jaxlib_version: str | None = None
    platform: str | None = None
    device_kind: str | None = None
    key_parts: dict[str, str] | None = Field(
        None, description="the named parts its cache key (the executable_id) hashes")
    recompiled_because: list[str] | None = Field(None, description=_REASONS)
    cost: CostInfo | None = None
    memory: MemoryInfo | None = None
    sharding: ShardingInfo | None = Field(None, description="null for a single-device "
                                          "executable")
    source: str


class ExecutableDeleted(BaseModel):
    """Answer of ``DELETE /v1/executables/{id}``: ``tiers`` held it (``memory``: a
    runtime's L1, ``disk``, ``redis``, ``index``: the server's table of calls)."""

    executable_id: str
    status: str = "deleted"
    tiers: list[str]


class ExecutablePage(BaseModel):
    """Answer of ``GET /v1/executables``: follow ``next_cursor`` until it is null."""

    executables: list[ExecutableInfo]
    next_cursor: str | None


class CompileRequest(_Strict):
    """Body of ``POST /v1/programs/{id}/compile``; all optional."""

    in_avals: list[AvalModel] | None = Field(
        None, description="needed only when the program has dynamic dimensions")
    static_key: str = Field("", max_length=4096)
    donate: list[int] = Field(default_factory=list, max_length=MAX_RELEASE, description=(
        "the inputs its calls will donate, as an execute's ``donate``: donation is "
        "part of what is compiled, so this compiles the executable those calls run"))
    compiler_options: CompilerOptions = Field(
        default_factory=dict, max_length=MAX_OPTIONS, description=_COMPILER_OPTIONS)


class CompileResult(BaseModel):
    """Answer of ``POST /v1/programs/{id}/compile``."""

    executable_id: str
    tier: str
    compile_seconds: float
    in_avals: list[AvalJSON]
    out_avals: list[AvalJSON]
    out_tree: Any = None
    recompiled_because: list[str] | None = Field(None, description=_REASONS)


class ArraysJSON(_Strict):
    """Body of ``POST /v1/arrays``, in JSON: the arrays to keep on the device."""

    arrays: list[ArrayJSON] = Field(min_length=1)


class ArraysMsgpack(_Strict):
    """Body of ``POST /v1/arrays``, in msgpack: the arrays to keep on the device."""

    arrays: list[ArrayMsgpack] = Field(min_length=1)


class ArraysRequest(_Strict):
    """Body of ``POST /v1/arrays`` (arrays stay as decoded by the codec)."""

    arrays: list[Any] = Field(min_length=1, max_length=MAX_RELEASE)


class ReleaseRequest(_Strict):
    """Body of ``POST /v1/futures/release``: the outputs the caller lets go of."""

    outputs: list[FutureRef] = Field(max_length=MAX_RELEASE)


class ReleaseResult(BaseModel):
    """Answer of ``POST /v1/futures/release``.

    ``unknown`` counts references to nothing of the caller's (unknown, expired, or
    already gone with their future): no error, since a client's garbage collector
    races expiry.
    """

    released: int
    unknown: int


class ExecuteRequest(_ExecuteOptions):
    """Body of ``POST /v1/programs/{id}/execute`` (arrays stay as decoded by the codec)."""

    args: list[Any]


class ExecuteAccepted(BaseModel):
    """The ``202`` answer of an execute: the future to poll."""

    future_id: str
    status: str
    out_avals: list[AvalJSON]
    out_tree: Any = None
    executable_id: str
    tier: str

    @classmethod
    def of(cls, fut: Future, tier: str) -> ExecuteAccepted:
        return cls(future_id=fut.future_id, status=fut.status.value,
                   out_avals=[a.to_json() for a in fut.out_avals], out_tree=fut.out_tree,
                   executable_id=fut.executable_id, tier=tier)


class TimingsView(BaseModel):
    queued_s: float | None
    compile_s: float
    run_s: float | None


class FutureView(BaseModel):
    """Answer of ``GET /v1/futures/{id}``."""

    future_id: str
    status: str
    out_avals: list[AvalJSON]
    out_tree: Any = None
    executable_id: str = Field("", description="what runs; \"\" while compiling (and for "
                                               "a batched call or put arrays)")
    tier: str = Field("", description="where the executable came from (memory, disk, redis, "
                                      "compiled), or pending (compiling), batched, put")
    error: dict[str, Any] | None
    timings: TimingsView
    created: float
    expires_at: float

    @classmethod
    def of(cls, fut: Future) -> FutureView:
        t = fut.timings
        compile_s = t.compile_s
        if fut.status is FutureStatus.COMPILING:  # the seconds so far
            compile_s = max(time.time() - fut.created, 0.0)
        return cls(future_id=fut.future_id, status=fut.status.value,
                   out_avals=[a.to_json() for a in fut.out_avals], out_tree=fut.out_tree,
                   executable_id=fut.executable_id, tier=fut.tier, error=fut.error,
                   created=fut.created, expires_at=fut.expires_at,
                   timings=TimingsView(queued_s=t.queued_s, compile_s=compile_s, run_s=t.run_s))


class ProgramDeleted(BaseModel):
    """Answer of ``DELETE /v1/programs/{id}``: the program is no longer the caller's."""

    program_id: str
    status: str = "deleted"


class DeleteResult(BaseModel):
    """Answer of ``DELETE /v1/futures/{id}``.

    ``status`` is ``cancelled`` when the execution was stopped (before or while it
    ran); a ``running`` one that could not be stopped says why in ``detail``.
    """

    future_id: str
    status: str
    detail: str | None = None


# The console's panels (``GET /v1/console/...``, ``service.console``): what the page at
# ``/console`` draws. A key is named by its digest's first 12 hex digits ("none"
# without keys); a non-admin key sees only its own programs, sessions and refusals.
class ConsoleViewer(BaseModel):
    """Who asked, as the console sees them."""

    key: str = Field(description="the caller's key: its digest's first 12 hex digits")
    admin: bool = Field(description="sees every key's (an admin key, or auth off)")


class ConsoleDevice(BaseModel):
    """One device (as ``GET /v1/devices`` lists it) and its memory."""

    model_config = ConfigDict(extra="allow")

    id: int
    group: int
    memory: dict[str, int] = Field(default_factory=dict, description=(
        "in_use bytes (on the CPU: the runtimes' live arrays there), and limit and peak "
        "where XLA reports them"))


class ConsoleRuntime(BaseModel):
    """One runtime process, as ``/readyz`` describes it, with its last exit."""

    model_config = ConfigDict(extra="allow")

    index: int
    state: str
    pid: int | None
    restarts: int
    in_flight: int
    group: int
    last_exit: str | None = Field(None, description="why its last process ended")
    last_exit_at: float | None = Field(None, description="when (seconds since the epoch)")
    last_exit_code: str | None = Field(None, description="what its work failed with")


class ConsoleExit(BaseModel):
    """A runtime process that ended."""

    at: float
    runtime: int
    generation: int
    why: str
    code: str


class ConsoleHolder(BaseModel):
    """What one key's live futures hold."""

    key: str
    live_futures: int
    device_bytes: int


class ConsoleDevices(BaseModel):
    """Answer of ``GET /v1/console/devices``."""

    viewer: ConsoleViewer
    backend: dict[str, Any]
    devices: list[ConsoleDevice]
    groups: list[dict[str, Any]]
    runtimes: list[ConsoleRuntime]
    exits: list[ConsoleExit] = Field(description="recent runtime exits, newest first")
    holders: list[ConsoleHolder] = Field(description="the keys whose futures hold device bytes")
    device_bytes_in_use: int = Field(description="held or promised by all live futures")
    max_device_bytes: int
    live_futures: int
    max_live_futures: int


class ConsoleCompile(BaseModel):
    """A lookup the API process's index could not answer: compiled, loaded, or refused."""

    at: float
    key: str
    program_id: str
    name: str = Field(description="the exported function's name, when known")
    signature: str
    tier: str = Field(description="memory, disk, redis, compiled; failed when refused")
    seconds: float
    executable_id: str
    recompiled_because: list[str] | None = Field(
        description="what differed from the program's last compile, when it compiled")
    error: dict[str, str] | None = Field(description="code and message of a refusal")


class ConsoleProgram(BaseModel):
    """A program's compiles among those kept."""

    key: str
    program_id: str
    name: str
    compiles: int
    seconds: float
    signatures: list[str]
    recompiled_because: list[str] | None


class ConsoleTierPoint(BaseModel):
    t: int = Field(description="the first second of the point (since the epoch)")
    tiers: dict[str, int] = Field(description="calls by the tier of their executable")
    hit_rate: float | None = Field(description="memory, disk and redis of all; null: no calls")


class ConsoleTierTotals(BaseModel):
    tiers: dict[str, int]
    hit_rate: float | None


class ConsoleTiers(BaseModel):
    """Where calls' executables came from, over the last minutes."""

    window_s: int
    step_s: int
    points: list[ConsoleTierPoint]
    totals: ConsoleTierTotals


class ConsoleCompiles(BaseModel):
    """Answer of ``GET /v1/console/compiles``."""

    viewer: ConsoleViewer
    recent: list[ConsoleCompile] = Field(description="newest first")
    kept: int = Field(description="how many of the caller's are kept (the newest 512 of all)")
    failed: int
    slowest: list[ConsoleCompile]
    most_recompiled: list[ConsoleProgram]
    hit_rate: ConsoleTiers


class ConsoleWorkPoint(BaseModel):
    t: int = Field(description="the first second of the point (since the epoch)")
    calls: int = Field(description="calls that ended (done, failed or cancelled)")
    per_s: float
    errors: dict[str, int] = Field(description="failed calls and refused requests, by code")
    p50_s: float | None = Field(description="latency from accepted to ended (bins of 26%)")
    p90_s: float | None
    p99_s: float | None


class ConsoleQuotaRefusal(BaseModel):
    key: str
    quota: str
    count: int


class ConsoleWorkTotals(BaseModel):
    calls: int
    per_s: float
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    errors: dict[str, int]
    quota_refusals: list[ConsoleQuotaRefusal]


class ConsoleWork(BaseModel):
    """Answer of ``GET /v1/console/work``."""

    viewer: ConsoleViewer
    window_s: int
    step_s: int
    now: float
    points: list[ConsoleWorkPoint]
    totals: ConsoleWorkTotals


class ConsoleSession(BaseModel):
    """An open IFRT proxy session."""

    session: str
    key: str
    runtime: int
    protocol: int
    age_s: float
    requests: int
    bytes_in: int
    bytes_out: int
    host_bytes_held: int = Field(description="host buffers waiting here")
    host_bytes_incoming: int = Field(0, description="host buffers on their way here")
    stores_held_back: list[int] = Field(
        default_factory=list, description="host buffers whose stores wait for room "
                                          "(JITSERVE_IFRT_MAX_HOST_BYTES)")
    requests_queued: int = Field(0, description="requests read, waiting for the next batch")
    request_bytes_queued: int = Field(0, description="their bytes (at most 64 MiB and one "
                                                     "request: past it the stream waits)")
    device_bytes: int = Field(description="its arrays' device bytes, as of its last batch")
    compiles: dict[str, int] = Field(description="by tier")
    waiting_for_host_buffers: list[int] = Field(
        default_factory=list, description="host buffers its next requests wait for")


class ConsoleSessions(BaseModel):
    """Answer of ``GET /v1/console/sessions``."""

    viewer: ConsoleViewer
    enabled: bool = Field(description="whether the IFRT proxy listens (JITSERVE_IFRT_PORT)")
    sessions: list[ConsoleSession]



def parse(model: type[M], obj: Any, what: str) -> M:
    """Validate a decoded body against ``model``; ``BadRequest`` naming the problem."""
    if obj is None:
        obj = {}
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(map(str, err['loc'])) or what}: {err['msg']}"
                          for err in e.errors()[:5])
        raise BadRequest(f"invalid {what}: {where}") from None
