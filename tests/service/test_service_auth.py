"""Bearer-token auth, future ownership, and the settings that configure them."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from jitserve.service.settings import Settings

pytestmark = pytest.mark.timeout(120)

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
X = np.ones((2, 3), np.float32)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, bearer("wrong-key-000000"), {"authorization": ALICE},
                                     {"authorization": "Basic YWxpY2U6eA=="}])
async def test_v1_needs_a_valid_key(make_api, headers) -> None:
    async with make_api(api_keys=[ALICE, BOB]) as api:
        for method, path in [("GET", "/v1/devices"), ("POST", "/v1/programs"),
                             ("GET", "/v1/futures/x"), ("DELETE", "/v1/futures/x"),
                             ("POST", "/v1/programs/" + "0" * 64 + "/execute")]:
            r = await api.http.request(method, path, headers=headers, content=b"zz")
            assert r.status_code == 401, (method, path, r.text)
            assert r.json()["error"]["code"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"


async def test_open_routes_stay_open(make_api) -> None:
    async with make_api(api_keys=[ALICE]) as api:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await api.http.get(path)).status_code == 200, path


async def test_futures_belong_to_their_creator(make_api) -> None:
    async with make_api(api_keys=[ALICE, BOB]) as api:
        api.http.headers.update(bearer(ALICE))
        add_mul, triple = await api.upload("add_mul"), await api.upload("triple")
        r = await api.execute(add_mul, [X, X], wait=30_000)
        assert r.status_code == 200
        fid = (await api.execute(add_mul, [X, X])).json()["future_id"]
        bob = bearer(BOB)
        # Bob sees neither Alice's program nor her future; his own upload of the same
        # bytes is his (tests/service/test_service_tenants.py has the rest).
        assert (await api.http.get(f"/v1/programs/{add_mul}", headers=bob)).status_code == 404
        r = await api.http.post("/v1/programs", content=api.programs["triple"], headers=bob)
        assert r.status_code == 201 and r.json()["program_id"] == triple
        for method, path in [("GET", f"/v1/futures/{fid}"), ("GET", f"/v1/futures/{fid}/result"),
                             ("DELETE", f"/v1/futures/{fid}")]:
            r = await api.http.request(method, path, headers=bob)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await api.execute(triple, [{"future": fid, "output": 0}], headers=bob)
        assert r.status_code == 404
        # Alice can do all of it.
        r = await api.execute(triple, [{"future": fid, "output": 0}], wait=30_000)
        assert r.status_code == 200
        assert (await api.http.delete(f"/v1/futures/{fid}")).status_code == 200


def test_api_keys_parse_from_a_comma_separated_env(monkeypatch) -> None:
    monkeypatch.setenv("JITSERVE_API_KEYS", f" {ALICE}, {BOB} ,")
    monkeypatch.setenv("JITSERVE_MAX_LIVE_FUTURES", "7")
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    monkeypatch.setenv("JITSERVE_CACHE_SECRET", "0123456789abcdef" * 4)  # required with Redis
    s = Settings()
    assert s.api_keys == (ALICE, BOB) and s.auth_enabled
    assert s.max_live_futures == 7
    assert s.redis_url == "redis://example:6379/0"


@pytest.mark.parametrize("key", ["changeme", "secret", "short"])
def test_placeholder_keys_are_refused_outside_development(monkeypatch, key) -> None:
    monkeypatch.setenv("JITSERVE_API_KEYS", key)
    with pytest.raises(ValidationError, match="placeholder"):
        Settings()
    monkeypatch.setenv("JITSERVE_ENV", "development")
    assert Settings().api_keys == (key,)


def test_defaults_run_without_redis_or_keys(monkeypatch) -> None:
    for name in ("REDIS_URL", "JITSERVE_REDIS_URL", "JITSERVE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    s = Settings()
    assert s.redis_url is None and not s.auth_enabled
    assert "~" not in str(s.cache_dir)
    assert s.max_body_bytes >= 512 << 20  # a 256 MiB round trip fits
