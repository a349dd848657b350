"""What a real server writes to its log: startup, compiles, refusals; text and JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jitserve import wire

pytestmark = pytest.mark.timeout(300)


def _program() -> bytes:
    def scaled_sin(x):  # noqa: ANN001, ANN202 - the name the compile line must show
        return jnp.sin(x) * 2

    spec = jax.ShapeDtypeStruct((4,), np.float32)
    return bytes(jax.export.export(jax.jit(scaled_sin))(spec).serialize())


def _exercise(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        pid = http.post("/v1/programs", content=_program()).json()["program_id"]
        body = wire.packb({"args": [np.arange(4, dtype=np.float32)]})
        headers = {"content-type": wire.MSGPACK}
        r = http.post(f"/v1/programs/{pid}/execute", params={"wait": 30_000}, content=body,
                      headers=headers)
        assert r.status_code == 200, r.text
        bad = wire.packb({"args": [np.arange(5, dtype=np.int32)]})
        r = http.post(f"/v1/programs/{pid}/execute", content=bad, headers=headers)
        assert r.status_code == 400


def _log(start_server: Callable[..., str], tmp_path: Path, fmt: str) -> str:
    env = {"JITSERVE_LOG_LEVEL": "info", "JITSERVE_LOG_FORMAT": fmt}
    _exercise(start_server(env, fmt))
    return (tmp_path / fmt / "server.log").read_text()


def test_json_lines_carry_the_fields(start_server: Callable[..., str], tmp_path: Path) -> None:
    records = []
    for line in _log(start_server, tmp_path, "json").splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    by_logger: dict[str, list[dict]] = {}
    for record in records:
        by_logger.setdefault(record["logger"], []).append(record)
    (ready,) = [r for r in by_logger["jitserve"] if "ready" in r["message"]]
    assert ready["platform"] == "cpu" and ready["auth"] is False
    assert "memory" in ready["tiers"] and ready["limits"]["max_body_bytes"] > 0
    (compiled,) = by_logger["jitserve.compile"]
    assert compiled["tier"] == "compiled" and compiled["function"] == "scaled_sin"
    assert compiled["signature"] == "float32[4]" and compiled["seconds"] > 0
    assert len(compiled["program_id"]) == 64
    (refused,) = by_logger["jitserve.refusals"]
    assert refused["status"] == 400 and refused["code"] == "signature_mismatch"
    assert refused["path"].endswith("/execute")


def test_text_lines_say_the_same(start_server: Callable[..., str], tmp_path: Path) -> None:
    log = _log(start_server, tmp_path, "text")
    assert "jitserve ready on cpu" in log and "auth off" in log
    assert "compiled " in log and "scaled_sin(float32[4]) tier=compiled" in log
    assert "refused POST /v1/programs/" in log and "400 signature_mismatch" in log
