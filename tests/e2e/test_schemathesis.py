"""Schemathesis over the server's own OpenAPI document: no 5xx, and answers as documented.

Every route is fuzzed from ``/openapi.json`` (coverage and fuzzing phases) against
a real ``jitserve serve`` process, once without auth (two runtimes) and once as a
tenant of a server with API keys (one), checking that the server never answers a
server error (bad input is a 4xx, whatever its shape), that every status is one the
document lists for the route (``status_code_conformance``), and that every answer's
body fits the schema the document gives for its status
(``response_schema_conformance``: the error envelope, the typed JSON answers).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

_ST = Path(sys.executable).with_name("st")


def _fuzz(url: str, tmp_path: Path, *headers: str) -> subprocess.CompletedProcess[str]:
    args = [str(_ST), "run", f"{url}/openapi.json",
            "--checks", "not_a_server_error,response_schema_conformance,status_code_conformance",
            "--phases", "examples,coverage,fuzzing", "--max-examples", "25", "--workers", "1",
            "--seed", "20261123", "--request-timeout", "30"]
    for header in headers:
        args += ["--header", header]
    return subprocess.run(args, capture_output=True, text=True, timeout=500, cwd=tmp_path)


def test_no_server_errors(start_server: Callable[..., str], tmp_path: Path) -> None:
    # Two runtimes: placement then parses ids (a non-hex one was a 500 there, issue 40).
    done = _fuzz(start_server({"JITSERVE_RUNTIMES": "2"}), tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "passed" in done.stdout


def test_no_server_errors_with_auth(auth_server_url: str, auth_keys: tuple[str, ...],
                                    tmp_path: Path) -> None:
    done = _fuzz(auth_server_url, tmp_path, f"Authorization: Bearer {auth_keys[0]}")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "passed" in done.stdout
