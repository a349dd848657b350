"""Operators' view of executables on a real server: why each compiled, XLA's analyses,
and an admin's DELETE that drops one from every tier.

One server for the module, with API keys: ``alice`` is a tenant, ``admin`` is in
``JITSERVE_ADMIN_KEYS`` too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import _serve

pytestmark = pytest.mark.timeout(240)

ALICE, ADMIN = "e2e-exe-alice-0123456789", "e2e-exe-admin-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The URL and the log file of a server with keys (``ADMIN`` is an admin key)."""
    tmp = tmp_path_factory.mktemp("executables")
    env = {"JITSERVE_API_KEYS": f"{ALICE},{ADMIN}", "JITSERVE_ADMIN_KEYS": ADMIN,
           "JITSERVE_LOG_LEVEL": "info"}
    with contextlib.contextmanager(_serve)(tmp, env) as url:
        yield url, tmp / "server.log"


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {key}"})


def _polymorphic_program(scale: float) -> bytes:
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b,), np.float32)
    return bytes(jax.export.export(jax.jit(lambda x: jnp.cos(x) * scale))(spec).serialize())


def _compile(http: httpx.Client, pid: str, n: int, static_key: str = "") -> dict[str, Any]:
    r = http.post(f"/v1/programs/{pid}/compile",
                  json={"in_avals": [{"shape": [n], "dtype": "float32"}], "static_key": static_key})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_recompile_says_which_parts_differed(server: tuple[str, Path]) -> None:
    url, log = server
    with _client(url, ALICE) as http:
        pid = http.post("/v1/programs", content=_polymorphic_program(3.0)).json()["program_id"]
        first = _compile(http, pid, 8)
        assert first["tier"] == "compiled" and first["recompiled_because"] is None
        second = _compile(http, pid, 16, static_key="eval")
        assert second["tier"] == "compiled"
        reasons = ["shape: arg 0 float32[8] -> float32[16]", "static: static '' -> 'eval'"]
        assert second["recompiled_because"] == reasons
        record = http.get(f"/v1/executables/{second['executable_id']}").json()
        listed = {e["executable_id"]: e for e in http.get("/v1/executables").json()["executables"]}
    assert record["recompiled_because"] == reasons
    parts = record["key_parts"]
    assert parts["program"] == pid and parts["in_avals"] == "float32[16]"
    assert parts["static"] == "eval" and parts["jax"] == jax.__version__
    assert {"compile_options", "platform", "device_kind", "jaxlib", "xla_flags"} <= set(parts)
    assert record["cost"]["flops"] > 0 and record["cost"]["bytes_accessed"] > 0
    memory = record["memory"]
    assert memory["argument_bytes"] == 64 and memory["output_bytes"] == 64
    assert {"temp_bytes", "alias_bytes", "generated_code_bytes"} <= set(memory)
    assert listed[second["executable_id"]]["cost"] == record["cost"]
    assert listed[first["executable_id"]]["recompiled_because"] is None
    text = log.read_text()
    assert "(float32[16]) tier=compiled" in text
    assert "because shape: arg 0 float32[8] -> float32[16]; static: static '' -> 'eval'" in text


def test_only_an_admin_deletes_and_the_next_call_recompiles(server: tuple[str, Path]) -> None:
    url, _ = server
    with _client(url, ALICE) as alice, _client(url, ADMIN) as admin:
        pid = alice.post("/v1/programs", content=_polymorphic_program(5.0)).json()["program_id"]
        exe = _compile(alice, pid, 4)["executable_id"]
        refused = alice.delete(f"/v1/executables/{exe}")
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "forbidden"
        assert "JITSERVE_ADMIN_KEYS" in refused.json()["error"]["message"]
        assert alice.get(f"/v1/executables/{exe}").status_code == 200  # still there

        deleted = admin.delete(f"/v1/executables/{exe}")
        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["status"] == "deleted"
        assert {"memory", "disk", "index"} <= set(deleted.json()["tiers"])
        assert alice.get(f"/v1/executables/{exe}").status_code == 404
        again = admin.delete(f"/v1/executables/{exe}")
        assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"

        # No tier has it: the next call compiles it again, and it runs.
        assert _compile(alice, pid, 4)["tier"] == "compiled"
        body = {"args": [{"dtype": "float32", "shape": [4], "data": [0.0, 0.0, 0.0, 0.0]}]}
        ran = alice.post(f"/v1/programs/{pid}/execute", params={"wait": 60_000}, json=body)
        assert ran.status_code == 200, ran.text
        assert ran.json()["outputs"][0]["data"] == [5.0, 5.0, 5.0, 5.0]


def test_delete_needs_a_key(server: tuple[str, Path]) -> None:
    url, _ = server
    r = httpx.delete(f"{url}/v1/executables/{'0' * 64}", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


def test_with_redis_the_shared_record_says_it_and_delete_empties_redis(
        start_server: Callable[..., str], redis_url: str, redis_prefix: str) -> None:
    import redis

    from jitserve.compiler.redis import LAYOUT_VERSION

    url = start_server({"REDIS_URL": redis_url, "JITSERVE_REDIS_PREFIX": redis_prefix,
                        "JITSERVE_CACHE_SECRET": "executables-e2e-secret-" + "7c3a" * 8})
    with httpx.Client(base_url=url, timeout=120) as http:
        pid = http.post("/v1/programs", content=_polymorphic_program(7.0)).json()["program_id"]
        _compile(http, pid, 8)
        exe = _compile(http, pid, 32)["executable_id"]
        record = http.get(f"/v1/executables/{exe}").json()
        assert record["source"] == "redis"
        assert record["recompiled_because"] == ["shape: arg 0 float32[8] -> float32[32]"]
        assert record["key_parts"]["in_avals"] == "float32[32]"
        assert record["cost"]["flops"] > 0 and record["memory"]["output_bytes"] == 128
        deleted = http.delete(f"/v1/executables/{exe}")  # no keys: anyone is an admin
        assert deleted.status_code == 200 and "redis" in deleted.json()["tiers"]
        raw = redis.Redis.from_url(redis_url)
        prefix = f"jitserve:v{LAYOUT_VERSION}:{redis_prefix}:"
        assert not raw.exists(f"{prefix}exe:{exe}", f"{prefix}meta:{exe}")
        assert not raw.hexists(f"{prefix}keys:{pid}", exe)
        raw.close()
        assert http.get(f"/v1/executables/{exe}").status_code == 404
        assert _compile(http, pid, 32)["tier"] == "compiled"
