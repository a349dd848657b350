"""Tenants against real ``jitserve serve`` processes with two API keys.

Each key sees only its own programs and executables (the other's are 404, worded
as an unknown id); each quota is reached by one key while the other's calls still
succeed; one key's slow compiles do not hold up the other's first call.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from collections.abc import Callable
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jitserve import wire

pytestmark = pytest.mark.timeout(300)

X = np.arange(6, dtype=np.float32).reshape(2, 3)
UNKNOWN = "0" * 64


def _export(fn: Callable[..., Any], shape: tuple[int, ...] = (2, 3)) -> bytes:
    spec = jax.ShapeDtypeStruct(shape, np.float32)
    return bytes(export.export(jax.jit(fn))(spec).serialize())


@functools.cache
def _scale(k: float) -> bytes:
    """x * k on float32[2, 3]: one program per ``k``, 24 bytes out.

    Cached: an export's bytes carry source locations of the tracing call stack, so
    a fresh export from elsewhere could differ.
    """
    return _export(lambda x: x * np.float32(k))


def _slow(k: float, steps: int) -> bytes:
    """An unrolled chain of ``steps`` matmuls on float32[8, 8]: seconds to compile.

    Measured on 2 CPU cores: 200 steps compile in about 5 s, 300 in 7 s, 500 in 21 s.
    """
    def chain(x: jax.Array) -> jax.Array:
        for i in range(steps):
            x = jnp.sin(x) @ x + jnp.float32(k + i)
        return x
    return _export(chain, (8, 8))


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class Caller:
    """One API key's view of a server."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=120, headers=_bearer(key))

    def upload(self, data: bytes) -> httpx.Response:
        return self.http.post("/v1/programs", content=data,
                              headers={"content-type": "application/octet-stream"})

    def pid(self, data: bytes) -> str:
        r = self.upload(data)
        assert r.status_code in (200, 201), r.text
        return str(r.json()["program_id"])

    def execute(self, pid: str, args: list[Any] | None = None,
                wait: int | None = 60_000) -> httpx.Response:
        params = {} if wait is None else {"wait": wait}
        return self.http.post(f"/v1/programs/{pid}/execute", params=params,
                              content=wire.packb({"args": [X] if args is None else args}),
                              headers={"content-type": wire.MSGPACK})

    def compile(self, pid: str) -> httpx.Response:
        return self.http.post(f"/v1/programs/{pid}/compile", json={})

    def executables(self) -> set[str]:
        ids: set[str] = set()
        cursor = None
        while True:
            params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
            page = self.http.get("/v1/executables", params=params).json()
            ids |= {e["executable_id"] for e in page["executables"]}
            if (cursor := page["next_cursor"]) is None:
                return ids


@pytest.fixture
def callers(auth_server_url: str, auth_keys: tuple[str, ...]) -> Any:
    alice, bob = Caller(auth_server_url, auth_keys[0]), Caller(auth_server_url, auth_keys[1])
    yield alice, bob
    alice.http.close()
    bob.http.close()


def _same_404(r: httpx.Response, unknown: httpx.Response, real_id: str, fake_id: str) -> None:
    """``r`` reads exactly like the answer for an id nobody has (no oracle)."""
    assert r.status_code == unknown.status_code == 404, (r.text, unknown.text)
    mine, other = r.json()["error"], unknown.json()["error"]
    assert mine["code"] == other["code"] == "not_found"
    assert mine["message"].replace(real_id, "ID") == other["message"].replace(fake_id, "ID")


# -- scoping ---------------------------------------------------------------------------------


def test_uploads_answer_201_per_key(callers: Any) -> None:
    alice, bob = callers
    data = _scale(11.5)
    assert alice.upload(data).status_code == 201
    assert alice.upload(data).status_code == 200  # her re-upload
    assert bob.upload(data).status_code == 201  # his first, though the bytes are stored
    assert bob.upload(data).status_code == 200


def test_another_keys_program_is_not_found(callers: Any) -> None:
    alice, bob = callers
    pid = alice.pid(_scale(12.5))
    assert alice.execute(pid).status_code == 200
    body = {"args": [X]}
    for method, path, kw in [
        ("GET", "/v1/programs/{}", {}),
        ("POST", "/v1/programs/{}/compile", {"json": {}}),
        ("POST", "/v1/programs/{}/execute", {"content": wire.packb(body),
                                             "headers": {"content-type": wire.MSGPACK}}),
        ("DELETE", "/v1/programs/{}", {}),
    ]:
        r = bob.http.request(method, path.format(pid), **kw)
        _same_404(r, bob.http.request(method, path.format(UNKNOWN), **kw), pid, UNKNOWN)
    assert alice.http.get(f"/v1/programs/{pid}").status_code == 200  # still hers


def test_executables_are_listed_and_read_per_key(callers: Any) -> None:
    alice, bob = callers
    hers = alice.compile(alice.pid(_scale(13.5))).json()["executable_id"]
    shared = _scale(14.5)
    his = bob.compile(bob.pid(shared)).json()["executable_id"]
    assert alice.http.get(f"/v1/executables/{hers}").status_code == 200
    _same_404(bob.http.get(f"/v1/executables/{hers}"),
              bob.http.get(f"/v1/executables/{UNKNOWN}"), hers, UNKNOWN)
    assert hers in alice.executables() and his not in alice.executables()
    assert his in bob.executables() and hers not in bob.executables()
    # The same bytes uploaded by Alice too: she compiles an executable of her own
    # (keys share none by default), and his stays out of her sight.
    r = alice.compile(alice.pid(shared)).json()
    assert r["executable_id"] != his and r["tier"] == "compiled"
    assert r["executable_id"] in alice.executables() and his not in alice.executables()


SECRET = "B-customer-acme-token-9f31"


@functools.cache
def _poly() -> bytes:
    """sin(x) * 2 on float32[n], n symbolic: one program, any length."""
    spec = jax.ShapeDtypeStruct(export.symbolic_shape("n"), np.float32)
    return bytes(export.export(jax.jit(lambda x: jnp.sin(x) * 2))(spec).serialize())


def _compile(c: Caller, pid: str, n: int, static_key: str = "") -> dict[str, Any]:
    r = c.http.post(f"/v1/programs/{pid}/compile", json={
        "in_avals": [{"shape": [n], "dtype": "float32"}], "static_key": static_key})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_key_probing_anothers_signatures_learns_nothing(callers: Any) -> None:
    """Issue 40's reproduction: Bob compiles a public program at float32[8] with a
    secret static key; Alice, with the same bytes, sees neither his shapes nor his
    key in her recompile reasons, and compiling exactly his signature is a compile
    of her own (tier, id, times, record), not a hit that confirms her guess."""
    alice, bob = callers
    pid = bob.pid(_poly())
    his = _compile(bob, pid, 8, SECRET)
    assert his["tier"] == "compiled"
    assert alice.pid(_poly()) == pid
    first = _compile(alice, pid, 16)
    assert first["tier"] == "compiled" and first["recompiled_because"] is None, first
    before = time.time()
    guess = _compile(alice, pid, 8, SECRET)
    assert guess["tier"] == "compiled" and guess["executable_id"] != his["executable_id"]
    # Her reasons compare with her own earlier compile only.
    assert guess["recompiled_because"] == [
        "shape: arg 0 float32[16] -> float32[8]", f"static: static '' -> '{SECRET}'"]
    record = alice.http.get(f"/v1/executables/{guess['executable_id']}").json()
    assert record["created"] >= before - 1 and record["recompiled_because"] == guess[
        "recompiled_because"]
    assert his["executable_id"] not in alice.executables()
    # Bob's own view is unchanged by hers: his next compile compares with his keys.
    again = _compile(bob, pid, 32, SECRET)
    assert again["recompiled_because"] == ["shape: arg 0 float32[8] -> float32[32]"]


def test_keys_may_share_executables_when_the_operator_says_so(
        start_server: Callable[..., str], auth_keys: tuple[str, ...]) -> None:
    url = start_server({"JITSERVE_API_KEYS": ",".join(auth_keys[:2]),
                        "JITSERVE_TENANT_SHARE_EXECUTABLES": "true"})
    alice, bob = Caller(url, auth_keys[0]), Caller(url, auth_keys[1])
    try:
        pid = bob.pid(_poly())
        his = _compile(bob, pid, 8, SECRET)
        mine = _compile(alice, alice.pid(_poly()), 8, SECRET)
        assert mine["executable_id"] == his["executable_id"] and mine["tier"] == "memory"
    finally:
        alice.http.close()
        bob.http.close()


def test_delete_takes_the_program_from_one_key_only(callers: Any) -> None:
    alice, bob = callers
    data = _scale(15.5)
    pid, _ = alice.pid(data), bob.pid(data)
    assert alice.execute(pid).status_code == 200
    exe_id = alice.compile(pid).json()["executable_id"]
    assert exe_id in alice.executables()
    r = alice.http.delete(f"/v1/programs/{pid}")
    assert r.status_code == 200 and r.json() == {"program_id": pid, "status": "deleted"}
    assert alice.http.get(f"/v1/programs/{pid}").status_code == 404
    assert alice.execute(pid).status_code == 404
    assert alice.http.delete(f"/v1/programs/{pid}").status_code == 404
    assert exe_id not in alice.executables()
    # Bob's copy is untouched; Alice's next upload is new to her again.
    assert bob.execute(pid).status_code == 200
    assert alice.upload(data).status_code == 201


# -- quotas --------------------------------------------------------------------------------------


def _refused(r: httpx.Response, quota: str) -> None:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "too_many_requests" and err["quota"] == quota
    assert int(r.headers["retry-after"]) >= 1


def _refused_later(caller: Caller, r: httpx.Response, quota: str) -> None:
    """An execute is accepted before its compile; the quota fails its future."""
    assert r.status_code == 202 and r.json()["status"] == "compiling", r.text
    doc = caller.http.get(f"/v1/futures/{r.json()['future_id']}", params={"wait": 30_000}).json()
    while doc["status"] == "compiling":
        doc = caller.http.get(f"/v1/futures/{doc['future_id']}", params={"wait": 30_000}).json()
    assert doc["status"] == "failed", doc
    assert doc["error"]["code"] == "too_many_requests" and doc["error"]["quota"] == quota


def _live_futures(alice: Caller, bob: Caller) -> None:
    # JITSERVE_MAX_LIVE_FUTURES=4 and two keys: each key's fair share is 2.
    data = _scale(21.5)
    pid = alice.pid(data)
    for _ in range(2):
        assert alice.execute(pid).status_code == 200  # done, but alive until deleted
    _refused(alice.execute(pid), "live_futures")
    pid = bob.pid(data)
    for _ in range(2):
        assert bob.execute(pid).status_code == 200


def _device_bytes(alice: Caller, bob: Caller) -> None:
    data = _scale(22.5)
    pid = alice.pid(data)
    # 24 B of outputs each once done; 24 B more of inputs while a call waits or runs.
    futures = [wire.unpackb(alice.execute(pid).content)["future_id"]
               for _ in range(2)]  # 48 of 80 B
    _refused(alice.execute(pid), "device_bytes")  # 48 + 48 > 80
    assert bob.execute(bob.pid(data)).status_code == 200
    alice.http.delete(f"/v1/futures/{futures[0]}")
    assert alice.execute(pid).status_code == 200


def _compiles_per_minute(alice: Caller, bob: Caller) -> None:
    pids = [alice.pid(_scale(k)) for k in (23.25, 23.5, 23.75)]
    for pid in pids[:2]:
        r = alice.compile(pid)
        assert r.status_code == 200 and r.json()["tier"] == "compiled", r.text
    _refused(alice.compile(pids[2]), "compiles_per_minute")
    assert alice.execute(pids[0]).status_code == 200  # a cache hit is no compile
    r = bob.compile(bob.pid(_scale(23.75)))
    assert r.status_code == 200 and r.json()["tier"] == "compiled"


def _executables(alice: Caller, bob: Caller) -> None:
    pids = [alice.pid(_scale(k)) for k in (24.25, 24.5, 24.75)]
    for pid in pids[:2]:
        assert alice.compile(pid).status_code == 200
    _refused(alice.compile(pids[2]), "executables")
    _refused_later(alice, alice.execute(pids[2], wait=None), "executables")
    assert bob.compile(bob.pid(_scale(24.75))).status_code == 200
    assert alice.http.delete(f"/v1/programs/{pids[0]}").status_code == 200
    assert alice.execute(pids[2]).status_code == 200  # the deleted program's executable went


def _program_bytes(alice: Caller, bob: Caller) -> None:
    first, second = _scale(25.25), _scale(25.5)
    assert alice.upload(first).status_code == 201
    _refused(alice.upload(second), "program_bytes")
    assert alice.upload(first).status_code == 200  # a re-upload takes no room
    assert bob.upload(second).status_code == 201
    alice.http.delete(f"/v1/programs/{alice.pid(first)}")
    assert alice.upload(second).status_code == 201


def _program_bytes_env() -> dict[str, str]:
    sizes = sorted(len(_scale(k)) for k in (25.25, 25.5))
    return {"JITSERVE_TENANT_MAX_PROGRAM_BYTES": str(sizes[0] + sizes[1] - 1)}


QUOTAS: dict[str, tuple[Callable[[], dict[str, str]], Callable[[Caller, Caller], None]]] = {
    "live_futures": (lambda: {"JITSERVE_MAX_LIVE_FUTURES": "4"}, _live_futures),
    "device_bytes": (lambda: {"JITSERVE_TENANT_MAX_DEVICE_BYTES": "80"}, _device_bytes),
    "compiles_per_minute": (lambda: {"JITSERVE_TENANT_COMPILES_PER_MINUTE": "2"},
                            _compiles_per_minute),
    "executables": (lambda: {"JITSERVE_TENANT_MAX_EXECUTABLES": "2"}, _executables),
    "program_bytes": (_program_bytes_env, _program_bytes),
}


@pytest.mark.parametrize("quota", list(QUOTAS))
def test_a_quota_stops_one_key_only(start_server: Callable[..., str],
                                    auth_keys: tuple[str, ...], quota: str) -> None:
    env, scenario = QUOTAS[quota]
    url = start_server({"JITSERVE_API_KEYS": ",".join(auth_keys), **env()}, quota)
    alice, bob = Caller(url, auth_keys[0]), Caller(url, auth_keys[1])
    try:
        scenario(alice, bob)
    finally:
        alice.http.close()
        bob.http.close()


# -- fair compiles ------------------------------------------------------------------------------


@pytest.mark.slow
def test_slow_compiles_of_one_key_do_not_hold_up_anothers_first_call(
        start_server: Callable[..., str], auth_keys: tuple[str, ...]) -> None:
    # Two compile workers (the default): each key may hold one of them.
    url = start_server({"JITSERVE_API_KEYS": ",".join(auth_keys)}, "fair")
    alice, bob = Caller(url, auth_keys[0]), Caller(url, auth_keys[1])
    slow = [alice.pid(_slow(k, 300)) for k in (0.5, 1.5)]
    small = bob.pid(_scale(31.5))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        compiling = [pool.submit(alice.compile, pid) for pid in slow]
        time.sleep(1.0)  # let Alice's requests reach the server first
        r = bob.execute(small)
        # Bob's first call (a compile, then a run) is done while neither of Alice's
        # compiles is: without fair turns it would queue behind both.
        unfinished = [not c.done() for c in compiling]
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], X * np.float32(31.5))
        assert all(unfinished), "Alice's compile finished before Bob's first call"
        for c in compiling:
            done = c.result(timeout=240)
            assert done.status_code == 200 and done.json()["tier"] == "compiled", done.text
    alice.http.close()
    bob.http.close()
