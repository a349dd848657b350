"""A real browser renders ``/docs`` of a real server with no network beyond it.

Headless Chromium (Debian's ``chromium``) resolves no host but 127.0.0.1
(``--host-resolver-rules``), so a page that reached for a CDN would render no
operations. The rendered DOM must list every route of ``/openapi.json``; the
screenshot is kept under ``$JITSERVE_TEST_ARTIFACTS`` (else the test's tmp dir)
and its path printed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from e2e.conftest import CHROMIUM, chromium

pytestmark = pytest.mark.timeout(180)

_OPERATION = re.compile(r'opblock-summary-method">(\w+)</span>.*?data-path="([^"]+)"', re.S)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")
def test_swagger_ui_renders_every_route_offline(server_url: str, tmp_path: Path) -> None:
    spec = httpx.get(f"{server_url}/openapi.json", timeout=30).json()
    served = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    dom = chromium(tmp_path, "--dump-dom", f"{server_url}/docs").stdout
    rendered = set(_OPERATION.findall(dom))
    assert served - rendered == set(), "routes the page did not render"
    assert rendered - served == set()
    artifacts = Path(os.environ.get("JITSERVE_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "docs-swagger-ui.png"
    chromium(tmp_path, f"--screenshot={screenshot}", f"{server_url}/docs")
    assert screenshot.stat().st_size > 10_000
    print(f"screenshot of /docs: {screenshot}")
