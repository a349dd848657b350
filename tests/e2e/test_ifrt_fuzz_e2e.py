"""Fuzzing the IFRT proxy's sessions through one real server: every request is answered.

jaxlib's client is one client of the protocol; anyone who can open a session can
send any ``IfrtRequest``. This module opens sessions on one ``jitserve serve``
and sends requests of every type the protocol has, their fields drawn from the
message descriptors jitserve builds from jaxlib (``compiler.ifrt_protos``): numbers
at their extremes, handles of arrays and an executable that exist and of ones that
do not, shardings of devices that exist and of ones that do not, dimensions
negative or too big, type names and bytes of the wrong kind. Each session starts
as a program's would: a host buffer, two arrays made from it, a compiled program,
so that the requests reach what lies behind the handles. For every session:

- every request is answered, in a bounded time (a host buffer that never comes is
  waited for ``JITSERVE_IFRT_HOST_BUFFER_WAIT_S``, here 0.2 s);
- no answer is INTERNAL, unless it repeats an error the session itself made
  (``make_error_arrays``): INTERNAL is what jitserve answers a failure it did not
  foresee (``service.runtimes.ifrt._classify``);
- ``/healthz`` answers 200 afterwards.

At the end no runtime was restarted: a request, unlike a program, gives a runtime
nothing to crash on.

Hypothesis runs derandomized with a small budget (40 sessions; the module takes
about 20 s here), as the other fuzz modules do. Run longer by hand, it found two
faults that are fixed: a layout of a negative dimension answered INTERNAL, and so
did reading an array after ``delete_array``; over 1,000 sessions since, none.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import _free_port, _serve, metric_total
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import export

from jitserve.compiler.ifrt_protos import message

pytestmark = pytest.mark.timeout(300)

P = "xla.ifrt.proxy."
SESSION = "/xla.ifrt.proxy.GrpcIfrtService/IfrtSession"
STORE = "/xla.ifrt.proxy.GrpcIfrtService/HostBufferStore"
MADE = "fuzz-made error"  # the message of every error array a session makes itself
_ARRAYS = (1, 2)  # the handles of the two arrays each session makes first
_BUFFER = 11  # and of the host buffer it makes them from
# How long a session's answers may take: each request that names a host buffer
# that never comes waits 0.2 s, a run at most its 3 s deadline.
_ANSWERS_S = 60.0


@pytest.fixture(scope="module")
def ifrt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    port = _free_port()
    env = {"JITSERVE_IFRT_PORT": str(port), "JITSERVE_RUNTIMES": "1",
           "JITSERVE_EXECUTION_TIMEOUT_S": "3", "JITSERVE_IFRT_HOST_BUFFER_WAIT_S": "0.2"}
    for url in _serve(tmp_path_factory.mktemp("ifrt-fuzz"), env):
        yield {"url": url, "target": f"127.0.0.1:{port}"}


@pytest.fixture(scope="module")
def program() -> bytes:
    """A StableHLO portable artifact, as jaxlib's client sends in a compile: f32[4] -> f32[4]."""
    exported = export.export(jax.jit(lambda x: x * 2.0 + 1.0))(
        jax.ShapeDtypeStruct((4,), jnp.float32))
    return bytes(exported.mlir_module_serialized)


# -- drawing requests ---------------------------------------------------------------

_INTS = [0, 1, 2, 3, 4, 7, 64, 1 << 20, 1 << 40, 2**31 - 1, 2**63 - 1, -1, -2, -2**31, -2**63]
_TYPE_NAMES = ["xla::ifrt::SingleDeviceSharding", "xla::ifrt::ConcreteEvenSharding",
               "xla::ifrt::ConcreteSharding", "xla::ifrt::OpaqueSharding", "xla::ifrt::HloSharding",
               "xla::ifrt::XlaProgram", "xla::ifrt::XlaCompileOptions", "", "no::such::Type"]
_RANGES = {FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1),
           FieldDescriptor.TYPE_SINT32: (-2**31, 2**31 - 1),
           FieldDescriptor.TYPE_SFIXED32: (-2**31, 2**31 - 1),
           FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
           FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1)}


def _int(data: st.DataObject, field: FieldDescriptor, handles: list[int]) -> int:
    lo, hi = _RANGES.get(field.type, (-2**63, 2**63 - 1))
    if "handle" in field.name:  # mostly what the session holds, so requests reach it
        value = data.draw(st.sampled_from(handles) | st.sampled_from(handles)
                          | st.sampled_from(_INTS) | st.integers(-3, 70))
    elif "device" in field.name:
        value = data.draw(st.sampled_from([0, 0, 1, 7, -1, 2**31 - 1]))
    elif field.name == "dims":  # the arrays' own shape, mostly
        value = data.draw(st.sampled_from([4, 4, 2, 1, 0, -1, 2**40]))
    else:
        value = data.draw(st.sampled_from(_INTS) | st.integers(-3, 70))
    return min(hi, max(lo, value))


def _scalar(data: st.DataObject, field: FieldDescriptor, handles: list[int]) -> Any:
    kind = field.type
    if kind == FieldDescriptor.TYPE_BOOL:
        return data.draw(st.booleans())
    if kind == FieldDescriptor.TYPE_STRING:
        if field.name == "type_name":
            return data.draw(st.sampled_from(_TYPE_NAMES))
        return data.draw(st.sampled_from(["", "{0,1}", "cpu", "device", "x" * 300])
                         | st.text(max_size=12))
    if kind == FieldDescriptor.TYPE_BYTES:
        return data.draw(st.binary(max_size=48))
    if kind == FieldDescriptor.TYPE_ENUM:
        values = [v.number for v in field.enum_type.values]
        if field.enum_type.full_name == "xla.ifrt.DTypeProto.Kind":  # the arrays' own, mostly
            return data.draw(st.sampled_from([_F32, _F32, *values]))
        return data.draw(st.sampled_from(values))
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return data.draw(st.sampled_from([0.0, -1.0, 1.5, 1e300, float("nan")]))
    return _int(data, field, handles)


def _fill(data: st.DataObject, msg: Any, handles: list[int], depth: int,
          mutate: bool = False) -> None:
    """Set some of ``msg``'s fields, drawn (``mutate``: a few of them, in a well-formed
    request); messages nested at most a few levels."""
    for field in msg.DESCRIPTOR.fields:
        # Most fields set: a request that says little is refused before it reaches anything.
        if (data.draw(st.integers(0, 7)) != 0) if mutate else (data.draw(st.integers(0, 3)) == 0):
            continue
        repeated = field.is_repeated
        count = data.draw(st.integers(0, 3)) if repeated else 1
        for _ in range(count):
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                if depth >= 4 or field.message_type.GetOptions().map_entry:
                    break
                sub = getattr(msg, field.name).add() if repeated else getattr(msg, field.name)
                sub.SetInParent()
                if field.message_type.full_name == "xla.ifrt.Serialized" and data.draw(
                        st.booleans()):
                    _sharding(data, sub)
                else:
                    _fill(data, sub, handles, depth + 1, mutate)
            elif repeated:
                getattr(msg, field.name).append(_scalar(data, field, handles))
            else:
                setattr(msg, field.name, _scalar(data, field, handles))


def _sharding(data: st.DataObject, serialized: Any) -> None:
    """A single-device sharding, as the client serializes one, of a device that may be."""
    serialized.type_name = "xla::ifrt::SingleDeviceSharding"
    serialized.data = message("xla.ifrt.SingleDeviceShardingProto")(
        device_id=data.draw(st.sampled_from([0, 1, -1, 99]))).SerializeToString()


def _single(device: int = 0) -> dict[str, Any]:
    return {"type_name": "xla::ifrt::SingleDeviceSharding",
            "data": message("xla.ifrt.SingleDeviceShardingProto")(
                device_id=device).SerializeToString()}


def _well_formed(kind: str, handles: list[int], fresh: int) -> dict[str, Any] | None:
    """A request of ``kind`` as jaxlib's client sends it, on what the session holds
    (``handles``: its two arrays, its executable, its host buffer; ``fresh``: a handle
    for what it makes); ``None`` for the kinds drawn only at random."""
    array, other, executable, buffer = handles
    f32 = {"kind": _F32}
    return {
        "loaded_executable_execute_request": {
            "loaded_executable_handle": executable, "args_handles": [array],
            "result_array_handle": [fresh], "result_status_handle": fresh + 1,
            "execute_options": {"fill_status": True}},
        "make_array_from_host_buffer_request": {
            "dtype": f32, "shape": {"dims": [4]}, "host_buffer_handle": buffer,
            "array_handle": fresh, "sharding": {"serialized_sharding": _single()}},
        "copy_to_host_buffer_request": {"array_handle": array, "host_buffer_handle": fresh},
        "disassemble_into_single_device_arrays_request": {
            "array_handle": array, "result_handles": [fresh]},
        "assemble_array_from_single_device_arrays_request": {
            "shape": {"dims": [4]}, "sharding": {"serialized_sharding": _single()},
            "single_device_array_handles": [array], "result_handle": fresh, "dtype": f32},
        "fully_replicated_shard_request": {"array_handle": array, "result_handle": fresh},
        "copy_arrays_request": {"array_handles": [array, other], "device_ids": [0],
                                "result_handles": [fresh, fresh + 1]},
        "check_value_ready_request": {"value_handles": [array, other]},
        "loaded_executable_metadata_request": {"loaded_executable_handle": executable},
        "loaded_executable_cost_analysis_request": {"loaded_executable_handle": executable},
    }.get(kind)


def _request(data: st.DataObject, kinds: list[str], handles: list[int], op: int) -> Any:
    request = message(P + "IfrtRequest")()
    kind = data.draw(st.sampled_from(kinds))
    fields = _well_formed(kind, handles, 100 + op * 2)
    if fields is not None and data.draw(st.booleans()):  # well formed, then changed a little
        request = message(P + "IfrtRequest")(**{kind: fields})
        _fill(data, getattr(request, kind), handles, 1, mutate=True)
    else:
        getattr(request, kind).SetInParent()
        _fill(data, getattr(request, kind), handles, 1)
    body = getattr(request, kind)
    if kind == "make_error_arrays_request":
        body.error.message = MADE
    request.request_metadata.op_id = op
    return request


# -- a session ----------------------------------------------------------------------


class _Session:
    """One session over grpc's Python client: requests sent, answers read by op id."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        opening = message(P + "GrpcIfrtSessionMetadata")()
        opening.version.protocol_version = 25
        opening.version.ifrt_serdes_version_number = 3
        self._out: queue.Queue[bytes | None] = queue.Queue()
        self._answers = self.channel.stream_stream(SESSION)(
            iter(self._out.get, None),
            metadata=[("ifrt-proxy-grpc-ifrt-session-metadata-bin", opening.SerializeToString())])
        self.op = 0
        self.got: dict[int, Any] = {}
        self.ended: grpc.RpcError | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.id = self.wait(self.send(init_request={})).init_response.session_id

    def _read(self) -> None:
        try:
            for raw in self._answers:
                answer = message(P + "IfrtResponse").FromString(raw)
                self.got[answer.response_metadata.op_id] = answer
        except grpc.RpcError as e:
            self.ended = e

    def send(self, request: Any = None, **fields: Any) -> int:
        self.op += 1
        if request is None:
            request = message(P + "IfrtRequest")(**fields)
        request.request_metadata.op_id = self.op
        self._out.put(request.SerializeToString())
        return self.op

    def wait(self, op: int, within_s: float = _ANSWERS_S) -> Any:
        deadline = time.monotonic() + within_s
        while op not in self.got and self.ended is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert op in self.got, (f"request {op} unanswered after {within_s} s"
                                f"{f' (the stream ended: {self.ended})' if self.ended else ''}")
        return self.got[op]

    def store(self, handle: int, data: bytes) -> None:
        meta = message(P + "GrpcHostBufferStoreMetadata")(session_id=self.id, handle=handle,
                                                         buffer_size=len(data))
        self.channel.stream_unary(STORE)(
            iter([message(P + "GrpcHostBufferStoreRequest")(data=data).SerializeToString()]),
            metadata=[("ifrt-proxy-grpc-host-buffer-store-metadata-bin", meta.SerializeToString())])

    def close(self) -> None:
        self._out.put(None)
        self.channel.close()


def _started(target: str, program: bytes) -> tuple[_Session, int]:
    """A session holding what a program's first requests make: two f32[4] arrays on
    device 0 and a compiled program; the session and its executable's handle."""
    session = _Session(target)
    session.store(_BUFFER, np.arange(4, dtype=np.float32).tobytes())
    sharding = {"type_name": "xla::ifrt::SingleDeviceSharding",
                "data": message("xla.ifrt.SingleDeviceShardingProto")(device_id=0).SerializeToString()}
    for handle in _ARRAYS:
        made = session.wait(session.send(make_array_from_host_buffer_request={
            "dtype": {"kind": _F32}, "shape": {"dims": [4]}, "host_buffer_handle": _BUFFER,
            "array_handle": handle, "sharding": {"serialized_sharding": sharding}}))
        assert made.response_metadata.status.code == 0, made
        if handle == _ARRAYS[0]:
            session.store(_BUFFER, np.arange(4, dtype=np.float32).tobytes())  # taken: again
    options = message("xla.ifrt.XlaCompileOptionsProto")()
    build = options.compile_options.executable_build_options
    build.num_replicas = build.num_partitions = 1
    compiled = session.wait(session.send(compile_request={
        "program": {"type_name": "xla::ifrt::XlaProgram", "data": program},
        "compile_options": {"type_name": "xla::ifrt::XlaCompileOptions",
                            "data": options.SerializeToString()}}))
    assert compiled.response_metadata.status.code == 0, compiled
    return session, compiled.compile_response.loaded_executable_handle


_F32 = message("xla.ifrt.DTypeProto").Kind.Value("KIND_F32")
# Every request type, those that delete what the session holds half as often: the
# requests after them would find less to reach.
_KINDS = [name for f in message(P + "IfrtRequest").DESCRIPTOR.oneofs_by_name["request"].fields
          for name in [f.name] * (1 if "delete" in f.name or "destruct" in f.name else 2)]


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_request_is_answered_and_none_is_an_internal_error(
        ifrt: dict[str, str], program: bytes, data: st.DataObject) -> None:
    session, executable = _started(ifrt["target"], program)
    handles = [*_ARRAYS, executable, _BUFFER]
    try:
        sent = {}
        for _ in range(data.draw(st.integers(1, 24))):
            request = _request(data, _KINDS, handles, session.op + 1)
            op = session.send(request)
            sent[op] = request
        for op, request in sent.items():
            status = session.wait(op).response_metadata.status
            assert status.code != grpc.StatusCode.INTERNAL.value[0] or MADE in status.message, (
                f"{request.WhichOneof('request')} answered INTERNAL: {status.message}\n{request}")
    finally:
        session.close()
    assert httpx.get(f"{ifrt['url']}/healthz", timeout=10).status_code == 200


def test_no_request_restarted_a_runtime(ifrt: dict[str, str], program: bytes) -> None:
    """After the fuzz (this module's tests run in order): the runtime never went down,
    and a session still runs a program."""
    assert metric_total(ifrt["url"], "jitserve_runtime_restarts_total") == 0
    session, executable = _started(ifrt["target"], program)
    try:
        ran = session.wait(session.send(loaded_executable_execute_request={
            "loaded_executable_handle": executable, "args_handles": [_ARRAYS[0]],
            "result_array_handle": [40]}))
        assert ran.response_metadata.status.code == 0, ran
        read = session.wait(session.send(check_value_ready_request={"value_handles": [40]}))
        assert read.response_metadata.status.code == 0, read
    finally:
        session.close()


def test_a_session_ended_under_a_batch_answers_its_host_buffer_calls_while_it_closes(
        ifrt: dict[str, str]) -> None:
    """Last: it restarts the runtime. A run passes its deadline while the session's batch
    waits on it; the session ends, and while it closes (telling its runtime, which is
    restarting) its host buffer calls are answered as an ended session's (UNAVAILABLE,
    with the reason), never NOT_FOUND "no IFRT session": on that, jaxlib's client drops
    the session, and the program reads "Connection to IFRT proxy server was terminated"
    without the reason (found by tests/e2e/test_ifrt_walk_e2e.py's walk on other seeds)."""
    endless = export.export(jax.jit(
        lambda x: jax.lax.while_loop(lambda c: c.sum() > -1.0, lambda c: c + 1.0, x)))(
        jax.ShapeDtypeStruct((4,), jnp.float32))
    session, executable = _started(ifrt["target"], bytes(endless.mlir_module_serialized))
    lookup = session.channel.unary_stream("/xla.ifrt.proxy.GrpcIfrtService/HostBufferLookup")
    asked = message(P + "GrpcHostBufferLookupRequest")(session_id=session.id, handle=99)
    answers: list[tuple[grpc.StatusCode, str]] = []
    try:
        session.send(loaded_executable_execute_request={
            "loaded_executable_handle": executable, "args_handles": [_ARRAYS[0]],
            "result_array_handle": [40]})
        ready = session.send(check_value_ready_request={"value_handles": [40]})
        deadline = time.monotonic() + _ANSWERS_S
        while ready not in session.got and session.ended is None:  # the run's deadline: 3 s
            assert time.monotonic() < deadline, "the endless run was never stopped"
            try:
                list(lookup(asked.SerializeToString(), timeout=30))
            except grpc.RpcError as e:
                answers.append((e.code(), e.details() or ""))
        ended = session.wait(ready)
    finally:
        session.close()
    assert "passed its deadline" in ended.response_metadata.status.message, ended
    assert not [a for a in answers if "no IFRT session" in a[1]], answers
    closing = [a for a in answers if a[0] == grpc.StatusCode.UNAVAILABLE]
    assert closing and all("passed its deadline" in text for _, text in closing), answers
    assert httpx.get(f"{ifrt['url']}/healthz", timeout=10).status_code == 200
