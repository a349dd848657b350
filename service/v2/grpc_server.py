"""The Open Inference Protocol's gRPC interface (``inference.GRPCInferenceService``).

Served with ``grpc.aio`` on the API process's event loop, on a port of its own
(``JITSERVE_GRPC_PORT``; off when unset), so its handlers share the HTTP routes'
program store, calls, futures and metrics (``service.v2.infer``). Like REST:
ServerLive, ServerReady and ServerMetadata are open; ModelReady, ModelMetadata and
ModelInfer need ``authorization: Bearer <key>`` metadata when API keys are on.

ModelInfer reads ``raw_input_contents`` (what tritonclient sends) or typed
``contents``, and answers with ``raw_output_contents``. A refusal is a status
code (``service.v2.errors.GRPC_STATUS``: INVALID_ARGUMENT for bad input,
NOT_FOUND, UNAUTHENTICATED, ...) and the message ``/v2`` would give. Each call is
counted in ``jitserve_requests_total`` with ``route="grpc:<Method>"`` and the
status code's name as ``status``.

    server = await start(services, version)    # the app's Services, once its lifespan made them
    ...
    await server.stop(5)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from ..api.auth import authenticate
from ..api.deps import Services
from ..errors import BadRequest
from . import grpc_service_pb2 as pb
from . import grpc_service_pb2_grpc as pb_grpc
from .errors import refusal_of
from .infer import Inference, InputTensor, Model, RequestedOutput
from .rest import server_info
from .tensors import raw_bytes

__all__ = ["start"]

log = logging.getLogger("jitserve")
refusal_log = logging.getLogger("jitserve.refusals")

# The typed contents field of each datatype (FP16 and BF16 travel raw only).
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents"}

R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


async def start(services: Services, version: str) -> grpc.aio.Server:
    """A started gRPC server on ``settings.host``:``settings.grpc_port`` for a running app's
    ``services``; ``version`` is the server's, as its metadata names it."""
    settings = services.settings
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", min(settings.max_body_bytes, 2**31 - 1)),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),  # a second server on the same port is an error, not a split
    ])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(services, version), server)
    address = f"{settings.host}:{settings.grpc_port}"
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen for gRPC on {address} (JITSERVE_GRPC_PORT)")
    await server.start()
    log.info("gRPC (Open Inference Protocol) on %s:%d", settings.host, port,
             extra={"fields": {"grpc_port": port}})
    return server


def _rpc(method: Handler[R]) -> Handler[R]:
    """A handler whose refusals become the status code and message of the call."""
    route = f"grpc:{method.__name__}"

    @functools.wraps(method)
    async def guarded(self: _Servicer, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            reply = await method(self, request, context)
        except Exception as e:  # noqa: BLE001 - every refusal is answered as a status
            refusal = refusal_of(e)
        else:
            self.count(route, "OK")
            return reply
        self.count(route, refusal.grpc_status)
        if refusal.status < 500:
            refusal_log.info("refused gRPC %s: %s %s: %.300s", method.__name__,
                             refusal.grpc_status, refusal.code.value, refusal.message,
                             extra={"fields": {"method": "gRPC", "path": method.__name__,
                                               "status": refusal.status,
                                               "code": refusal.code.value}})
        await context.abort(getattr(grpc.StatusCode, refusal.grpc_status), refusal.message)
        raise AssertionError("unreachable: abort raises")

    return guarded


class _Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, services: Services, version: str) -> None:
        self._inference = Inference.of(services)
        self._settings = services.settings
        self._metrics = services.metrics
        self._version = version

    def count(self, route: str, status: str) -> None:
        self._metrics.requests.labels(route, status).inc()

    def _owner(self, context: grpc.aio.ServicerContext) -> str | None:
        token = None
        for key, value in context.invocation_metadata() or ():
            if key.lower() == "authorization" and isinstance(value, str):
                scheme, _, rest = value.partition(" ")
                token = rest if scheme.lower() == "bearer" else None
        return authenticate(token, self._settings)

    @_rpc
    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._inference.ready())

    @_rpc
    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**server_info(self._version))

    @_rpc
    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        _, model = await self._model(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=model.refusal is None)

    @_rpc
    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        _, model = await self._model(request.name, request.version, context)
        doc = model.metadata()
        tensors = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=doc["name"], versions=doc["versions"], platform=doc["platform"],
            inputs=[tensors(**t) for t in doc["inputs"]],
            outputs=[tensors(**t) for t in doc["outputs"]])

    @_rpc
    async def ModelInfer(self, request: Any, context: Any) -> pb.ModelInferResponse:
        owner, model = await self._model(request.model_name, request.model_version, context)
        model.check()
        inputs = _inputs(request)
        requested = [RequestedOutput(o.name) for o in request.outputs]
        for o in request.outputs:
            if "classification" in o.parameters:
                raise BadRequest(f"output {o.name!r:.100}: the classification extension is "
                                 "not served")
        outputs = await self._inference.infer(owner, model, inputs, requested)
        tensor = pb.ModelInferResponse.InferOutputTensor
        return pb.ModelInferResponse(
            model_name=model.name, model_version=str(model.version), id=request.id,
            outputs=[tensor(name=o.name, datatype=o.datatype, shape=o.array.shape)
                     for o in outputs],
            raw_output_contents=[raw_bytes(o.array).tobytes() for o in outputs])

    async def _model(self, name: str, version: str, context: Any) -> tuple[str | None, Model]:
        """The caller's owner id and the model it names (its latest version when empty)."""
        owner = self._owner(context)
        return owner, await self._inference.model(owner, name, version or None)


def _inputs(request: Any) -> list[InputTensor]:
    """The request's inputs: raw contents by position, or each input's typed contents."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents has {len(raw)} entries for "
                         f"{len(request.inputs)} inputs; send one per input, in order")
    inputs = []
    for i, t in enumerate(request.inputs):
        tensor = InputTensor(t.name, t.datatype, list(t.shape))
        if raw:
            if t.HasField("contents"):
                raise BadRequest(f"input {t.name!r:.100} has contents, but the request has "
                                 "raw_input_contents; send one or the other")
            tensor.raw = raw[i]
        else:
            tensor.data = _contents(t)
        inputs.append(tensor)
    return inputs


def _contents(t: Any) -> list[Any] | None:
    if not t.HasField("contents"):
        return None
    field = _CONTENTS.get(t.datatype)
    if field is None:
        raise BadRequest(f"input {t.name!r:.100}: {t.datatype} has no typed contents; send it "
                         "in raw_input_contents")
    return list(getattr(t.contents, field))
