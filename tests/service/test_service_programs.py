"""Program routes: upload, describe, compile; plus health, devices and metrics."""

from __future__ import annotations

import hashlib

import pytest

from jitserve import wire
from jitserve.compiler.program_store import decode_program_blob

pytestmark = pytest.mark.timeout(120)

OCTET = {"content-type": "application/octet-stream"}


async def test_upload_is_content_addressed_and_idempotent(make_api) -> None:
    async with make_api(own_runtimes=True) as api:  # a store that has never seen add_mul
        await _upload_twice(api)


async def _upload_twice(api) -> None:
    data = api.programs["add_mul"]
    first = await api.http.post("/v1/programs", content=data, headers=OCTET)
    again = await api.http.post("/v1/programs", params={"format": "jax_export"}, content=data,
                                headers=OCTET)
    assert (first.status_code, again.status_code) == (201, 200)
    doc = first.json()
    assert doc == again.json()
    assert doc["program_id"] == hashlib.sha256(data).hexdigest()
    assert doc["format"] == "jax_export"
    assert doc["in_avals"] == [{"shape": [2, 3], "dtype": "float32"}] * 2
    assert doc["out_tree"] == {"tuple": [None, None]}
    assert doc["platforms"] == ["cpu"]


async def test_get_program_and_unknown_ids(api) -> None:
    pid = await api.upload("colsum")
    r = await api.http.get(f"/v1/programs/{pid}")
    assert r.status_code == 200
    assert r.json()["in_avals"] == [{"shape": ["b", 3], "dtype": "float32"}]
    for unknown in ("0" * 64, "nope", "..%2F..%2Fetc%2Fpasswd"):
        r = await api.http.get(f"/v1/programs/{unknown}")
        assert r.status_code == 404, unknown
        assert r.json()["error"]["code"] == "not_found"


async def test_programs_survive_a_restart(make_api, tmp_path) -> None:
    async with make_api(cache_dir=tmp_path / "c", own_runtimes=True) as api:
        pid = await api.upload("triple")
    stored = (tmp_path / "c" / "programs" / pid[:2] / pid).read_bytes()
    assert decode_program_blob(pid, stored) == (api.programs["triple"], "jax_export")
    async with make_api(cache_dir=tmp_path / "c", own_runtimes=True) as api:
        r = await api.http.get(f"/v1/programs/{pid}")
        assert r.status_code == 200
        assert r.json()["program_id"] == pid


@pytest.mark.parametrize(("content", "params", "code"), [
    (b"definitely not a program", {}, "invalid_program"),
    (b"", {}, "invalid_program"),
    (b"module {}", {"format": "jax_export"}, "invalid_program"),
    (b"x", {"format": "pickle"}, "bad_request"),
])
async def test_bad_uploads_are_400(api, content, params, code) -> None:
    r = await api.http.post("/v1/programs", content=content, params=params, headers=OCTET)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]


async def test_program_over_the_size_limit_is_413(make_api) -> None:
    async with make_api(max_program_bytes=1000) as api:
        r = await api.http.post("/v1/programs", content=api.programs["add_mul"], headers=OCTET)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    assert "JITSERVE_MAX_PROGRAM_BYTES" in r.json()["error"]["message"]


async def test_compile_static_then_cached(api) -> None:
    pid = await api.upload("add_mul")
    first = await api.http.post(f"/v1/programs/{pid}/compile")
    again = await api.http.post(f"/v1/programs/{pid}/compile", json={})
    assert first.status_code == again.status_code == 200, first.text
    assert first.json()["executable_id"] == again.json()["executable_id"]
    assert again.json()["tier"] == "memory"
    assert first.json()["out_avals"] == [{"shape": [2, 3], "dtype": "float32"}] * 2
    hits = await api.metric("jitserve_cache_hits_total", tier="memory")
    assert hits >= 1


async def test_compile_dynamic_program_needs_avals(api) -> None:
    pid = await api.upload("colsum")
    r = await api.http.post(f"/v1/programs/{pid}/compile")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "signature_mismatch"
    body = wire.packb({"in_avals": [{"shape": [5, 3], "dtype": "float32"}]})
    r = await api.http.post(f"/v1/programs/{pid}/compile", content=body,
                            headers={"content-type": wire.MSGPACK})
    assert r.status_code == 200, r.text
    assert r.json()["in_avals"] == [{"shape": [5, 3], "dtype": "float32"}]
    assert r.json()["out_avals"] == [{"shape": [3], "dtype": "float32"}]


@pytest.mark.parametrize("body", [
    {"in_avals": [{"shape": [5, 3], "dtype": "float33"}]},
    {"in_avals": [{"shape": [-5, 3], "dtype": "float32"}]},
    {"in_avals": [{"shape": [5, 4], "dtype": "float32"}]},
    {"in_avals": "nope"},
    {"unexpected": 1},
])
async def test_compile_with_bad_avals_is_400(api, body) -> None:
    pid = await api.upload("colsum")
    r = await api.http.post(f"/v1/programs/{pid}/compile", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] in ("signature_mismatch", "bad_request")


async def test_health_ready_devices_openapi(api) -> None:
    assert (await api.http.get("/healthz")).json() == {"status": "ok"}
    ready = await api.http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    devices = (await api.http.get("/v1/devices")).json()
    assert devices["backend"]["platform"] == "cpu"
    assert devices["devices"][0]["default"] is True
    spec = (await api.http.get("/openapi.json")).json()
    assert "/v1/programs/{program_id}/execute" in spec["paths"]


async def test_metrics_use_route_templates(api) -> None:
    await api.http.get("/v1/programs/" + "0" * 64)
    await api.http.get("/no/such/route")
    text = (await api.http.get("/metrics")).text
    assert 'jitserve_requests_total{route="/v1/programs/{program_id}",status="404"} 1.0' in text
    assert 'route="unmatched",status="404"' in text
    for name in ("jitserve_compilations_total", "jitserve_compile_seconds_count",
                 "jitserve_cache_misses_total", "jitserve_execute_seconds_count",
                 "jitserve_device_bytes_in_use", 'jitserve_futures{state="pending"}',
                 'jitserve_transfer_bytes_total{direction="in"}',
                 'jitserve_executions_total{status="done"}'):
        assert name in text, name
