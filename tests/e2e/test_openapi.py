"""The OpenAPI document of a real server is honest, and docs/api.md covers the same routes.

Every route documents the error envelope with its statuses (no FastAPI
``HTTPValidationError``), the ``/v1`` routes carry the bearer scheme, execute and
compile document typed bodies, and ``/docs`` and ``/redoc`` load their scripts
from the server itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)

API_MD = Path(__file__).parents[2] / "docs" / "api.md"
_ENVELOPE = "#/components/schemas/ErrorBody"
# Routes that answer no error of their own (no input, no auth).
_NO_ERRORS = {("GET", "/healthz"), ("GET", "/metrics")}


@pytest.fixture(scope="module")
def spec(server_url: str) -> dict[str, Any]:
    return httpx.get(f"{server_url}/openapi.json", timeout=30).json()


def _operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, ops in spec["paths"].items()
            for method, op in ops.items()]


def test_every_error_answer_is_the_envelope(spec: dict[str, Any]) -> None:
    for method, path, op in _operations(spec):
        errors = {s: r for s, r in op["responses"].items() if int(s) >= 400}
        if (method, path) not in _NO_ERRORS:
            assert errors, f"{method} {path} documents no error answer"
        for status, answer in errors.items():
            schema = answer["content"]["application/json"]["schema"]
            assert schema == {"$ref": _ENVELOPE}, f"{method} {path} {status}: {schema}"
    assert "HTTPValidationError" not in str(spec)


def test_v1_routes_use_the_bearer_scheme(spec: dict[str, Any]) -> None:
    schemes = spec["components"]["securitySchemes"]
    assert schemes == {"HTTPBearer": {"type": "http", "scheme": "bearer",
                                      "description": schemes["HTTPBearer"]["description"]}}
    for method, path, op in _operations(spec):
        parameters = [p["name"].lower() for p in op.get("parameters", [])]
        assert "authorization" not in parameters, f"{method} {path}"
        if path.startswith("/v1/"):
            assert op["security"] == [{"HTTPBearer": []}], f"{method} {path}"
            assert "401" in op["responses"], f"{method} {path}"


@pytest.mark.parametrize("path", ["/v1/programs/{program_id}/execute",
                                  "/v1/programs/{program_id}/compile"])
def test_message_bodies_are_typed(spec: dict[str, Any], path: str) -> None:
    content = spec["paths"][path]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", "application/msgpack"}
    schemas = spec["components"]["schemas"]
    for media in content.values():
        name = media["schema"]["$ref"].rsplit("/", 1)[1]
        assert schemas[name]["type"] == "object", name
    if path.endswith("/execute"):
        array = schemas["ArrayJSON"]
        assert set(array["required"]) == {"dtype", "shape", "data"}
        assert set(schemas["FutureRef"]["properties"]) == {"future", "output"}


def _documented(text: str) -> set[tuple[str, str]]:
    """The ``METHOD /path`` of docs/api.md, with ``{id}`` normalized and queries cut."""
    found = re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s?\[]*)", text)
    return {(m, re.sub(r"\{[^}]*\}", "{}", p)) for m, p in found}


def test_api_md_lists_every_route_and_no_other(spec: dict[str, Any]) -> None:
    served = {(m, re.sub(r"\{[^}]*\}", "{}", p)) for m, p, _ in _operations(spec)}
    documented = _documented(API_MD.read_text())
    assert served - documented == set(), "routes missing from docs/api.md"
    assert documented - served == set(), "docs/api.md names routes the server lacks"


def test_docs_pages_load_scripts_from_the_server(server_url: str) -> None:
    for page, scripts in {"/docs": ["/static/swagger-ui-bundle.js", "/static/swagger-ui.css"],
                          "/redoc": ["/static/redoc.standalone.js"]}.items():
        html = httpx.get(server_url + page, timeout=30).text
        assert "cdn.jsdelivr.net" not in html and "fonts.googleapis" not in html
        for script in scripts:
            assert script in html
            r = httpx.get(server_url + script, timeout=30)
            assert r.status_code == 200 and len(r.content) > 100_000, script
