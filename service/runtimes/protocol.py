"""The runtime protocol: every message between the API process and a runtime.

The API process (``pool``) and each runtime process (``child``) speak over two
pipes, one each way. A message is one msgpack map in one frame (``frames``: a
length, then the bytes). Arrays travel inside it when small, or in a
shared-memory segment it names (``ArrayDesc``). Every kind of message is
declared here, with its fields; ``pool`` and ``child`` say nothing else. The
types are ``TypedDict``s: the messages stay plain dicts, which msgpack packs
as they are, and a type costs nothing at run time (a run's message is on every
call's path). An ``Op`` or a ``Kind`` packs as its plain string.

**Handshake.** The API process starts a runtime and sends it ``Config`` (the
server's settings and this runtime's limits; no ``id``, no ``op``). The runtime
applies the limits, opens its device, and answers ``Ready`` (``id`` 0, ``kind``
``ready``: its pid, backend and device). Requests follow, until the API process
closes the pipe or kills the runtime.

**Requests** (API process -> runtime) are ``{"id": n, "op": <Op>, ...}``: ``id`` a
positive integer, unique to the process it goes to; the rest is the op's request
below. Any request may also carry ``free``, handles of outputs to drop before it
is served (frees ride on requests: ``RuntimePool.free``)::

    op       request          answer           what the runtime does
    decode   DecodeRequest    DecodeAnswer     decode, validate and store an upload
    program  ProgramRequest   ProgramAnswer    a stored program, from the cache tiers
    lookup   LookupRequest    LookupAnswer     find, load or compile an executable
    run      RunRequest       RunAnswer        run it; ``SplitAnswer`` with ``split``
    put      PutRequest       PutAnswer        keep host arrays on the device
    fetch    FetchRequest     FetchAnswer      copy outputs back to the host
    forget   ForgetRequest    ForgetAnswer     drop an executable from every tier
    text     TextRequest      TextAnswer       an executable's optimized HLO, as text
    stats    StatsRequest     StatsAnswer      counters, for /metrics and /readyz
    free     FreeRequest      (none)           drop outputs; no ``id``, no answer
    ifrt     IfrtRequest      IfrtAnswer       one batch of an IFRT proxy session, in order
    ifrt_read IfrtReadRequest IfrtReadAnswer   a big host buffer a batch made
    ifrt_close IfrtCloseRequest IfrtCloseAnswer drop a session's arrays and executables

**Replies** (runtime -> API process) are ``{"id": n, "kind": <Kind>, ...}``:

- ``ready``: unasked, once, after ``Config`` (``Ready``).
- ``started``: unasked, ``{"id", "kind"}``: run ``id`` has begun, and its
  deadline counts from now. A run known to be quick says it only if it overruns
  (``child._QuickWatch``), 50-100 ms late.
- ``ok``: the answer to request ``id``: ``{"id", "kind", **answer}``, the answer
  being that op's (the API process adds ``generation``, the process that answered).
- ``error``: request ``id`` failed (``Failure``): ``code`` (a ``wire.ErrorCode``
  value, or ``execution_failed``) and ``message``.

**Runs sent ahead.** A run may name the handles of its outputs (``out``). From
the moment the runtime reads it, those handles are *promised*: a later run may
take them as arguments, and waits, holding no run slot, until the run that makes
them has ended; a free of one drops the output as soon as it is made. If that run
fails (or is cancelled), the runs waiting on its outputs fail with
``dependency_failed``, naming the argument and the first failure (``root``), whose
words a chain passes on instead of nesting each link's. The API process
sends a call whose inputs are still being computed at once this way, without
waiting for their run's answer, so the runtime goes from one run to the next
without a round trip to the API process between them.

**Errors.** A request whose ``op`` is none of ``Op`` is a protocol error: its answer
is an ``error`` with code ``internal`` whose message names the op, and the runtime
serves on. A handler's failure is its request's ``error`` (``unknown_program``,
``future_expired``, a compiler error's code, ``out_of_memory``,
``execution_failed``); the runtime serves on. A runtime that exits answers nothing
more: the API process fails what it had in flight, with the reason it read from
the exit status (docs/runtimes.md). A runtime that runs out of memory outside any
request (starting, under too small a cap) exits with ``EXIT_OUT_OF_MEMORY``.

**Who may send what.** Only the API process sends ``Config`` and requests; only a
runtime sends replies, and only to requests it was sent (``ready`` and ``started``
are the unasked ones). A runtime maps only the segments a request names, and the
API process checks segment names against their pattern before it opens one. A
runtime runs what strangers upload, so the API process trusts no reply: a frame
that is not a map is *garbled*, and its runtime is killed and restarted
(``pipes.LoopReader``); a reply to no request in flight is dropped.
"""

from __future__ import annotations

import enum
from typing import Any, NotRequired, TypeAlias, TypedDict

# The exit status of a runtime that ran out of memory outside any request.
EXIT_OUT_OF_MEMORY = 86

__all__ = [
    "EXIT_OUT_OF_MEMORY", "ArgDesc", "ArrayDesc", "AvalDoc", "Config", "DecodeAnswer",
    "DecodeRequest", "DeviceDoc", "ExecutableDoc", "Failure", "FetchAnswer", "FetchInto",
    "FetchRequest", "ForgetAnswer", "ForgetRequest", "FreeRequest", "IfrtAnswer", "IfrtCloseAnswer",
    "IfrtCloseRequest", "IfrtCompiled", "IfrtReadAnswer", "IfrtReadRequest", "IfrtRequest", "Kind",
    "LookupAnswer", "LookupRequest", "Op", "ProgramAnswer", "ProgramDoc", "ProgramRequest",
    "PutAnswer", "PutRequest", "Ready", "Reply", "RunAnswer", "Root", "RunRequest", "SplitAnswer",
    "StatsAnswer", "StatsRequest",
]


class Op(enum.StrEnum):
    """Every request the API process sends a runtime: a request's ``op``."""

    DECODE = "decode"
    PROGRAM = "program"
    LOOKUP = "lookup"
    RUN = "run"
    PUT = "put"
    FETCH = "fetch"
    FORGET = "forget"
    TEXT = "text"
    STATS = "stats"
    FREE = "free"
    CANCEL = "cancel"  # no answer of its own: a queued run leaves the queue
    IFRT = "ifrt"
    IFRT_READ = "ifrt_read"
    IFRT_CLOSE = "ifrt_close"


class Kind(enum.StrEnum):
    """Every message a runtime sends: a reply's ``kind``."""

    READY = "ready"  # unasked, once: the runtime is up
    STARTED = "started"  # unasked: a run began, its deadline counts
    OK = "ok"  # a request's answer
    ERROR = "error"  # a request's failure


# -- parts of messages --------------------------------------------------------------

# One array (``frames.write_arrays``): ``dtype`` (a ``wire`` dtype name) and ``shape``,
# then either its bytes (``data``) or where they lie in a shared-memory segment
# (``shm``, the segment's name, and ``offset``). A dict, not a TypedDict: its two
# forms share one reader, and the API process builds it on every call.
ArrayDesc: TypeAlias = dict[str, Any]
# One argument of a run: an ``ArrayDesc``, or an output already on the runtime,
# ``{"handle": int}``, with ``"give": True`` when the run may consume it (donated,
# and held by nothing else). A given handle is the run's from then on: the runtime
# drops it with the run however the run ends, and the API process sends no free of it.
ArgDesc: TypeAlias = dict[str, Any]
# ``wire.Aval.to_json()``: shape, dtype, weak type.
AvalDoc: TypeAlias = dict[str, Any]
# ``Program.to_json()`` and its ``name``: the signature the API process keeps.
ProgramDoc: TypeAlias = dict[str, Any]


class DeviceDoc(TypedDict):
    """The device a runtime owns."""

    id: int
    platform: str
    device_kind: str
    # The bytes XLA's allocator lets this runtime hold on it (the device's memory times
    # the runtime's share, ``XLA_PYTHON_CLIENT_MEM_FRACTION``); absent where the
    # backend reports none (the CPU).
    memory_limit: NotRequired[int]


class ExecutableDoc(TypedDict):
    """An executable's signature and record (``calls.executables.RemoteExecutable``)."""

    executable_id: str
    tier: str  # where the lookup found it (``wire.TierName``)
    compile_seconds: float
    nbytes: int
    in_avals: list[AvalDoc]
    out_avals: list[AvalDoc]
    out_tree: Any  # the outputs' pytree, as the compiler serializes it
    memory: dict[str, Any] | None  # XLA's memory analysis (``MemoryStats.to_json``)
    meta: dict[str, Any]


class FetchInto(TypedDict):
    """Where a fetch's big outputs go: a segment of the API process's, at offsets
    (``None``: that output comes inline)."""

    shm: str
    offsets: list[int | None]


# -- the handshake ------------------------------------------------------------------


class Config(TypedDict):
    """The first message to a runtime: the server's settings and its own limits."""

    settings: dict[str, Any]  # ``Settings`` as plain values, secrets included
    platform: str  # ``cpu`` or ``gpu``
    max_memory_bytes: int | None  # the address-space cap (CPU)
    log_level: str
    isolate_network: bool  # leave the network (no Redis to reach)
    max_devices: NotRequired[int]  # the largest device group's: what an upload may need
    index: NotRequired[int]  # its place in the pool, added per runtime


class Reply(TypedDict):
    """What every message from a runtime carries; a ``started`` is no more."""

    id: int
    kind: Kind


class Ready(Reply):
    """A runtime is up (``id`` 0): the answer to ``Config``."""

    pid: int
    backend: dict[str, Any]  # ``Compiler.backend_info()``
    device: DeviceDoc  # where single-device programs run
    devices: list[DeviceDoc]  # all of them: a sharded program runs on the first N


class Root(TypedDict):
    """The first failure of a chain of runs, each of which reads an output of the one
    before (``dependency_failed``): its ``code`` and ``message``."""

    code: str
    message: str


class Failure(Reply):
    """Request ``id`` failed (``kind`` ``error``); a run whose input's run failed also
    says which failure began the chain (``root``)."""

    code: str
    message: str
    root: NotRequired[Root]


# -- requests and their answers -----------------------------------------------------


class DecodeRequest(TypedDict):
    # The bytes, as a uint8 ``ArrayDesc``: inline when small, else in a segment, so
    # a big upload crosses with one copy in and one out (``frames``), not four.
    program: ArrayDesc
    format: str | None  # a ``wire.ProgramFormat`` value; ``None``: sniff it


class DecodeAnswer(TypedDict):
    program: ProgramDoc
    created: bool  # not stored before


class ProgramRequest(TypedDict):
    program_id: str


class ProgramAnswer(TypedDict):
    program: ProgramDoc | None  # ``None``: no tier has it
    payload: NotRequired[bytes]  # with a program: its bytes


class LookupRequest(TypedDict):
    program_id: str
    static_key: str
    donate: list[int]
    avals: list[AvalDoc] | None  # ``None``: the program's own
    compile: NotRequired[bool]  # ``False``: answer ``miss`` rather than compile (default ``True``)
    scope: NotRequired[str]  # the tenant's keys, when tenants share no executables
    # the caller's XLA options (``jax.jit``'s ``compiler_options``), of ``compiler.options``
    compiler_options: NotRequired[dict[str, Any]]


class LookupAnswer(TypedDict, total=False):
    """Exactly one of: ``executable``, or ``miss`` (the executable's id), when the
    request said not to compile and no tier has it."""

    executable: ExecutableDoc
    miss: str


class RunRequest(TypedDict):
    executable_id: str
    program_id: str  # to compile from, should no tier have the executable any more
    static_key: str
    donate: list[int]
    avals: list[AvalDoc]
    args: list[ArgDesc]
    split: NotRequired[list[int]]  # a batch's rows per call (``calls.batching``)
    scope: NotRequired[str]  # as ``LookupRequest``'s, to compile again under
    compiler_options: NotRequired[dict[str, Any]]  # as ``LookupRequest``'s
    # The handles its outputs take, chosen by the API process (negative: the
    # runtime's own are positive), so that runs sent after it may name them as
    # arguments before it has run ("Runs sent ahead" above).
    out: NotRequired[list[int]]


class RunAnswer(TypedDict):
    handles: list[int]  # the outputs, kept on the device
    run_s: float
    # Each output's value when small (``wire.carried_outputs``), ``None`` for the others.
    values: NotRequired[list[ArrayDesc | None]]


class SplitAnswer(TypedDict):
    """A batched run's: per call, its pieces of every output, and their values when small."""

    handles: list[list[int]]
    values: list[list[ArrayDesc] | None]
    run_s: float


class PutRequest(TypedDict):
    args: list[ArrayDesc]


class PutAnswer(TypedDict):
    handles: list[int]


class FetchRequest(TypedDict):
    handles: list[int]
    into: NotRequired[FetchInto]  # without it, every output comes inline


class FetchAnswer(TypedDict):
    arrays: list[ArrayDesc]


class ForgetRequest(TypedDict):
    executable_id: str


class ForgetAnswer(TypedDict):
    tiers: list[str]  # those that held it


class TextRequest(TypedDict):
    executable_id: str


class TextAnswer(TypedDict):
    text: str | None  # ``None``: no tier has it


class StatsRequest(TypedDict, total=False):
    memory: bool  # with ``device_memory`` (a walk over the live arrays on the CPU)


class StatsAnswer(TypedDict):
    buffers: int  # outputs held
    compilations: int
    l1_entries: int
    l1_bytes: int
    cache: str  # the shared cache's state (``compiler.catalog``)
    redis: dict[str, Any] | None  # its counters; ``None`` without Redis
    runs: int
    quick_runs: int  # done by the thread that read them
    quick_runs_overran: int  # quick runs that said ``started`` late
    relaid: int  # kept outputs moved to the layout a run wanted
    # Runs sent ahead: those that waited here for another run's outputs; handles
    # promised and not made yet; handles whose run failed, not freed yet.
    runs_waited: int
    promised: int
    failed_handles: int
    device_runs: list[int]  # runs so far on each of its devices (a sharded run: its first's)
    # Each of its devices' memory: ``in_use`` bytes, and ``limit`` and ``peak`` where
    # XLA reports them (GPU); on the CPU, ``in_use`` is the bytes of its live arrays there.
    device_memory: NotRequired[list[dict[str, int]]]


class FreeRequest(TypedDict):
    handles: list[int]


class CancelRequest(TypedDict):
    """Take run ``run`` (a request id) out of the queue if it has not begun; that run
    is then answered ``future_cancelled``. Not answered itself (a run that began, or
    ended, goes on as if it had not been sent)."""

    run: int


class IfrtRequest(TypedDict):
    """A batch of one IFRT proxy session (``service.ifrt``), answered in order."""

    session: int  # the session's id (the one its InitResponse names)
    owner: str  # the key digest the session belongs to ("" without keys)
    scope: NotRequired[str]  # its executables' keys (``LookupRequest``); "" when shared
    requests: list[bytes]  # serialized ``xla.ifrt.proxy.IfrtRequest``s
    buffers: dict[int, ArrayDesc]  # host buffers the requests name, as uint8 arrays
    # host buffers the requests name that the server refused (over a limit): why
    refused: NotRequired[dict[int, str]]
    # the host bytes the API process holds for the session (held) and its limit (max,
    # JITSERVE_IFRT_MAX_HOST_BYTES), which copies to host not read yet are checked against
    host: NotRequired[dict[str, int]]
    # the key's quotas (device_bytes, arrays, compiles_per_minute), and what its /v1
    # futures hold of the first two (v1_device_bytes, v1_futures); absent without keys
    quotas: NotRequired[dict[str, int]]
    # device bytes one run may allocate on a device (the server's per-run limit,
    # JITSERVE_MAX_EXECUTION_BYTES as set or derived): a run past it is refused
    max_run_bytes: NotRequired[int]


class IfrtCompiled(TypedDict):
    """One compile of an IFRT batch: where its executable came from (``tier``), the
    program (its bytes' sha256, and the name XLA gave it), its input avals, the seconds
    it took, and why it compiled although the program had another key."""

    tier: str
    program_id: str
    name: str
    executable_id: str
    signature: str
    seconds: float
    recompiled_because: list[str] | None


class IfrtAnswer(TypedDict):
    responses: list[bytes]  # serialized ``IfrtResponse``s, one per request
    # host buffers the batch made (``copy_to_host_buffer``), by handle: an ``ArrayDesc``
    # (inline) when small, else ``{"nbytes": n}``: read it with ``ifrt_read``
    host: dict[int, dict[str, Any]]
    compiles: list[IfrtCompiled]  # what each compile of the batch found
    device_bytes: int  # the session's arrays' device bytes here, after the batch
    arrays: int  # and how many arrays count for its key


class IfrtReadRequest(TypedDict):
    session: int
    handle: int
    into: FetchInto  # the segment the bytes go to (one array of uint8)


class IfrtReadAnswer(TypedDict):
    arrays: list[ArrayDesc]


class IfrtCloseRequest(TypedDict):
    session: int


class IfrtCloseAnswer(TypedDict, total=False):
    arrays: int
    executables: int
    compiles: int
    executes: int
