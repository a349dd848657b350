"""The console (issue 39) in a real browser, against a real ``jitserve serve``.

One server for the module, with three API keys (one of them admin) and the IFRT proxy
on, runs a small workload first: a program compiled at two shapes (a recompile, with
its reason), a program XLA refuses (a compile error), an endless loop under a one
second deadline (its runtime killed and restarted), a second key past its live-futures
quota, and an IFRT session holding an array. Then headless Chromium (Debian's
``chromium``, as in ``test_docs_browser``), resolving no host but 127.0.0.1, renders
``/console`` with the admin key and with another key: each panel shows what its JSON
route gives, and the other key sees only its own. The admin view's screenshot is
kept under ``$JITSERVE_TEST_ARTIFACTS`` (else the test's tmp dir) as ``console.png``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import CHROMIUM, _free_port, _serve, chromium, wait_ready
from e2e.test_ifrt_e2e import Session
from jax import export, lax

from jitserve import wire
from jitserve.service.api.auth import owner_of

pytestmark = pytest.mark.timeout(300)

ALICE, BOB, ADMIN = ("console-alice-key-0123456789", "console-bob-key-0123456789",
                     "console-admin-key-0123456789")
LIVE_FUTURES = 3  # each key's quota: Bob's fourth kept future is refused
RECOMPILED = "shape: arg 0 float32[8] -> float32[16]"
FAILS_TO_COMPILE = b"""
func.func public @main(%arg0: tensor<4xi32>) -> tensor<4xi32> {
  %0 = stablehlo.custom_call @AllocateBuffer(%arg0) : (tensor<4xi32>) -> tensor<4xi32>
  return %0 : tensor<4xi32>
}
"""


def _export(fn: Any, spec: Any) -> bytes:
    return bytes(export.export(jax.jit(fn))(spec).serialize())


class Caller:
    """One key's calls, over REST."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=120,
                                 headers={"authorization": f"Bearer {key}"})

    def upload(self, program: bytes, **params: str) -> str:
        r = self.http.post("/v1/programs", content=program, params=params,
                           headers={"content-type": wire.OCTET_STREAM})
        assert r.status_code in (200, 201), r.text
        return str(r.json()["program_id"])

    def execute(self, pid: str, x: np.ndarray, wait: int = 0, keep: bool = True,
                **extra: Any) -> httpx.Response:
        return self.http.post(f"/v1/programs/{pid}/execute",
                              params={"wait": wait, "keep": str(keep).lower()},
                              content=wire.packb({"args": [x], **extra}),
                              headers={"content-type": wire.MSGPACK})

    def final(self, fid: str) -> dict[str, Any]:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            view = self.http.get(f"/v1/futures/{fid}", params={"wait": 2000}).json()
            if view["status"] in ("done", "failed", "cancelled"):
                return dict(view)
        pytest.fail(f"future {fid} did not end: {view}")

    def console(self, panel: str, **params: Any) -> dict[str, Any]:
        r = self.http.get(f"/v1/console/{panel}", params=params)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def close(self) -> None:
        self.http.close()


def _workload(url: str, ifrt_target: str) -> tuple[dict[str, str], Session]:
    """The calls the console then shows: the ids of what they made, and Bob's IFRT
    session (opened once the deadline's restart is over, holding an array)."""
    alice, bob = Caller(url, ALICE), Caller(url, BOB)
    (b,) = export.symbolic_shape("b")
    cosine = alice.upload(_export(lambda x: jnp.cos(x) * 3, jax.ShapeDtypeStruct((b,), np.float32)))
    for n in (8, 16, 8, 8):  # compiled at 8, recompiled at 16, then from memory
        assert alice.execute(cosine, np.ones(n, np.float32), wait=60_000,
                             keep=False).status_code == 200
    broken = alice.upload(FAILS_TO_COMPILE, format="stablehlo")
    failed = alice.final(alice.execute(broken, np.arange(4, dtype=np.int32)).json()["future_id"])
    assert failed["error"]["code"] == "compile_failed", failed
    # Counts up until adding one no longer changes the float (2**24), then spins forever.
    endless = alice.upload(_export(lambda x: lax.while_loop(lambda c: c > -1.0, lambda c: c + 1.0, x),
                                   jax.ShapeDtypeStruct((), np.float32)))
    stopped = alice.final(alice.execute(endless, np.float32(0), timeout_s=1).json()["future_id"])
    assert stopped["error"]["code"] == "execution_timeout", stopped
    for fid in (failed["future_id"], stopped["future_id"]):
        alice.http.delete(f"/v1/futures/{fid}")
    wait_ready(url)  # the runtime the deadline stopped is back
    # Bob's IFRT session holds an array, which counts with his futures: two more fit.
    session = Session(ifrt_target, BOB)
    _hold_an_array(session)
    scale = bob.upload(_export(lambda x: x * 2, jax.ShapeDtypeStruct((4,), np.float32)))
    for _ in range(LIVE_FUTURES - 1):
        assert bob.execute(scale, np.ones(4, np.float32), wait=60_000).status_code == 200
    refused = bob.execute(scale, np.ones(4, np.float32))
    assert refused.status_code == 429 and refused.json()["error"]["quota"] == "live_futures"
    alice.close()
    bob.close()
    return {"cosine": cosine, "broken": broken, "endless": endless, "scale": scale}, session


def _hold_an_array(session: Session) -> None:
    """Bob's IFRT session keeps 4 float32 on the device (16 bytes)."""
    values = np.arange(4, dtype=np.float32)
    session.store(11, values.tobytes())
    assert session.make_array(5, 11, values).response_metadata.status.code == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The server, after the workload (its IFRT session still open)."""
    port = _free_port()
    env = {"JITSERVE_API_KEYS": f"{ALICE},{BOB},{ADMIN}", "JITSERVE_ADMIN_KEYS": ADMIN,
           "JITSERVE_IFRT_PORT": str(port),
           "JITSERVE_TENANT_MAX_LIVE_FUTURES": str(LIVE_FUTURES)}
    for url in _serve(tmp_path_factory.mktemp("console"), env):
        wait_ready(url)
        ids, session = _workload(url, f"127.0.0.1:{port}")
        try:
            yield {"url": url, "ids": ids}
        finally:
            session.close()


# -- the page as a browser renders it ------------------------------------------------------

class Tables(HTMLParser):
    """The rows of each table of a page: ``{table id: [(row attrs, {cell class: text})]}``,
    and the ``data-total`` values of the work panel."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tables: dict[str, list[tuple[dict[str, str], dict[str, str]]]] = {}
        self.totals: dict[str, str] = {}
        self._table: str | None = None
        self._cell: tuple[str, list[str]] | None = None
        self._total: tuple[str, list[str]] | None = None
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "table":
            self._table = a.get("id", "")
            self.tables[self._table] = []
        elif tag == "tr" and self._table and "empty" not in a.get("class", ""):
            self.tables[self._table].append((a, {}))
        elif tag == "td" and self._table and self.tables[self._table]:
            self._cell = (a.get("class", ""), [])
            self.tables[self._table][-1][1]["title:" + a.get("class", "")] = a.get("title", "")
        elif tag == "dd" and "data-total" in a:
            self._total = (a["data-total"], [])

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._table:
            self.tables[self._table][-1][1][self._cell[0]] = "".join(self._cell[1]).strip()
            self._cell = None
        elif tag == "dd" and self._total is not None:
            self.totals[self._total[0]] = "".join(self._total[1])
            self._total = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        for open_ in (self._cell, self._total):
            if open_ is not None:
                open_[1].append(data)

    def rows(self, table: str) -> list[tuple[dict[str, str], dict[str, str]]]:
        return [(a, cells) for a, cells in self.tables[table] if "data-" in " ".join(a)]


_PAGE: dict[str, Any] = {"budget_ms": 6000, "window": "1440,1560"}  # the page, whole


def _render(tmp_path: Path, url: str, key: str) -> Tables:
    """The console's DOM once its script has run, as ``key`` sees it."""
    dom = chromium(tmp_path, "--dump-dom", f"{url}/console#key={key}", **_PAGE).stdout
    page = Tables(dom)
    assert page.tables.get("compiles-table") is not None, dom[:2000]
    return page


needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="no chromium on PATH (apt-get install chromium)")


@needs_chromium
def test_the_admin_sees_every_panel_as_its_json_says(server: dict[str, Any],
                                                     tmp_path: Path) -> None:
    url, ids = server["url"], server["ids"]
    page = _render(tmp_path, url, ADMIN)
    admin = Caller(url, ADMIN)
    devices, compiles = admin.console("devices"), admin.console("compiles", seconds=600)
    work, sessions = admin.console("work", seconds=300), admin.console("sessions")
    admin.close()
    assert devices["viewer"]["admin"] and "admin" in "".join(page.text)

    # Devices and runtimes: one row each; the deadline's restart and its reason.
    assert [a["data-device"] for a, _ in page.rows("devices-table")] == [
        str(d["id"]) for d in devices["devices"]]
    runtimes = {a["data-runtime"]: cells for a, cells in page.rows("runtimes-table")}
    for runtime in devices["runtimes"]:
        cells = runtimes[str(runtime["index"])]
        assert cells["c-restarts"] == str(runtime["restarts"])
        assert cells["c-state"] == runtime["state"] == "up"
        assert runtime["last_exit"] in cells["c-last-exit"]
    assert sum(r["restarts"] for r in devices["runtimes"]) >= 1
    assert any("passed its deadline" in cells["c-last-exit"] for cells in runtimes.values())
    holders = {a["data-key"] for a, _ in page.rows("holders-table")}
    assert holders == {h["key"] for h in devices["holders"]} and owner_of(BOB)[:12] in holders

    # Compiles: the recompile and its reason, the refused compile, the tiers.
    rows = page.rows("compiles-table")
    assert [a["data-executable"] for a, _ in rows] == [c["executable_id"]
                                                       for c in compiles["recent"]]
    recompiled = [cells for a, cells in rows if a["data-program"] == ids["cosine"]
                  and a["data-tier"] == "compiled"]
    assert len(recompiled) == 2 and any(RECOMPILED in c["c-because"] for c in recompiled)
    failed = [cells for a, cells in rows if a["data-tier"] == "failed"]
    assert failed and failed[0]["c-error"].startswith("compile_failed: ")
    assert page.rows("recompiled-table")[0][1]["c-because"] == RECOMPILED
    assert page.rows("recompiled-table")[0][0]["data-program"] == ids["cosine"]
    assert {a["data-program"] for a, _ in page.rows("slowest-table")} == {
        c["program_id"] for c in compiles["slowest"]}

    # Work: errors by code and quota refusals by key, as the JSON totals say.
    totals = work["totals"]
    assert {"compile_failed", "execution_timeout", "too_many_requests"} <= set(totals["errors"])
    shown = {a["data-code"]: cells["c-count"] for a, cells in page.rows("errors-table")}
    assert shown == {code: str(n) for code, n in totals["errors"].items()}
    assert [(a["data-key"], a["data-quota"], cells["c-count"])
            for a, cells in page.rows("quota-table")] == [
        (q["key"], q["quota"], str(q["count"])) for q in totals["quota_refusals"]]
    assert totals["quota_refusals"][0]["key"] == owner_of(BOB)[:12]
    assert int(page.totals["calls"]) >= 8 and page.totals["calls"] == str(totals["calls"])

    # Sessions: Bob's, with the device bytes its array holds.
    (session,) = sessions["sessions"]
    assert session["key"] == owner_of(BOB)[:12] and session["device_bytes"] == 16
    ((attrs, cells),) = page.rows("sessions-table")
    assert attrs["data-session"] == session["session"]
    assert cells["title:c-device-bytes"] == "16" and cells["c-key"] == session["key"]


@needs_chromium
def test_another_key_sees_only_its_own(server: dict[str, Any], tmp_path: Path) -> None:
    url, ids = server["url"], server["ids"]
    page = _render(tmp_path, url, ALICE)
    mine = {ids["cosine"], ids["broken"], ids["endless"]}
    shown = {a["data-program"] for a, _ in page.rows("compiles-table")}
    assert ids["cosine"] in shown and shown <= mine
    assert page.rows("sessions-table") == []  # Bob's session is not hers
    assert page.rows("quota-table") == []  # nor Bob's refusals
    assert {a["data-key"] for a, _ in page.rows("holders-table")} <= {owner_of(ALICE)[:12]}
    assert "only this key's" in "".join(page.text)
    bob = Caller(url, BOB)
    try:
        assert {c["program_id"] for c in bob.console("compiles")["recent"]} == {ids["scale"]}
        assert "compile_failed" not in bob.console("work")["totals"]["errors"]
        assert bob.console("sessions")["sessions"][0]["key"] == owner_of(BOB)[:12]
    finally:
        bob.close()


@needs_chromium
def test_the_page_loads_nothing_from_outside_and_is_screenshotted(server: dict[str, Any],
                                                                 tmp_path: Path) -> None:
    url = server["url"]
    page = httpx.get(f"{url}/console", timeout=30)
    assert page.status_code == 200
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(a.startswith("/") and not a.startswith("//") for a in assets), assets
    for text in [page.text] + [httpx.get(url + a, timeout=30).text for a in assets
                               if a.endswith((".js", ".css"))]:
        assert not re.search(r"https?:|url\(\s*['\"]?//", text, re.I), \
            re.findall(r".{0,40}https?:.{0,40}", text)[:3]
    unauthorized = httpx.get(f"{url}/v1/console/work", timeout=30)
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "unauthorized"
    artifacts = Path(os.environ.get("JITSERVE_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "console.png"
    chromium(tmp_path, f"--screenshot={screenshot}", f"{url}/console#key={ADMIN}", **_PAGE)
    assert screenshot.stat().st_size > 20_000
    print(f"screenshot of /console: {screenshot}")
