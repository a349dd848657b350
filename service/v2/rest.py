"""``/v2``: the Open Inference Protocol's REST interface (KServe v2, Triton's HTTP protocol).

Health (open, like ``/healthz``)::

    GET /v2                                  server metadata
    GET /v2/health/live, /v2/health/ready

Models (bearer token when API keys are on, like ``/v1``)::

    GET  /v2/models/{name}[/versions/{v}]            metadata
    GET  /v2/models/{name}[/versions/{v}]/ready      200 when it can run
    POST /v2/models/{name}[/versions/{v}]/infer      run it

An infer body is JSON, or, with the binary tensor extension, a JSON header of
``Inference-Header-Content-Length`` bytes followed by the tensors whose
``parameters.binary_data_size`` say how many bytes each takes, in input order.
The answer is alike: outputs asked for in binary (``binary_data``, or
``binary_data_output`` for all) follow the JSON header, whose length is the
answer's ``Inference-Header-Content-Length``. A request body may be compressed
(``Content-Encoding: gzip`` or ``deflate``, bounded like any body).

Errors are the protocol's ``{"error": "<message>"}`` with the status of the
matching ``/v1`` code (``service.v2.errors``). These routes stay out of the
OpenAPI document, whose error envelope is ``/v1``'s; the protocol's own
documents describe them (docs/v2.md).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from ..api.deps import Body, Owner, ServicesDep
from ..errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from .errors import refusal_of
from .infer import (
    Inference,
    InputTensor,
    Model,
    OutputTensor,
    RequestedOutput,
)
from .tensors import json_data, raw_bytes

__all__ = ["router"]

refusal_log = logging.getLogger("jitserve.refusals")

HEADER_LENGTH = "Inference-Header-Content-Length"
#: The protocol extensions served (``GET /v2``).
EXTENSIONS = ("binary_tensor_data",)


class _V2Route(APIRoute):
    """A route whose refusals are the protocol's ``{"error": "<message>"}``, not ``/v1``'s."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientDisconnect:
                raise  # nobody to answer: the app's handler counts it
            except Exception as e:  # noqa: BLE001 - every refusal is answered in v2's form
                return _refused(request, e)

        return answer


router = APIRouter(prefix="/v2", tags=["v2"], route_class=_V2Route, include_in_schema=False)


def _refused(request: Request, exc: Exception) -> JSONResponse:
    refusal = refusal_of(exc)
    if refusal.status < 500:
        refusal_log.info("refused %s %s: %d %s: %.300s", request.method, request.url.path,
                         refusal.status, refusal.code.value, refusal.message,
                         extra={"fields": {"method": request.method, "path": request.url.path,
                                           "status": refusal.status,
                                           "code": refusal.code.value}})
    return JSONResponse({"error": refusal.message}, refusal.status, headers=refusal.headers)


async def get_inference(services: ServicesDep) -> Inference:
    return Inference.of(services)


InferenceDep = Annotated[Inference, Depends(get_inference)]


@router.get("")
async def server_metadata(request: Request) -> dict[str, Any]:
    """The server's name, version and protocol extensions."""
    return server_info(request.app.version)


def server_info(version: str) -> dict[str, Any]:
    """The server metadata document (REST), whose fields the gRPC answer has too."""
    return {"name": "jitserve", "version": version, "extensions": list(EXTENSIONS)}


@router.get("/health/live")
async def live() -> dict[str, bool]:
    """The server is up (as ``/healthz``)."""
    return {"live": True}


@router.get("/health/ready")
async def ready(inference: InferenceDep) -> JSONResponse:
    """Ready for inferences when every runtime is up (503 otherwise, as ``/readyz``)."""
    if inference.ready():
        return JSONResponse({"ready": True})
    return JSONResponse({"ready": False, "error": "not ready: a runtime is not up"}, 503)


_MODEL = "/models/{name}"
_VERSION = "/models/{name}/versions/{version}"


@router.get(_MODEL)
@router.get(_VERSION)
async def model_metadata(name: str, inference: InferenceDep, owner: Owner,
                         version: str | None = None) -> dict[str, Any]:
    """Versions, platform, and the inputs' and outputs' names, datatypes and shapes."""
    return (await inference.model(owner, name, version)).metadata()


@router.get(_MODEL + "/ready")
@router.get(_VERSION + "/ready")
async def model_ready(name: str, inference: InferenceDep, owner: Owner,
                      version: str | None = None) -> dict[str, Any]:
    """200 when the model can run; 400 naming why it cannot, 404 when unknown."""
    model = await inference.model(owner, name, version)
    model.check()
    return {"name": model.name, "version": str(model.version), "ready": True}


@router.post(_MODEL + "/infer")
@router.post(_VERSION + "/infer")
async def infer(name: str, request: Request, inference: InferenceDep, owner: Owner, body: Body,
                services: ServicesDep, version: str | None = None) -> Response:
    """Run the model: JSON tensors, or the binary tensor extension."""
    model = await inference.model(owner, name, version)
    model.check()
    raw = _decoded(await body.read(), request.headers.get("content-encoding"),
                   services.settings.max_body_bytes)
    doc, inputs, requested, binary = _parse(raw, request.headers.get(HEADER_LENGTH))
    del raw  # the inputs are views of it, and go once sent
    outputs = await inference.infer(owner, model, inputs, requested, binary)
    return _answer(model, doc.get("id"), outputs)


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def unknown_route(path: str, request: Request) -> Response:
    """Any other ``/v2`` path: the protocol's 404 rather than ``/v1``'s envelope."""
    return JSONResponse({"error": f"no v2 route {request.method} /v2/{path:.200}; see "
                                  "docs/v2.md for the routes served"}, 404)


def _decoded(body: bytearray, encoding: str | None, limit: int) -> bytearray | bytes:
    """The body, decompressed when ``Content-Encoding`` says (at most ``limit`` bytes)."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r:.40} is not supported; send "
                                   "gzip, deflate or none")
    # tritonclient's "deflate" is the zlib format (RFC 1950), as most clients send it.
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise BadRequest(f"the body is not valid {encoding} data: {e}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise PayloadTooLarge(f"the decompressed body is over the limit of {limit:,} bytes "
                              "(JITSERVE_MAX_BODY_BYTES)", limit=limit)
    if not inflater.eof:
        raise BadRequest(f"the {encoding} body ended early")
    return out


def _parse(body: bytearray | bytes, header_length: str | None,
           ) -> tuple[dict[str, Any], list[InputTensor], list[RequestedOutput], bool]:
    """An infer request: its JSON document, inputs, requested outputs and binary default."""
    size = len(body)
    if header_length is not None:
        if not header_length.strip().isdigit() or int(header_length) > size:
            raise BadRequest(f"{HEADER_LENGTH} must be a byte count within the body's {size} "
                             f"bytes, got {header_length!r:.40}")
        size = int(header_length)
    view = memoryview(body)
    doc = _json(view[:size])
    inputs = _inputs(doc.get("inputs"), view, size)
    parameters = _parameters(doc.get("parameters"), "the request")
    binary = parameters.get("binary_data_output", False)
    if not isinstance(binary, bool):
        raise BadRequest(f"parameter binary_data_output must be true or false, got {binary!r:.40}")
    return doc, inputs, _requested(doc.get("outputs")), binary


def _json(data: memoryview) -> dict[str, Any]:
    try:
        doc = orjson.loads(data)  # a tenth of json.loads' time on a tensor's numbers
    except orjson.JSONDecodeError:
        doc = _stdlib_loads(data)  # NaN and Infinity, as Python clients write them
    if not isinstance(doc, dict):
        raise BadRequest("the inference request must be a JSON object with 'inputs'")
    if not isinstance(doc.get("id", ""), str):
        raise BadRequest("the request's 'id' must be a string")
    return doc


def _stdlib_loads(data: memoryview) -> Any:
    try:
        return json.loads(bytes(data))
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the inference request is not valid JSON: {e}") from None


def _dumps(doc: dict[str, Any], arrays: list[np.ndarray]) -> bytes:
    """``doc`` (whose tensors' data are flat arrays) as JSON bytes."""
    if all(a.dtype.kind != "f" or bool(np.isfinite(a).all()) for a in arrays):
        return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    # orjson writes NaN and infinities as null; Python's json writes NaN, Infinity and
    # -Infinity, which Triton's clients (and Python's json) read back.
    return json.dumps(doc, default=np.ndarray.tolist, separators=(",", ":")).encode()


def _inputs(docs: Any, body: memoryview, offset: int) -> list[InputTensor]:
    """The inputs of a request; binary ones are views of ``body`` after ``offset``."""
    if not isinstance(docs, list):
        raise BadRequest("the inference request needs 'inputs': a list of tensors "
                         "{name, datatype, shape, data}")
    inputs = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise BadRequest(f"inputs[{i}] must be an object {{name, datatype, shape, data}}")
        name = doc.get("name")
        where = f"input {name!r:.100}"
        size = _parameters(doc.get("parameters"), where).get("binary_data_size")
        tensor = InputTensor(name, doc.get("datatype"), doc.get("shape"), data=doc.get("data"))
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise BadRequest(f"{where}: binary_data_size must be a byte count, got {size!r:.40}")
            if tensor.data is not None:
                raise BadRequest(f"{where} has both 'data' and binary_data_size; send one")
            if offset + size > len(body):
                raise BadRequest(f"{where}: binary_data_size {size} runs past the end of the "
                                 f"body ({len(body) - offset} binary bytes left)")
            tensor.raw, offset = body[offset:offset + size], offset + size
        inputs.append(tensor)
    if offset != len(body):
        raise BadRequest(f"the body has {len(body) - offset} bytes that no input's "
                         "binary_data_size accounts for")
    return inputs


def _requested(docs: Any) -> list[RequestedOutput]:
    if docs is None:
        return []
    if not isinstance(docs, list):
        raise BadRequest("'outputs' must be a list of {name, parameters}")
    out = []
    for i, doc in enumerate(docs):
        name = doc.get("name") if isinstance(doc, dict) else None
        if not isinstance(name, str):
            raise BadRequest(f"outputs[{i}] must be an object with a 'name'")
        parameters = _parameters(doc.get("parameters"), f"output {name!r:.100}")
        if parameters.get("classification"):
            raise BadRequest(f"output {name!r:.100}: the classification extension is not served")
        binary = parameters.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise BadRequest(f"output {name!r:.100}: binary_data must be true or false")
        out.append(RequestedOutput(name, binary))
    return out


def _parameters(doc: Any, where: str) -> dict[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise BadRequest(f"{where}: 'parameters' must be an object")
    return doc


def _answer(model: Model, request_id: str | None, outputs: list[OutputTensor]) -> Response:
    """The infer answer: JSON, or a JSON header and the binary outputs after it."""
    docs, chunks, arrays = [], [], []
    for o in outputs:
        doc: dict[str, Any] = {"name": o.name, "datatype": o.datatype, "shape": list(o.array.shape)}
        if o.binary:
            chunk = raw_bytes(o.array)
            doc["parameters"] = {"binary_data_size": chunk.nbytes}
            chunks.append(chunk)
        else:
            doc["data"] = json_data(o.array)
            arrays.append(doc["data"])
        docs.append(doc)
    head: dict[str, Any] = {"model_name": model.name, "model_version": str(model.version)}
    if request_id:
        head["id"] = request_id
    header = _dumps({**head, "outputs": docs}, arrays)
    if not chunks:
        return Response(header, media_type="application/json")
    return Response(b"".join([header, *chunks]), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(header))})
