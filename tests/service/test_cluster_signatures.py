"""Replica ids in future ids, and the signatures of forwarded requests (service/cluster/signing.py).

The replicas themselves, with Redis and haproxy, are in tests/e2e/test_replicas_e2e.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from jitserve.compiler import RedisSettings
from jitserve.service.cluster import Cluster, replica_of
from jitserve.service.errors import Unauthorized
from jitserve.service.metrics import Metrics


def _cluster(secret: bytes) -> Cluster:
    async def make() -> Cluster:  # its events belong to a loop
        return Cluster(RedisSettings.from_url("redis://127.0.0.1:1/0"), peer_url="http://p:1",
                       secret=secret, heartbeat_s=1.0, future_ttl_s=60.0, metrics=Metrics(),
                       document=lambda fut: {}, live=list)

    return asyncio.run(make())


def test_replica_of_reads_the_prefix_of_a_future_id() -> None:
    assert replica_of("0123456789.abcDEF-_x") == "0123456789"
    for not_one in ("abcDEF-_x", "012345678.x", "0123456789x.y", "ABCDEF0123.x", ".x", ""):
        assert replica_of(not_one) is None


def test_a_signature_binds_method_path_and_owner() -> None:
    a, b = _cluster(b"k" * 32), _cluster(b"k" * 32)
    sig = a.signing.sign("GET", "/v1/futures/x", "owner1")
    b.signing.check(sig, "GET", "/v1/futures/x", "owner1")  # the same secret: accepted
    for method, path, owner in (("DELETE", "/v1/futures/x", "owner1"),
                                ("GET", "/v1/futures/y", "owner1"),
                                ("GET", "/v1/futures/x", "owner2"),
                                ("GET", "/v1/futures/x", None)):
        with pytest.raises(Unauthorized):
            b.signing.check(sig, method, path, owner)


def test_other_secrets_stale_and_garbage_signatures_are_refused() -> None:
    a, other = _cluster(b"k" * 32), _cluster(b"z" * 32)
    with pytest.raises(Unauthorized):
        a.signing.check(other.signing.sign("GET", "/p", None), "GET", "/p", None)
    rid, _, rest = a.signing.sign("GET", "/p", None).partition(".")
    _, _, mac = rest.rpartition(".")
    with pytest.raises(Unauthorized):
        a.signing.check(f"{rid}.{time.time() - 3600:.3f}.{mac}", "GET", "/p", None)
    for garbage in ("", "x", "a.b.c", f"{rid}.nan.{mac}", f"{rid}.inf.{mac}"):
        with pytest.raises(Unauthorized):
            a.signing.check(garbage, "GET", "/p", None)


def test_signatures_are_reused_for_a_second_and_remembered_only_while_fresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _cluster(b"k" * 32), _cluster(b"k" * 32)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)
    sig = a.signing.sign("POST", "/v1/programs/p/execute", "o")
    assert a.signing.sign("POST", "/v1/programs/p/execute", "o") == sig  # within its second
    b.signing.check(sig, "POST", "/v1/programs/p/execute", "o")
    b.signing.check(sig, "POST", "/v1/programs/p/execute", "o")  # remembered
    monkeypatch.setattr(time, "time", lambda: now + 1.5)
    assert a.signing.sign("POST", "/v1/programs/p/execute", "o") != sig
    b.signing.check(sig, "POST", "/v1/programs/p/execute", "o")  # still fresh
    monkeypatch.setattr(time, "time", lambda: now + 61)
    with pytest.raises(Unauthorized):  # remembered, but stale now
        b.signing.check(sig, "POST", "/v1/programs/p/execute", "o")
