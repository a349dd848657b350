"""IFRT proxy sessions, inside a runtime process: jax's own remote-backend requests served.

A client that runs with ``JAX_PLATFORMS=jitserve`` (jaxlib's IFRT proxy client) speaks
``xla.ifrt.proxy.IfrtRequest``s over gRPC to the API process (``service.ifrt``), which
places the session on one runtime and relays its requests here in order, in batches
(``Op.IFRT``). This module holds what the session made: arrays, executables, futures and
host buffers on their way out, all keyed by the client's handles (or ones made here,
from ``_SERVER_HANDLES`` up: the client counts its own from 1). The API process parses
requests only to route them; everything that touches a program (compile, execute) or
an array's bytes happens here, in the supervised process.

Requests run one after another, in the order the client sent them, as the reference
server (``xla/python/ifrt_proxy/server/ifrt_backend.cc``) does. A request that fails
answers with an error status, and the handles it would have filled hold that error, so
every later request that uses them reports it. Compiles go through ``Compiler``:
``lookup_module`` checks the module as any upload is checked, and caches by program,
sanitized options and backend in the tiers.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jitserve.wire import Aval

from . import frames

log = logging.getLogger("jitserve.runtime.ifrt")

__all__ = ["IfrtFailure", "Sessions"]

_SERVER_HANDLES = 1 << 62
_P = "xla.ifrt.proxy."
# google.rpc / absl status codes, as tensorflow.StatusProto carries them.
INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED = 3, 5, 9, 8
UNIMPLEMENTED, INTERNAL = 12, 13

_DTYPES: dict[str, Any] = {}  # DTypeProto.Kind name -> numpy dtype (_dtype_table)


class IfrtFailure(Exception):
    """A request's refusal, answered as a status ``code`` with ``message``; ``root``:
    for a request that read an array holding a failure, the failure that began the
    chain (which each later link names, instead of nesting the link before's)."""

    def __init__(self, code: int, message: str, root: IfrtFailure | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.root = root


def _dtype_table() -> dict[str, Any]:
    if not _DTYPES:
        import ml_dtypes

        table = {
            "PRED": np.bool_, "S8": np.int8, "S16": np.int16, "S32": np.int32, "S64": np.int64,
            "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
            "F16": np.float16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
            "C128": np.complex128, "BF16": ml_dtypes.bfloat16, "S4": ml_dtypes.int4,
            "U4": ml_dtypes.uint4, "S2": getattr(ml_dtypes, "int2", None),
            "U2": getattr(ml_dtypes, "uint2", None), "F8E4M3FN": ml_dtypes.float8_e4m3fn,
            "F8E5M2": ml_dtypes.float8_e5m2, "F8E4M3B11FNUZ": ml_dtypes.float8_e4m3b11fnuz,
            "F8E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "F8E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
            "F8E3M4": getattr(ml_dtypes, "float8_e3m4", None),
            "F8E4M3": getattr(ml_dtypes, "float8_e4m3", None),
            "F8E8M0FNU": getattr(ml_dtypes, "float8_e8m0fnu", None),
            "F4E2M1FN": getattr(ml_dtypes, "float4_e2m1fn", None),
        }
        _DTYPES.update({k: np.dtype(v) for k, v in table.items() if v is not None})
    return _DTYPES


class Shards:
    """An array over several devices whose IFRT sharding does not say which part each
    device holds (a ``ConcreteEvenSharding``, as jax's client makes when it reorders an
    array's shards): its single-device pieces, in the sharding's device order. A run
    lays them out as the executable's parameter sharding says, as XLA would."""

    def __init__(self, shape: tuple[int, ...], pieces: list[Any]) -> None:
        self.shape = shape
        self.pieces = pieces
        self.dtype = pieces[0].dtype
        self.nbytes = sum(int(p.nbytes) for p in pieces)

    def block_until_ready(self) -> None:
        for piece in self.pieces:
            piece.block_until_ready()

    def delete(self) -> None:
        for piece in self.pieces:
            piece.delete()

    def is_deleted(self) -> bool:
        return any(piece.is_deleted() for piece in self.pieces)


class Donated:
    """What a handle holds once its array was donated to a copy, reshard or remap: a
    deleted array, whose buffers may live on in what it was donated to."""

    def is_deleted(self) -> bool:
        return True

    def delete(self) -> None:
        pass


_DONATE_INPUT = 3  # xla.ifrt.proto.ArrayCopySemantics.ARRAY_COPY_SEMANTICS_DONATE_INPUT


class Session:
    """One client's arrays, executables and futures (``Sessions`` serves it)."""

    def __init__(self, session_id: int, owner: str, scope: str = "") -> None:
        self.session_id = session_id
        self.owner = owner
        self.scope = scope  # its executables' keys, when keys share none (Compiler.lookup)
        self.arrays: dict[int, Any] = {}  # handle -> jax.Array, or the IfrtFailure that made it
        self.sizes: dict[int, int] = {}  # handle -> device bytes it counts for its key
        self.device_bytes = 0  # the sum of ``sizes``: what it holds on the devices now
        self.executables: dict[int, Any] = {}  # handle -> compiler.compile.Executable
        # The host buffers of the batch being served (its own: two sessions' batches run
        # on two threads at once).
        self.inbox: Mapping[int, np.ndarray] = {}
        self.refused: Mapping[int, str] = {}  # and those the server refused, by handle: why
        self.futures: dict[int, IfrtFailure | None] = {}
        self.results: dict[int, IfrtFailure | None] = {}  # execute statuses (FetchExecuteResult)
        self.host_out: dict[int, np.ndarray] = {}  # copy_to_host results until they are read
        self.host_out_bytes = 0  # their bytes
        # Host bytes the API process holds for it (stored and not used, made and not
        # read), as the batch being served says: with ``host_out_bytes``, bounded.
        self.host_held = 0
        self.handles = itertools.count(_SERVER_HANDLES)
        self.compiles = self.executes = 0
        self.compiled: list[dict[str, Any]] = []  # each compile since the last batch


class Sessions:
    """Every IFRT session this runtime holds; ``serve`` answers one batch of one session."""

    def __init__(self, compiler: Any, copy_to_device: Callable[[np.ndarray, Any], Any]) -> None:
        """``copy_to_device(host, device)``: the runtime's transfer of a contiguous host
        array to one of its devices, as a copy (``_device_put``)."""
        import jax
        from jax.extend import backend as xb

        from jitserve.compiler.ifrt_protos import message

        self._jax = jax
        self._copy_to_device = copy_to_device
        self._message = message
        self.compiler = compiler
        self.backend = xb.get_backend()
        self.devices = list(compiler.devices)  # this runtime's group, as jax numbers them here
        self._by_id = {d.id: d for d in self.devices}
        self.sessions: dict[int, Session] = {}
        # What each key holds here (all its sessions live in this runtime: placement is
        # by key), against the quotas its batches carry: device bytes, arrays, compiles.
        self.quotas: dict[str, Mapping[str, int]] = {}
        self.max_run_bytes: int | None = None  # as the last batch said (``serve``)
        self.max_host_bytes: int | None = None  # likewise (JITSERVE_IFRT_MAX_HOST_BYTES)
        self.held: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        self.compiled_at: dict[str, collections.deque[float]] = collections.defaultdict(
            collections.deque)
        self._handlers: dict[str, Callable[[Session, Any, Any], None]] = {
            "init_request": self._init,
            "check_future_request": self._check_future,
            "check_value_ready_request": self._check_value_ready,
            "make_array_from_host_buffer_request": self._make_array,
            "make_arrays_from_host_buffer_shards_request": self._make_arrays_from_shards,
            "make_error_arrays_request": self._make_error_arrays,
            "assemble_array_from_single_device_arrays_request": self._assemble,
            "copy_to_host_buffer_request": self._copy_to_host,
            "disassemble_into_single_device_arrays_request": self._disassemble,
            "delete_array_request": self._delete_array,
            "copy_arrays_request": self._copy_arrays,
            "reshard_arrays_request": self._reshard,
            "remap_arrays_request": self._remap,
            "fully_replicated_shard_request": self._fully_replicated_shard,
            "is_array_deleted_request": self._is_array_deleted,
            "destruct_array_request": self._destruct_array,
            "compile_request": self._compile,
            "loaded_executable_metadata_request": self._executable_metadata,
            "loaded_executable_execute_request": self._execute,
            "loaded_executable_fetch_execute_result_request": self._fetch_execute_result,
            "loaded_executable_cost_analysis_request": self._cost_analysis,
            "loaded_executable_human_readable_program_text_request": self._program_text,
            "loaded_executable_delete_request": self._executable_delete,
            "loaded_executable_is_deleted_request": self._executable_is_deleted,
            "loaded_executable_destruct_request": self._executable_destruct,
            "get_default_device_assignment_request": self._default_device_assignment,
            "get_default_layout_request": self._default_layout,
        }

    # -- the runtime's ops -------------------------------------------------------

    def serve(self, session_id: int, owner: str, requests: list[bytes],
              buffers: Mapping[int, np.ndarray], quotas: Mapping[str, int] | None = None,
              scope: str = "", max_run_bytes: int | None = None,
              refused: Mapping[int, str] | None = None,
              host: Mapping[str, int] | None = None,
              ) -> tuple[list[bytes], dict[int, np.ndarray], list[dict[str, Any]]]:
        """Answer ``requests`` (serialized ``IfrtRequest``s) in order; the serialized
        responses, the host buffers their ``copy_to_host_buffer``s made, and what each
        compile found (``protocol.IfrtCompiled``). ``max_run_bytes``: the server's
        per-run device-memory limit, which executes are checked against; ``refused``:
        host buffers the server refused (over a limit), by handle, and why; ``host``: the
        host bytes the API process holds for the session (``held``) and its limit
        (``max``), which copies to host not read yet are checked against."""
        self.max_run_bytes = max_run_bytes
        if host:
            self.max_host_bytes = host.get("max")
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id, owner, scope)
        elif session.owner != owner:
            raise IfrtFailure(FAILED_PRECONDITION, "this session belongs to another key")
        if quotas:
            self.quotas[owner] = quotas
        before = set(session.host_out)
        session.host_held = int((host or {}).get("held", 0))
        session.inbox, session.refused = buffers, refused or {}
        try:
            responses = [self._one(session, data) for data in requests]
        finally:
            session.inbox, session.refused = {}, {}
        made = {h: session.host_out[h] for h in session.host_out.keys() - before}
        compiled, session.compiled = session.compiled, []
        return responses, made, compiled

    def holding(self, session_id: int) -> tuple[int, int]:
        """The device bytes session ``session_id``'s arrays hold here now, and how many
        arrays count for its key."""
        session = self.sessions.get(session_id)
        return (0, 0) if session is None else (session.device_bytes, len(session.sizes))

    def read(self, session_id: int, handle: int) -> np.ndarray:
        """A host buffer a ``copy_to_host_buffer`` made, handed over once."""
        session = self.sessions.get(session_id)
        buffer = None if session is None else session.host_out.pop(handle, None)
        if session is None or buffer is None:
            raise IfrtFailure(NOT_FOUND, f"no host buffer {handle} in this session")
        session.host_out_bytes -= buffer.nbytes
        return buffer

    def close(self, session_id: int) -> dict[str, int]:
        """Drop everything session ``session_id`` held; what it used."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return {}
        for handle in list(session.sizes):
            self._forget(session, handle)
        for array in session.arrays.values():
            if not isinstance(array, IfrtFailure):
                try:
                    array.delete()
                except Exception:  # noqa: BLE001 - already deleted or donated
                    pass
        return {"arrays": len(session.arrays), "executables": len(session.executables),
                "compiles": session.compiles, "executes": session.executes}

    # -- one request ---------------------------------------------------------------

    def _one(self, session: Session, data: bytes) -> bytes:
        request = self._message(_P + "IfrtRequest")()
        response = self._message(_P + "IfrtResponse")()
        try:
            request.ParseFromString(data)
        except Exception:  # noqa: BLE001 - the API process parsed it already; be sure
            _fail(response, IfrtFailure(INVALID_ARGUMENT, "the request does not parse"))
            return bytes(response.SerializeToString())
        response.response_metadata.op_id = request.request_metadata.op_id
        kind = request.WhichOneof("request")
        handler = self._handlers.get(kind or "")
        try:
            if handler is None:
                raise IfrtFailure(UNIMPLEMENTED, f"jitserve does not serve {kind or 'an empty request'}")
            body = getattr(request, kind or "")
            handler(session, body, response)
            if response.WhichOneof("response") is None:  # an answer with nothing to say
                getattr(response, kind.removesuffix("_request") + "_response").SetInParent()
        except Exception as e:  # noqa: BLE001 - every failure is the request's answer
            failure = e if isinstance(e, IfrtFailure) else _classify(e)
            # Kept as a new exception: the raised one's traceback holds the frames that
            # raised it, their host buffers (a 256 MiB segment's mapping) among them, for
            # as long as the handles keep the failure, and in a cycle after.
            failure = IfrtFailure(failure.code, str(failure), failure.root)
            for handle in _result_handles(request, kind):
                self._put(session, handle, failure)
            if kind == "loaded_executable_execute_request" and body.result_status_handle:
                session.results[body.result_status_handle] = failure
                session.futures[body.result_status_handle] = failure
            response.Clear()
            response.response_metadata.op_id = request.request_metadata.op_id
            _fail(response, failure)
        return bytes(response.SerializeToString())

    # -- handles ---------------------------------------------------------------------

    def _array(self, session: Session, handle: int, deleted: bool = False) -> Any:
        """The array under ``handle``; ``deleted``: also one whose buffers were deleted
        (``delete_array``), which nothing else may read."""
        found = session.arrays.get(handle)
        if found is None:
            raise IfrtFailure(NOT_FOUND, f"unknown array handle {handle}")
        if isinstance(found, IfrtFailure):
            root = found.root or found
            raise IfrtFailure(found.code, f"array {handle} failed earlier: {root}", root)
        if isinstance(found, Donated):
            raise IfrtFailure(INVALID_ARGUMENT, f"array {handle} was donated: it is deleted")
        if not deleted and found.is_deleted():
            # In jax's words, which programs and jax's own tests look for.
            raise IfrtFailure(INVALID_ARGUMENT, f"Array has been deleted: array {handle} "
                              "(delete_array)")
        return found

    def _donate(self, session: Session, handles: Any, free: bool) -> None:
        """Mark arrays ``handles`` donated (``DONATE_INPUT``); ``free``: delete their buffers
        too (what they were donated to is a copy, not a view)."""
        for handle in handles:
            array = session.arrays.get(handle)
            if free and array is not None and not isinstance(array, (IfrtFailure, Donated)):
                array.delete()
            session.arrays[handle] = Donated()
            self._unheld(session, handle)

    def _unheld(self, session: Session, handle: int) -> None:
        """Stop counting ``handle``'s device bytes for its key: the handle stays (deleted
        or donated), its memory does not."""
        freed = session.sizes.get(handle, 0)
        session.sizes[handle] = 0
        self.held[session.owner][0] -= freed
        session.device_bytes -= freed

    def _put(self, session: Session, wanted: int, array: Any, nbytes: int | None = None) -> int:
        """Keep ``array`` under the client's handle ``wanted`` (or a new one, if 0), counted
        for its key: ``nbytes`` of device memory (default: the array's own; 0 for a view
        of buffers another handle counts) and one array."""
        handle = wanted or next(session.handles)
        if handle in session.arrays:
            self._forget(session, handle)
        if nbytes is None:
            nbytes = 0 if isinstance(array, IfrtFailure) else _held_bytes(array)
        session.arrays[handle] = array
        session.sizes[handle] = nbytes
        session.device_bytes += nbytes
        held = self.held[session.owner]
        held[0] += nbytes
        held[1] += 1
        return handle

    def _forget(self, session: Session, handle: int) -> None:
        """Stop counting ``handle`` for its key (destructed, or its session closed)."""
        nbytes = session.sizes.pop(handle, None)
        if nbytes is not None:
            session.device_bytes -= nbytes
            held = self.held[session.owner]
            held[0] -= nbytes
            held[1] -= 1

    def _room(self, session: Session, nbytes: int, arrays: int = 1) -> None:
        """Refuse what would take ``session``'s key past a quota (with API keys on)."""
        quotas = self.quotas.get(session.owner)
        if not quotas:
            return
        held_bytes, held_arrays = self.held[session.owner]
        # What the key's /v1 futures hold (the API process's count, as of this batch): one
        # account for both protocols.
        v1_bytes, v1_arrays = quotas.get("v1_device_bytes", 0), quotas.get("v1_futures", 0)
        also = (f" (and its /v1 futures {v1_arrays:,}, holding {v1_bytes:,} bytes)"
                if v1_bytes or v1_arrays else "")
        if held_bytes + v1_bytes + nbytes > quotas["device_bytes"]:
            raise IfrtFailure(RESOURCE_EXHAUSTED, (
                f"quota device_bytes: this key holds {held_bytes:,} device bytes{also}; "
                f"{nbytes:,} more is over its quota of {quotas['device_bytes']:,} "
                "(JITSERVE_TENANT_MAX_DEVICE_BYTES)"))
        if held_arrays + v1_arrays + arrays > quotas["arrays"]:
            raise IfrtFailure(RESOURCE_EXHAUSTED, (
                f"quota live_arrays: this key holds {held_arrays:,} arrays{also}; its quota "
                f"is {quotas['arrays']:,} (JITSERVE_TENANT_MAX_LIVE_FUTURES)"))

    def _executable(self, session: Session, handle: int) -> Any:
        found = session.executables.get(handle)
        if found is None:
            raise IfrtFailure(NOT_FOUND, f"unknown loaded executable handle {handle}")
        return found

    def _host_buffer(self, session: Session, handle: int) -> np.ndarray:
        buffer = session.inbox.get(handle)
        if buffer is None:
            why = session.refused.get(handle)
            if why is not None:
                raise IfrtFailure(RESOURCE_EXHAUSTED, why)
            raise IfrtFailure(NOT_FOUND, f"host buffer {handle} never arrived")
        return buffer

    # -- devices, shardings, dtypes --------------------------------------------------

    def _dtype(self, proto: Any) -> np.dtype[Any]:
        name = proto.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_number[proto.kind].name
        dtype = _dtype_table().get(name.removeprefix("KIND_"))
        if dtype is None:
            raise IfrtFailure(UNIMPLEMENTED, f"dtype {name} is not served")
        return dtype

    def _dtype_proto(self, dtype: np.dtype[Any], proto: Any) -> None:
        for name, value in _dtype_table().items():
            if value == dtype:
                proto.kind = proto.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_name[
                    "KIND_" + name].number
                return
        raise IfrtFailure(UNIMPLEMENTED, f"dtype {dtype} is not served")

    def _device(self, device_id: int) -> Any:
        device = self._by_id.get(device_id)
        if device is None:
            raise IfrtFailure(INVALID_ARGUMENT, f"unknown device {device_id} (this server's: "
                              f"{sorted(self._by_id)})")
        return device

    def _sharding(self, proto: Any) -> tuple[list[Any], Any]:
        """The devices of a ``ShardingProto`` (an array lives on exactly these, in this
        order: its shards are theirs) and the jax ``Sharding`` that says which part of
        the array each holds (``None`` where the proto does not say)."""
        from jax._src.lib import xla_client as xc
        from jax._src.sharding_impls import GSPMDSharding
        from jax.sharding import SingleDeviceSharding

        serialized = proto.serialized_sharding
        name = serialized.type_name
        kinds = {"xla::ifrt::SingleDeviceSharding": "xla.ifrt.SingleDeviceShardingProto",
                 "xla::ifrt::ConcreteEvenSharding": "xla.ifrt.ConcreteEvenShardingProto",
                 "xla::ifrt::ConcreteSharding": "xla.ifrt.ConcreteShardingProto",
                 "xla::ifrt::OpaqueSharding": "xla.ifrt.OpaqueShardingProto",
                 "xla::ifrt::ShardingParamSharding": "xla.ifrt.ShardingParamShardingProto",
                 "xla::ifrt::HloSharding": "xla.ifrt.HloShardingProto"}
        if name not in kinds:
            raise IfrtFailure(UNIMPLEMENTED, f"sharding {name!r} is not served")
        try:
            parsed = self._message(kinds[name]).FromString(serialized.data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            raise IfrtFailure(INVALID_ARGUMENT, f"the {name} does not parse") from None
        memory_kind = getattr(parsed, "memory_kind", "") or None
        if name == "xla::ifrt::SingleDeviceSharding":
            device = self._device(parsed.device_id)
            return [device], SingleDeviceSharding(device, memory_kind=memory_kind)
        devices = [self._device(i) for i in parsed.devices.device_ids]
        if not devices or len({d.id for d in devices}) != len(devices):
            raise IfrtFailure(INVALID_ARGUMENT, f"a {name} over devices "
                              f"{list(parsed.devices.device_ids)}: each at most once, and some")
        if len(devices) == 1:
            return devices, SingleDeviceSharding(devices[0], memory_kind=memory_kind)
        if name == "xla::ifrt::HloSharding":
            op = xc.OpSharding()
            op.ParseFromString(parsed.xla_op_sharding.SerializeToString())
            return devices, GSPMDSharding(tuple(devices), op, memory_kind=memory_kind)
        if name == "xla::ifrt::ConcreteEvenSharding" and parsed.is_fully_replicated:
            return devices, GSPMDSharding.get_replicated(tuple(devices), memory_kind=memory_kind)
        return devices, None  # shards of known shapes, but not which part each one is

    def _laid_out(self, proto: Any, what: str) -> tuple[list[Any], Any]:
        """``_sharding``, for an array this request makes: it must say where each part goes."""
        devices, sharding = self._sharding(proto)
        if sharding is None:
            raise IfrtFailure(UNIMPLEMENTED, f"{what} with a {proto.serialized_sharding.type_name} "
                              "over several devices is not served: it does not say which part "
                              "of the array each device holds (an HloSharding does)")
        return devices, sharding

    def _single_sharding(self, device: Any, proto: Any) -> None:
        single = self._message("xla.ifrt.SingleDeviceShardingProto")(device_id=device.id)
        proto.serialized_sharding.type_name = "xla::ifrt::SingleDeviceSharding"
        proto.serialized_sharding.data = single.SerializeToString()

    def _sharding_proto(self, array: Any, proto: Any) -> None:
        """``proto`` says how ``array`` (a jax.Array of this runtime) is laid out, in the
        device order its shards are in (``_disassemble``)."""
        sharding = array.sharding
        devices = sharding._device_assignment
        if len(devices) == 1:
            self._single_sharding(devices[0], proto)
            return
        hlo = self._message("xla.ifrt.HloShardingProto")()
        hlo.devices.device_ids.extend(d.id for d in devices)
        if sharding.memory_kind:
            hlo.memory_kind = sharding.memory_kind
        hlo.xla_op_sharding.ParseFromString(
            sharding._to_xla_hlo_sharding(array.ndim).to_proto().SerializeToString())
        proto.serialized_sharding.type_name = "xla::ifrt::HloSharding"
        proto.serialized_sharding.data = hlo.SerializeToString()

    def _device_put(self, host: np.ndarray, device: Any) -> Any:
        # The API process reuses its shared-memory segments: an array must not keep a
        # view of one. On the CPU, jaxlib's own transfer copies during the call (the
        # runtime's ``_to_device``): 4-50 us for a batch of images, where a numpy copy
        # into fresh pages and jax.device_put's Python layers cost 50-250. Elsewhere the
        # transfer is the copy, waited for here, so the segment is free again when this
        # returns.
        if device.platform == "cpu":
            if host.flags.c_contiguous:
                return self._copy_to_device(host, device)
            return self._jax.device_put(np.array(host, copy=True), device)
        array = self._jax.device_put(host, device)
        array.block_until_ready()
        return array

    def _global(self, shape: tuple[int, ...], sharding: Any, shards: list[Any]) -> Any:
        """One array of ``shape`` from its ``shards``, each on its own device (``Shards``
        where ``sharding`` is ``None``: not said)."""
        if sharding is None:
            return Shards(shape, shards)
        if len(shards) == 1 and len(sharding.device_set) == 1:
            return shards[0]
        try:
            return self._jax.make_array_from_single_device_arrays(shape, sharding, shards)
        except ValueError as e:
            raise IfrtFailure(INVALID_ARGUMENT, str(e)) from None

    @staticmethod
    def _pieces(array: Any) -> list[Any]:
        """``array``'s single-device arrays, in its sharding's device order."""
        if isinstance(array, Shards):
            return array.pieces
        return [s.data for s in array.addressable_shards]

    # -- the handlers ----------------------------------------------------------------

    def _init(self, session: Session, body: Any, response: Any) -> None:
        import jax
        import jaxlib

        init = response.init_response
        init.session_id = session.session_id
        init.platform_name = self.backend.platform
        init.platform_version = self.backend.platform_version
        init.platform_id = 0
        init.process_index = 0
        init.runtime_type = f"jitserve/{self.backend.runtime_type}"
        memories: dict[int, tuple[Any, list[int]]] = {}
        for device in self.devices:
            d = init.all_devices.add(id=device.id, local_device_id=device.id,
                                     local_hardware_id=getattr(device, "local_hardware_id", 0) or 0,
                                     platform_name=device.platform, device_kind=device.device_kind,
                                     debug_string=repr(device), to_string=str(device))
            default = device.default_memory()
            for memory in device.addressable_memories():
                memory_id = _memory_id(memory)
                d.memory_ids.append(memory_id)
                memories.setdefault(memory_id, (memory, []))[1].append(device.id)
                if memory == default:
                    d.default_memory_id = memory_id
            init.addressable_device_ids.append(device.id)
            init.primary_device_ids.append(device.id)
        for memory_id, (memory, device_ids) in sorted(memories.items()):
            init.memories.add(id=memory_id, memory_space_kind=memory.kind, device_ids=device_ids,
                              debug_string=repr(memory), to_string=str(memory))
        _attributes(init.client_attributes, {"jitserve": "1", "jax_version": jax.__version__,
                                             "jaxlib_version": jaxlib.__version__})

    def _check_future(self, session: Session, body: Any, response: Any) -> None:
        if body.future_handle not in session.futures:
            raise IfrtFailure(NOT_FOUND, f"unknown future handle {body.future_handle}")
        failure = session.futures.pop(body.future_handle)
        if failure is not None:
            raise failure
        response.check_future_response.SetInParent()

    def _check_value_ready(self, session: Session, body: Any, response: Any) -> None:
        for handle in body.value_handles:
            self._array(session, handle).block_until_ready()
        response.check_value_ready_response.SetInParent()

    def _host_array(self, buffer: np.ndarray, dtype: np.dtype[Any], shape: tuple[int, ...],
                    strides: Any) -> np.ndarray:
        """The array a host buffer holds, laid out as ``strides`` say (C order when none)."""
        count = int(np.prod(shape, dtype=np.int64))
        if strides is None:
            if buffer.nbytes != count * dtype.itemsize:
                raise IfrtFailure(INVALID_ARGUMENT, f"host buffer has {buffer.nbytes} bytes; "
                                  f"{dtype}{list(shape)} needs {count * dtype.itemsize}")
            return buffer.view(dtype).reshape(shape)
        strides = tuple(int(s) for s in strides)
        if len(strides) != len(shape) or any(s < 0 for s in strides):
            raise IfrtFailure(INVALID_ARGUMENT, f"byte strides {list(strides)} do not fit {list(shape)}")
        span = (sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize) if count else 0
        if span > buffer.nbytes:
            raise IfrtFailure(INVALID_ARGUMENT, f"host buffer of {buffer.nbytes} bytes is too small "
                              f"for strides {list(strides)} over {list(shape)}")
        return np.ndarray(shape, dtype, buffer=buffer[:span], strides=strides)

    def _make_array(self, session: Session, body: Any, response: Any) -> None:
        dtype, shape = self._dtype(body.dtype), tuple(body.shape.dims)
        devices, sharding = self._laid_out(body.sharding, "an array")
        strides = body.byte_strides.strides if body.HasField("byte_strides") else None
        host = self._host_array(self._host_buffer(session, body.host_buffer_handle), dtype, shape, strides)
        self._room(session, _device_bytes(shape, dtype, sharding))
        if len(devices) == 1:
            array = self._device_put(host, devices[0])
        else:
            array = self._global(shape, sharding, [
                self._device_put(host[index], device)
                for device, index in sharding.addressable_devices_indices_map(shape).items()])
        response.make_array_from_host_buffer_response.array_handle = self._put(
            session, body.array_handle if body.HasField("array_handle") else 0, array)

    def _make_arrays_from_shards(self, session: Session, body: Any, response: Any) -> None:
        if body.array_handles and len(body.array_handles) != len(body.specs):
            raise IfrtFailure(INVALID_ARGUMENT, "array_handles and specs differ in length")
        made: list[Any] = []
        held = 0
        for spec in body.specs:
            dtype, shape = self._dtype(spec.array_spec.dtype), tuple(spec.array_spec.shape.dims)
            devices, sharding = self._laid_out(spec.array_spec.sharding, "an array")
            # Which shards (indices into ``devices``) each host buffer fills.
            groups = ([list(g.indices) for g in spec.addressable_shard_indices]
                      or [list(range(len(devices)))] * (len(spec.host_buffers) == 1))
            if len(groups) != len(spec.host_buffers):
                raise IfrtFailure(INVALID_ARGUMENT, f"{len(spec.host_buffers)} host buffers for "
                                  f"{len(groups)} groups of shards")
            shard_shape = sharding.shard_shape(shape)
            shards: list[Any] = [None] * len(devices)
            nbytes = _device_bytes(shape, dtype, sharding)
            self._room(session, held + nbytes, len(made) + 1)
            for indices, buf in zip(groups, spec.host_buffers):
                strides = buf.byte_strides.strides if buf.HasField("byte_strides") else None
                host = self._host_array(self._host_buffer(session, buf.host_buffer_handle),
                                        self._dtype(buf.dtype), tuple(buf.shape.dims), strides)
                if host.shape != tuple(shard_shape) or host.dtype != dtype:
                    raise IfrtFailure(INVALID_ARGUMENT, f"a host buffer of {host.dtype}"
                                      f"{list(host.shape)} for shards of {dtype}{list(shard_shape)}")
                for k in indices:
                    if not 0 <= k < len(devices) or shards[k] is not None:
                        raise IfrtFailure(INVALID_ARGUMENT, f"shard index {k} is out of range "
                                          f"or given twice ({len(devices)} shards)")
                    shards[k] = self._device_put(host, devices[k])
            empty = [k for k, shard in enumerate(shards) if shard is None]
            if empty:
                raise IfrtFailure(INVALID_ARGUMENT, f"shards {empty} have no host buffer")
            made.append(self._global(shape, sharding, shards))
            held += nbytes
        wanted = list(body.array_handles) or [0] * len(made)
        out = response.make_arrays_from_host_buffer_shards_response
        out.array_handles.extend(self._put(session, h, a) for h, a in zip(wanted, made))

    def _make_error_arrays(self, session: Session, body: Any, response: Any) -> None:
        failure = IfrtFailure(body.error.code or INTERNAL, body.error.message)
        wanted = list(body.array_handles) or [0] * len(body.array_specs)
        out = response.make_error_arrays_response
        out.array_handles.extend(self._put(session, h, failure) for h in wanted)

    def _assemble(self, session: Session, body: Any, response: Any) -> None:
        arrays = [self._array(session, h) for h in body.single_device_array_handles]
        devices, sharding = self._sharding(body.sharding)
        if [_only_device(a) for a in arrays] != devices:
            raise IfrtFailure(INVALID_ARGUMENT, f"{len(arrays)} single-device arrays do not lie on "
                              f"the sharding's devices {[d.id for d in devices]}, one on each")
        array = self._global(tuple(body.shape.dims), sharding, arrays)
        self._room(session, 0)
        response.assemble_array_from_single_device_arrays_response.array_handle = self._put(
            session, body.result_handle, array, nbytes=0)

    def _disassemble(self, session: Session, body: Any, response: Any) -> None:
        shards = self._pieces(self._array(session, body.array_handle))
        wanted = list(body.result_handles) or [0] * len(shards)
        if len(wanted) != len(shards):
            raise IfrtFailure(INVALID_ARGUMENT, f"{len(wanted)} result handles for {len(shards)} shards")
        out = response.disassemble_into_single_device_arrays_response
        self._room(session, 0, len(shards))
        out.array_handles.extend(self._put(session, h, s, nbytes=0) for h, s in zip(wanted, shards))

    def _fully_replicated_shard(self, session: Session, body: Any, response: Any) -> None:
        array = self._array(session, body.array_handle)
        self._room(session, 0)
        response.fully_replicated_shard_response.array_handle = self._put(
            session, body.result_handle, self._pieces(array)[0], nbytes=0)

    def _copy_arrays(self, session: Session, body: Any, response: Any) -> None:
        arrays = [self._array(session, h) for h in body.array_handles]
        devices = [self._device(i) for i in body.device_ids]
        self._room(session, sum(_held_bytes(a) for a in arrays), len(arrays))
        made = [self._copied(a, devices) for a in arrays]
        if body.copy_semantics == _DONATE_INPUT:
            self._donate(session, body.array_handles, free=True)
        wanted = list(body.result_handles) or [0] * len(made)
        out = response.copy_arrays_response
        out.array_handles.extend(self._put(session, h, a) for h, a in zip(wanted, made))

    def _copied(self, array: Any, devices: list[Any]) -> Any:
        """``array`` copied onto ``devices`` (none: where it is), its shard ``i`` onto
        ``devices[i]``, as IFRT's ``CopyArrays`` does."""
        from jax._src.sharding_impls import GSPMDSharding

        pieces = self._pieces(array)
        if not devices:
            devices = [_only_device(p) for p in pieces]
        if len(devices) != len(pieces):
            raise IfrtFailure(INVALID_ARGUMENT, f"an array on {len(pieces)} devices copied onto "
                              f"{len(devices)}: the counts must match")
        if isinstance(array, Shards):
            return Shards(array.shape, [self._jax.device_put(p, d, may_alias=False)
                                        for p, d in zip(pieces, devices)])
        if len(devices) == 1:
            return self._jax.device_put(array, devices[0], may_alias=False)
        shards = [self._jax.device_put(p, d, may_alias=False) for p, d in zip(pieces, devices)]
        sharding = GSPMDSharding(tuple(devices), array.sharding._to_xla_hlo_sharding(array.ndim),
                                 memory_kind=array.sharding.memory_kind)
        return self._global(array.shape, sharding, shards)

    def _reshard(self, session: Session, body: Any, response: Any) -> None:
        arrays = [self._array(session, h) for h in body.array_handles]
        if len(body.array_specs) != len(arrays):
            raise IfrtFailure(INVALID_ARGUMENT, f"{len(body.array_specs)} array specs for "
                              f"{len(arrays)} arrays")
        made, nbytes = [], 0
        for array, spec in zip(arrays, body.array_specs):
            _, sharding = self._laid_out(spec.sharding, "resharding")
            if tuple(spec.shape.dims) != array.shape or self._dtype(spec.dtype) != array.dtype:
                raise IfrtFailure(INVALID_ARGUMENT, f"resharding {array.dtype}{list(array.shape)} "
                                  "may not change its dtype or shape")
            nbytes += _device_bytes(array.shape, array.dtype, sharding)
            made.append((array, sharding))
        self._room(session, nbytes, len(made))
        moved = [self._jax.device_put(array, sharding, may_alias=False) for array, sharding in made]
        if body.copy_semantics == _DONATE_INPUT:
            self._donate(session, body.array_handles, free=True)
        wanted = list(body.result_handles) or [0] * len(moved)
        out = response.reshard_arrays_response
        out.array_handles.extend(self._put(session, h, a) for h, a in zip(wanted, moved))

    def _remap(self, session: Session, body: Any, response: Any) -> None:
        """New arrays from the shards of others, moved by shard index (no bytes copied):
        ``RemapPlan`` mappings of intervals of one input's shards to one output's."""
        plan = body.plan
        arrays = [self._array(session, h) for h in body.array_handles]
        if len(arrays) != len(plan.input_specs):
            raise IfrtFailure(INVALID_ARGUMENT, f"a remap plan for {len(plan.input_specs)} arrays "
                              f"given {len(arrays)}")
        inputs = [self._pieces(a) for a in arrays]
        outputs = [(tuple(spec.shape.dims), *self._sharding(spec.sharding))
                   for spec in plan.output_specs]
        shards: list[list[Any]] = [[None] * len(devices) for _, devices, _ in outputs]
        for m in plan.mappings:
            if not (0 <= m.in_array < len(inputs) and 0 <= m.out_array < len(outputs)):
                raise IfrtFailure(INVALID_ARGUMENT, "a remap mapping names an array the plan has not")
            taken = [k for a, b, c in zip(m.from_start, m.from_end, m.from_step)
                     for k in range(a, b, c or 1)]
            given = [k for a, b, c in zip(m.to_start, m.to_end, m.to_step)
                     for k in range(a, b, c or 1)]
            source, target = inputs[m.in_array], shards[m.out_array]
            if len(taken) != len(given) or any(not 0 <= k < len(source) for k in taken) \
                    or any(not 0 <= k < len(target) for k in given):
                raise IfrtFailure(INVALID_ARGUMENT, "a remap mapping's intervals do not fit its "
                                  "arrays' shards")
            for k_in, k_out in zip(taken, given):
                target[k_out] = source[k_in]
        made = []
        for (shape, devices, sharding), pieces in zip(outputs, shards):
            if any(p is None for p in pieces) or [_only_device(p) for p in pieces] != devices:
                raise IfrtFailure(INVALID_ARGUMENT, "a remap plan leaves an output's shards empty "
                                  "or on devices its sharding does not name")
            made.append(self._global(shape, sharding, pieces))
        # Views of the inputs' buffers: counted for the key by the inputs, or, when they
        # are donated, by the outputs from now on.
        donated = body.copy_semantics == _DONATE_INPUT
        self._room(session, 0, len(made))
        if donated:
            self._donate(session, body.array_handles, free=False)
        wanted = list(body.result_handles) or [0] * len(made)
        out = response.remap_arrays_response
        out.array_handles.extend(self._put(session, h, a, None if donated else 0)
                                 for h, a in zip(wanted, made))

    def _copy_to_host(self, session: Session, body: Any, response: Any) -> None:
        found = self._array(session, body.array_handle)
        if isinstance(found, Shards):
            raise IfrtFailure(UNIMPLEMENTED, f"array {body.array_handle} is shards whose sharding "
                              "does not say where each goes: copy its single-device arrays")
        array = np.asarray(found)
        if body.HasField("byte_strides"):
            strides = tuple(int(s) for s in body.byte_strides.strides)
            if strides != array.strides:
                count = array.size
                span = (sum((n - 1) * s for n, s in zip(array.shape, strides))
                        + array.itemsize) if count else 0
                if any(s < 0 for s in strides) or len(strides) != array.ndim:
                    raise IfrtFailure(INVALID_ARGUMENT, f"byte strides {list(strides)} do not fit "
                                      f"{list(array.shape)}")
                self._host_room(session, span)
                out = np.zeros(span, np.uint8)
                np.ndarray(array.shape, array.dtype, buffer=out, strides=strides)[...] = array
                self._keep_host(session, body.host_buffer_handle, out)
                response.copy_to_host_buffer_response.SetInParent()
                return
        self._host_room(session, array.nbytes)
        self._keep_host(session, body.host_buffer_handle,
                        np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        response.copy_to_host_buffer_response.SetInParent()

    def _host_room(self, session: Session, nbytes: int) -> None:
        """Refuse a copy to host that would take what ``session`` has copied and not read
        (here, and in the API process) past what its arrays hold on the devices plus
        JITSERVE_IFRT_MAX_HOST_BYTES: a program reads what it copies (``jax.device_get``
        of all it holds fits), and one that does not would fill this process's memory."""
        if self.max_host_bytes is None:
            return
        pending = session.host_out_bytes + session.host_held
        room = session.device_bytes + self.max_host_bytes
        if pending + nbytes > room:
            raise IfrtFailure(RESOURCE_EXHAUSTED, (
                f"this session has {pending:,} bytes of host buffers not read (or not used); "
                f"a copy of {nbytes:,} more is over what its arrays hold on the devices "
                f"({session.device_bytes:,}) plus {self.max_host_bytes:,} "
                "(JITSERVE_IFRT_MAX_HOST_BYTES): read the copies it made"))

    def _keep_host(self, session: Session, handle: int, data: np.ndarray) -> None:
        replaced = session.host_out.pop(handle, None)
        if replaced is not None:
            session.host_out_bytes -= replaced.nbytes
        session.host_out[handle] = data
        session.host_out_bytes += data.nbytes

    def _delete_array(self, session: Session, body: Any, response: Any) -> None:
        failure = None
        for handle in body.array_handle:
            if isinstance(session.arrays.get(handle), Donated):
                continue  # deleted already
            try:
                self._array(session, handle, deleted=True).delete()
            except IfrtFailure as e:
                failure = failure or e
                continue
            self._unheld(session, handle)
        future = next(session.handles)
        session.futures[future] = failure
        response.delete_array_response.deletion_future_handle = future

    def _is_array_deleted(self, session: Session, body: Any, response: Any) -> None:
        found = session.arrays.get(body.array_handle)
        deleted = found.is_deleted() if isinstance(found, Donated) else self._array(
            session, body.array_handle, deleted=True).is_deleted()
        response.is_array_deleted_response.deleted = deleted

    def _destruct_array(self, session: Session, body: Any, response: Any) -> None:
        missing = [h for h in body.array_handle if session.arrays.pop(h, None) is None]
        for handle in body.array_handle:
            self._forget(session, handle)
        if missing:
            raise IfrtFailure(NOT_FOUND, f"unknown array handle(s): {', '.join(map(str, missing))}")
        response.destruct_array_response.SetInParent()

    def _compile(self, session: Session, body: Any, response: Any) -> None:
        from jitserve.compiler.errors import CompilerError
        from jitserve.compiler.ifrt import program_bytes, sanitize_options

        if body.host_callbacks:
            raise IfrtFailure(UNIMPLEMENTED, "host callbacks (jax.debug.print, pure_callback, "
                              "io_callback) are not served: a jitserve program runs no client code")
        try:
            options = sanitize_options(body.compile_options, self.compiler.server_options())
            may_compile = self._may_compile(session.owner)
            lookup = self.compiler.lookup_module(program_bytes(body.program), options,
                                                 compile=may_compile, scope=session.scope)
        except CompilerError as e:
            raise IfrtFailure(INVALID_ARGUMENT, f"jitserve refused the program ({e.code}): {e}") from None
        if lookup is None:
            quotas = self.quotas[session.owner]
            v1 = quotas.get("v1_compiles", 0)
            raise IfrtFailure(RESOURCE_EXHAUSTED, (
                f"quota compiles_per_minute: this key started {quotas['compiles_per_minute']} "
                f"compiles in the last minute{f' ({v1} of them through /v1)' if v1 else ''} "
                "(JITSERVE_TENANT_COMPILES_PER_MINUTE); programs already compiled still run"))
        if str(lookup.tier) == "compiled":
            self.compiled_at[session.owner].append(time.monotonic())
        session.compiles += 1
        handle = next(session.handles)
        session.executables[handle] = lookup.executable
        out = response.compile_response
        out.loaded_executable_handle = handle
        loaded = lookup.executable.loaded
        meta = lookup.executable.meta
        # The module's name ("jit_train_step"), as XLA's own server answers it.
        out.name = str(meta.get("name") or getattr(loaded, "name", "") or "jit")
        compiled = str(lookup.tier) == "compiled"
        session.compiled.append({
            "tier": str(lookup.tier), "program_id": str(meta.get("program_id", "")),
            "name": out.name, "executable_id": lookup.executable_id,
            "signature": ", ".join(str(Aval.from_json(a)) for a in meta.get("in_avals", ())),
            "seconds": float(lookup.compile_seconds),
            "recompiled_because": meta.get("recompiled_because") if compiled else None})
        devices = lookup.executable.devices
        out.num_devices = len(devices)
        out.device_ids.extend(d.id for d in devices)
        out.addressable_device_ids.extend(d.id for d in devices)
        try:
            fingerprint = loaded.fingerprint
            if fingerprint is not None:
                out.fingerprint_value = bytes(fingerprint)
        except Exception as e:  # noqa: BLE001 - reported in the answer's field
            out.fingerprint_error.code, out.fingerprint_error.message = UNIMPLEMENTED, str(e)
        ready = next(session.handles)
        session.futures[ready] = None
        out.ready_future_handle = ready

    def _may_compile(self, owner: str) -> bool:
        """Whether ``owner`` may start a compile now: under its compiles in a sliding minute,
        its sessions' here and its /v1 calls' (the API process's count, as of this batch)."""
        quotas = self.quotas.get(owner)
        if not quotas:
            return True
        window = self.compiled_at[owner]
        while window and window[0] < time.monotonic() - 60:
            window.popleft()
        return len(window) + quotas.get("v1_compiles", 0) < quotas["compiles_per_minute"]

    def _executable_metadata(self, session: Session, body: Any, response: Any) -> None:
        loaded = self._executable(session, body.loaded_executable_handle).loaded
        out = response.loaded_executable_metadata_response
        for name, shardings in (("parameter_shardings", loaded.get_parameter_shardings()),
                                ("output_shardings", loaded.get_output_shardings())):
            if shardings is not None:
                target = getattr(out, name)
                target.SetInParent()
                for sharding in shardings:
                    target.shardings.add().ParseFromString(sharding.SerializeToString())
        for name, getter in (("parameter_layouts", loaded.get_parameter_layouts),
                             ("output_layouts", loaded.get_output_layouts)):
            try:
                layouts = getter()
            except Exception as e:  # noqa: BLE001 - reported in the answer's field
                error = getattr(out, name + "_error")
                error.code, error.message = UNIMPLEMENTED, str(e)
                continue
            target = getattr(out, name + "_list")
            target.SetInParent()
            for layout in layouts:
                _layout_proto(layout._xla_layout(), target.layouts.add())
        try:
            for kinds in loaded.get_output_memory_kinds():
                out.output_memory_kinds.memory_kind_lists.add().memory_kinds.extend(kinds)
        except Exception as e:  # noqa: BLE001
            out.output_memory_kinds.status.code = UNIMPLEMENTED
            out.output_memory_kinds.status.message = str(e)
        out.donated_input_indices_error.code = UNIMPLEMENTED
        out.donated_input_indices_error.message = "not reported by jitserve"
        stats = loaded.get_compiled_memory_stats()
        memory = out.compiled_memory_stats
        for field in ("generated_code_size_in_bytes", "argument_size_in_bytes",
                      "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                      "host_generated_code_size_in_bytes", "host_argument_size_in_bytes",
                      "host_output_size_in_bytes", "host_alias_size_in_bytes",
                      "host_temp_size_in_bytes", "peak_memory_in_bytes"):
            if field in memory.DESCRIPTOR.fields_by_name and hasattr(stats, field):
                setattr(memory, field, int(getattr(stats, field)))
        out.size_of_generated_code_in_bytes = int(loaded.size_of_generated_code_in_bytes())

    def _execute(self, session: Session, body: Any, response: Any) -> None:
        executable = self._executable(session, body.loaded_executable_handle)
        args = [self._array(session, h) for h in body.args_handles]
        if any(isinstance(a, Shards) for a in args):  # laid out as the executable reads them
            if len(args) != len(executable.in_avals):
                raise IfrtFailure(INVALID_ARGUMENT, f"{len(args)} arguments for "
                                  f"{len(executable.in_avals)} parameters")
            args = [self._global(a.shape, sharding, a.pieces) if isinstance(a, Shards) else a
                    for a, sharding in zip(args, executable.in_shardings)]
        sharding = executable.meta.get("sharding")
        out_nbytes = sum(sharding["out_device_bytes"]) if sharding else executable.out_nbytes
        self._room(session, out_nbytes or 0, len(executable.out_avals))
        memory = executable.memory  # XLA's analysis, per device: refuse what cannot fit
        why = memory.over(self.max_run_bytes) if memory and self.max_run_bytes else None
        if why is not None:
            raise IfrtFailure(RESOURCE_EXHAUSTED, why)
        if body.device_ids and [int(i) for i in body.device_ids] != [d.id for d in executable.devices]:
            raise IfrtFailure(INVALID_ARGUMENT, f"devices {list(body.device_ids)} are not this "
                              f"executable's ({[d.id for d in executable.devices]})")
        try:
            outputs = executable.run(args)
            for output in outputs:
                output.block_until_ready()
        except Exception as e:  # noqa: BLE001
            raise _classify(e) from None
        session.executes += 1
        out = response.loaded_executable_execute_response
        wanted = list(body.result_array_handle)
        if wanted and len(wanted) != len(outputs):
            raise IfrtFailure(INVALID_ARGUMENT, f"{len(wanted)} result handles for {len(outputs)} outputs")
        if body.execute_options.fill_status:
            status = body.result_status_handle or next(session.handles)
            session.results[status] = None
            session.futures[status] = None
            out.status_handle = status
        tokens = set(executable.meta.get("out_tokens", ()))  # ordered effects, create_token
        handles = [self._put(session, h, o, 0 if i in tokens else None)
                   for i, (h, o) in enumerate(zip(wanted or [0] * len(outputs), outputs))]
        if not wanted:
            for i, (handle, output) in enumerate(zip(handles, outputs)):
                o = out.outputs.add(array_handle=handle)
                if i in tokens:
                    o.dtype.kind = o.dtype.DESCRIPTOR.fields_by_name["kind"].enum_type.values_by_name[
                        "KIND_TOKEN"].number
                else:
                    self._dtype_proto(np.dtype(output.dtype), o.dtype)
                    o.shape.dims.extend(output.shape)
                    self._sharding_proto(output, o.sharding)
                    continue
                self._single_sharding(executable.devices[0], o.sharding)

    def _fetch_execute_result(self, session: Session, body: Any, response: Any) -> None:
        if body.result_status_handle not in session.results:
            raise IfrtFailure(NOT_FOUND, f"unknown result status handle {body.result_status_handle}")
        session.futures.pop(body.result_status_handle, None)
        failure = session.results.pop(body.result_status_handle)
        if failure is not None:
            raise failure
        response.loaded_executable_fetch_execute_result_response.SetInParent()

    def _cost_analysis(self, session: Session, body: Any, response: Any) -> None:
        executable = self._executable(session, body.loaded_executable_handle)
        out = response.loaded_executable_cost_analysis_response
        cost = executable.meta.get("cost")
        if cost is None:
            out.status.code, out.status.message = UNIMPLEMENTED, "XLA gave no cost analysis"
            return
        _attributes(out.attributes, {k: float(v) for k, v in cost.items()})

    def _program_text(self, session: Session, body: Any, response: Any) -> None:
        loaded = self._executable(session, body.loaded_executable_handle).loaded
        out = response.loaded_executable_human_readable_program_text_response
        try:
            out.human_readable_program_text = loaded.get_hlo_text()
        except Exception as e:  # noqa: BLE001
            out.status.code, out.status.message = UNIMPLEMENTED, str(e)

    def _executable_delete(self, session: Session, body: Any, response: Any) -> None:
        future = next(session.handles)
        session.futures[future] = IfrtFailure(UNIMPLEMENTED, "LoadedExecutable::Delete is not served")
        response.loaded_executable_delete_response.future_handle = future

    def _executable_is_deleted(self, session: Session, body: Any, response: Any) -> None:
        response.loaded_executable_is_deleted_response.is_deleted = False

    def _executable_destruct(self, session: Session, body: Any, response: Any) -> None:
        if session.executables.pop(body.loaded_executable_handle, None) is None:
            raise IfrtFailure(NOT_FOUND, f"unknown loaded executable handle {body.loaded_executable_handle}")
        response.loaded_executable_destruct_response.SetInParent()

    def _default_device_assignment(self, session: Session, body: Any, response: Any) -> None:
        replicas, partitions = int(body.num_replicas), int(body.num_partitions)
        if replicas * partitions > len(self.devices) or replicas < 1 or partitions < 1:
            raise IfrtFailure(RESOURCE_EXHAUSTED, f"{replicas} replicas x {partitions} partitions "
                              f"do not fit this server's {len(self.devices)} device(s) per runtime")
        assignment = response.get_default_device_assignment_response.device_assignment
        assignment.replica_count, assignment.computation_count = replicas, partitions
        for p in range(partitions):
            assignment.computation_devices.add().replica_device_ids.extend(
                self.devices[p * replicas + r].id for r in range(replicas))

    def _default_layout(self, session: Session, body: Any, response: Any) -> None:
        dtype = self._dtype(body.dtype)
        device = self._device(body.device_id)
        layout = self.backend.get_default_layout(dtype, tuple(body.dims), device)
        response.get_default_layout_response.serialized_pjrt_layout = (
            layout._xla_layout().to_string().encode())


# -- helpers -------------------------------------------------------------------------


def _device_bytes(shape: tuple[int, ...], dtype: np.dtype[Any], sharding: Any) -> int:
    """The device bytes an array of ``shape`` laid out as ``sharding`` takes: a
    replicated one counts once per device."""
    shard = sharding.shard_shape(shape)
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(dtype).itemsize * len(sharding.device_set)


def _only_device(array: Any) -> Any:
    """The device of a single-device array; ``IfrtFailure`` for another."""
    devices = array.pieces if isinstance(array, Shards) else array.sharding._device_assignment
    if len(devices) != 1:
        raise IfrtFailure(INVALID_ARGUMENT, f"an array on {len(devices)} devices where one on a "
                          "single device belongs")
    return devices[0]


def _held_bytes(array: Any) -> int:
    """The device bytes ``array`` takes on all its devices together."""
    if isinstance(array, Shards) or len(array.sharding.device_set) == 1:
        return int(array.nbytes)
    return _device_bytes(array.shape, array.dtype, array.sharding)


def _fail(response: Any, failure: IfrtFailure) -> None:
    response.response_metadata.status.code = failure.code
    response.response_metadata.status.message = str(failure)


def _classify(e: Exception) -> IfrtFailure:
    """The status of a failure that is not a refusal of ours: XLA's own code where its
    message starts with one (``INVALID_ARGUMENT: ...``), INTERNAL only for the rest."""
    from jitserve.compiler.errors import first_line

    text = first_line(e).removeprefix(_BAD_STATUS_OR)
    if "RESOURCE_EXHAUSTED" in text or isinstance(e, MemoryError):
        return IfrtFailure(RESOURCE_EXHAUSTED, f"out of memory: {text}")
    code = _STATUS_CODES.get(text.split(":", 1)[0].strip())
    if code is not None:
        return IfrtFailure(code, text.split(":", 1)[1].strip())
    if isinstance(e, (ValueError, TypeError, IndexError, KeyError)):
        return IfrtFailure(INVALID_ARGUMENT, text)
    return IfrtFailure(INTERNAL, f"{type(e).__name__}: {text}")


# How jaxlib words a failed status that a function returned in place of its value
# (``get_default_layout`` of a negative dimension, say): the status follows.
_BAD_STATUS_OR = "Bad StatusOr access: "
# absl status names as XLA's messages start with them, and their codes.
_STATUS_CODES = {
    "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9, "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12,
    "INTERNAL": 13, "UNAVAILABLE": 14, "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
}


def _result_handles(request: Any, kind: str | None) -> list[int]:
    """The client-chosen handles a request would fill: they hold its error if it fails."""
    field = _RESULT_HANDLES.get(kind or "")
    if field is None:
        return []
    value = getattr(getattr(request, kind or ""), field)
    return [int(h) for h in value] if not isinstance(value, int) else [value] if value else []


# Which field of a request holds the handles the client chose for what it makes.
_RESULT_HANDLES = {
    "make_array_from_host_buffer_request": "array_handle",
    "make_arrays_from_host_buffer_shards_request": "array_handles",
    "make_error_arrays_request": "array_handles",
    "assemble_array_from_single_device_arrays_request": "result_handle",
    "remap_arrays_request": "result_handles",
    "bitcast_arrays_request": "result_handles",
    "reshard_arrays_request": "result_handles",
    "disassemble_into_single_device_arrays_request": "result_handles",
    "copy_arrays_request": "result_handles",
    "fully_replicated_shard_request": "result_handle",
    "loaded_executable_execute_request": "result_array_handle",
}


def _attributes(proto: Any, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        entry = proto.attributes[key]  # a map in this protocol's AttributeMapProto
        if isinstance(value, bool):
            entry.bool_value = value
        elif isinstance(value, int):
            entry.int64_value = value
        elif isinstance(value, float):
            entry.float_value = value
        else:
            entry.string_value = str(value).encode()


def _layout_proto(layout: Any, proto: Any) -> None:
    proto.minor_to_major.extend(int(d) for d in layout.minor_to_major())
    for tile in getattr(layout, "tiling", lambda: ())() or ():
        proto.tiles.add().dimensions.extend(int(d) for d in tile)
    bits = layout.element_size_in_bits()
    if bits:
        proto.element_size_in_bits = int(bits)


_MEMORY_ID = re.compile(r"\bid=(\d+)")


def _memory_id(memory: Any) -> int:
    match = _MEMORY_ID.search(repr(memory))
    return int(match.group(1)) if match else 0


def unpack_buffers(descs: Mapping[int, Any]) -> dict[int, np.ndarray]:
    """The host buffers a batch carries, as byte arrays (views of the message or a segment)."""
    handles = list(descs)
    arrays = frames.unpack_arrays([descs[h] for h in handles])
    return {h: a.reshape(-1).view(np.uint8) for h, a in zip(handles, arrays)}

