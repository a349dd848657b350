"""The OpenAPI document, and the pages that show it, served from this package.

Every route documents its error answers (``ErrorBody``, with the statuses of the
codes it can answer, ``errors(...)``), the ``/v1`` routes carry the bearer scheme
(``deps.get_owner``), and execute and compile document their bodies in JSON and
msgpack. FastAPI's own ``422 HTTPValidationError`` entries are dropped: a request
that fails validation is a ``400 bad_request`` here (``service.errors``).

``/docs`` (Swagger UI) and ``/redoc`` load their scripts from ``/static``, copies
of swagger-ui-dist and redoc shipped in ``service/static`` (with their licenses),
so the pages work on a host that cannot reach a CDN.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from jitserve import wire
from jitserve.wire import ErrorCode

from .schemas import (
    ArraysJSON,
    ArraysMsgpack,
    CompileRequest,
    ErrorBody,
    ExecuteJSON,
    ExecuteMsgpack,
    OutputsJSON,
)

__all__ = ["STATIC_DIR", "errors", "install_docs", "message_body", "outputs_content"]

STATIC_DIR = Path(__file__).with_name("static")

_HEADERS = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    429: {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}},
    503: {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}},
}


def errors(*codes: ErrorCode) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that can answer ``codes``: one entry per status.

        @router.get("/{id}", responses=errors(ErrorCode.NOT_FOUND))
    """
    by_status: dict[int, list[str]] = {}
    for code in codes:
        by_status.setdefault(code.status, []).append(code.value)
    return {status: _error_response(names, _HEADERS.get(status))
            for status, names in sorted(by_status.items())}


def _error_response(codes: Iterable[str], headers: dict[str, Any] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"model": ErrorBody, "description": "error: " + ", ".join(codes)}
    if headers:
        entry["headers"] = headers
    return entry


def message_body(json_model: type[BaseModel], msgpack_model: type[BaseModel], *,
                 required: bool) -> dict[str, Any]:
    """``openapi_extra`` for a body that is msgpack or JSON, by ``Content-Type``."""
    return {"requestBody": {"required": required, "content": {
        wire.MSGPACK: {"schema": _ref(msgpack_model)},
        wire.JSON: {"schema": _ref(json_model)}}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


# Models that only ``openapi_extra`` names: their schemas join the components.
_BODY_MODELS: tuple[type[BaseModel], ...] = (ExecuteJSON, ExecuteMsgpack, CompileRequest,
                                              OutputsJSON, ArraysJSON, ArraysMsgpack)


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description,
                          routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in _BODY_MODELS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        _drop_validation_errors(doc)
        app.openapi_schema = doc
    return app.openapi_schema


def _drop_validation_errors(doc: dict[str, Any]) -> None:
    """Remove FastAPI's ``422 HTTPValidationError``: validation failures are 400 here."""
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            answer = op.get("responses", {}).get("422", {})
            if "HTTPValidationError" in str(answer.get("content", "")):
                del op["responses"]["422"]
    schemas = doc.get("components", {}).get("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)


def install_docs(app: FastAPI) -> None:
    """Serve ``/openapi.json``, ``/docs`` and ``/redoc`` with the packaged scripts.

    The app must be made with ``docs_url=None, redoc_url=None``.
    """
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    title = app.title

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json", title=f"{title} - Swagger UI",
            swagger_js_url="/static/swagger-ui-bundle.js",
            swagger_css_url="/static/swagger-ui.css",
            swagger_favicon_url="/static/favicon-32x32.png")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{title} - ReDoc",
                              redoc_js_url="/static/redoc.standalone.js",
                              redoc_favicon_url="/static/favicon-32x32.png",
                              with_google_fonts=False)


def outputs_content() -> dict[str, Any]:
    """The ``content`` of an answer holding a future's outputs: msgpack, or JSON."""
    return {wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}},
            wire.JSON: {"schema": _ref(OutputsJSON)}}
