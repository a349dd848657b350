"""A random walk through ``/v1``: nothing accepted is lost, and what is done is right.

One real ``jitserve serve`` (two runtimes, a 2 s run deadline) gets a long random
sequence of what clients do, in any order: arrays put, executes and batches of
calls (``POST /v1/calls``) on arrays, on outputs of earlier futures (some of them
released, donated, deleted or failed) and on outputs of earlier calls of the
batch, with donations and deadlines; results fetched, outputs released, futures
deleted. One program in fifty loops for minutes, so its deadline stops its runtime
under the calls placed there. A model on this side knows each output's value
wherever its inputs' values are known. The checks:

- no answer is a 5xx, and every 4xx says its ``code`` and ``message``;
- a call the model knows to be invalid (an unknown or released input, a wrong
  dtype or count) is refused, never accepted;
- a value the server gives back equals the model's, whether fetched at once, with
  the execute's own answer, or at the end;
- every future the client still holds ends, done or failed, within a bound; a
  failure's code says why (its runtime was stopped, its deadline, a dependency that
  failed or was cancelled); never ``runtime_crashed``, since no runtime crashes here,
  even when a future's outputs are found gone in the moment its runtime is being
  stopped.

Three fixed seeds of 600 steps each; two walks that also SIGKILL a runtime now and
then, whose futures may end ``runtime_crashed`` too; and two on a server whose futures
expire 2 s after they are made or end, where a held future may be found gone only
once that long has passed. ``Walk`` also runs through replicas, by two API keys at
once and with replicas killed under it (``test_replicas_e2e``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import _serve
from jax import export

from jitserve import wire

pytestmark = pytest.mark.timeout(300)

_F32 = jax.ShapeDtypeStruct((4,), jnp.float32)
# What a failed future may say: its runtime was stopped (for another run's deadline), its
# own deadline, or an input's fate. Never runtime_crashed: nothing here crashes a runtime.
_FAILURES = {"execution_timeout", "runtime_stopped", "dependency_failed", "future_failed",
             "future_cancelled"}
_STEPS = 600


def _exported(f: Callable[..., Any], n: int) -> bytes:
    return bytes(export.export(jax.jit(f))(*[_F32] * n).serialize())


# name -> (program bytes, inputs, outputs, the outputs' values from the inputs' or None)
_PROGRAMS: dict[str, tuple[bytes, int, int, Callable[..., list[np.ndarray]] | None]] = {}


def upload_programs(http: httpx.Client, slow: bool = True) -> dict[str, str]:
    """The walk's programs uploaded through ``http``: their ids by name (``slow``: with
    the one that loops for minutes, for a server with a short run deadline)."""
    if not _PROGRAMS:
        _PROGRAMS.update({
            "pair": (_exported(lambda x, y: (x + y, x * y), 2), 2, 2, lambda x, y: [x + y, x * y]),
            "double": (_exported(lambda x: x * 2.0, 1), 1, 1, lambda x: [x * 2.0]),
            "slow": (_exported(lambda x: jax.lax.fori_loop(
                0, 1 << 30, lambda i, v: v * 1.0000001 + 1e-9, x), 1), 1, 1, None),
        })
    ids = {}
    for name, (data, *_) in _PROGRAMS.items():
        if name == "slow" and not slow:
            continue
        r = http.post("/v1/programs", content=data,
                      headers={"content-type": "application/octet-stream"})
        assert r.status_code in (200, 201), r.text
        ids[name] = r.json()["program_id"]
    return ids


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    env = {"JITSERVE_RUNTIMES": "2", "JITSERVE_EXECUTION_TIMEOUT_S": "2",
           "JITSERVE_MAX_BODY_BYTES": str(1 << 20)}
    for url in _serve(tmp_path_factory.mktemp("calls-fuzz"), env):
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http, upload_programs(http)


class Walk:
    """The client's side of the walk: the futures it holds and what it knows of them.

    ``others``: the walks of other API keys on the same servers (this one may be among
    them), whose futures this
    one names now and then, as a client guessing or leaking ids would: every such
    request is refused or touches nothing (``_foreign``), and the other walk's own
    checks find its futures as they were.
    """

    def __init__(self, http: httpx.Client, ids: dict[str, str], seed: int,
                 others: Sequence[Walk] = (), crash: bool = False) -> None:
        self.http, self.ids = http, ids
        self.rng = random.Random(seed)
        self.values = np.random.default_rng(seed)
        self.others = others
        self.crash = crash
        self.failures = _FAILURES | ({"runtime_crashed"} if crash else set())
        self.crashes = 0
        self.compared = 0  # results read and found right
        self.sent = 0.0  # when the last request went (monotonic)
        self.born: dict[str, float] = {}  # future id -> when the request that made it went
        # future id -> {"outs": [value or None], "released": set, "deleted": bool}
        self.futures: dict[str, dict[str, Any]] = {}

    # -- requests ---------------------------------------------------------------

    def post(self, path: str, body: Any, **params: Any) -> tuple[httpx.Response, Any]:
        self.sent = time.monotonic()
        r = self.http.post(path, content=wire.packb(body), params=params,
                           headers={"content-type": wire.MSGPACK, "accept": wire.MSGPACK})
        return self.checked(r), _body(r)

    def checked(self, r: httpx.Response) -> httpx.Response:
        assert r.status_code < 500, f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            error = (_body(r) or {}).get("error") or {}
            assert error.get("code") and error.get("message"), r.text[:300]
        return r

    # -- what the walk sends ------------------------------------------------------

    def array(self) -> np.ndarray:
        return self.values.standard_normal(4).astype(np.float32)

    def ref(self) -> tuple[dict[str, Any], np.ndarray | None, bool]:
        """A reference to an output the client may or may not still hold: the
        reference, the output's value (if known), and whether it is valid."""
        if not self.futures or self.rng.random() < 0.1:
            return {"future": self.rng.choice(["nope", "x" * 200]), "output": 0}, None, False
        foreign = self._foreign()
        if foreign is not None and self.rng.random() < 0.1:
            return {"future": foreign, "output": 0}, None, False
        fid = self.rng.choice(list(self.futures))
        f = self.futures[fid]
        k = self.rng.randrange(len(f["outs"]) + (self.rng.random() < 0.05))
        valid = not f["deleted"] and k < len(f["outs"]) and k not in f["released"]
        return {"future": fid, "output": k}, f["outs"][k] if valid else None, valid

    def call(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """One call: an execute's body, and what the model expects of it."""
        names = ["pair", "pair", "double", "double"] + ["slow"] * (
            "slow" in self.ids and self.rng.random() < 0.02)
        name = self.rng.choice(names)
        _, n_in, n_out, fn = _PROGRAMS[name]
        args: list[Any] = []
        values: list[np.ndarray | None] = []
        refs: list[Any] = []
        valid = True
        for _ in range(n_in + (self.rng.random() < 0.03)):
            roll = self.rng.random()
            if batch and roll < 0.3:  # an output of an earlier call of the batch
                j = self.rng.randrange(len(batch))
                k = self.rng.randrange(batch[j]["n_out"] + (self.rng.random() < 0.05))
                args.append({"call": j, "output": k})
                refs.append(("call", j, k))
                expected = batch[j]["expect"]
                values.append(expected[k] if expected is not None and k < batch[j]["n_out"] else None)
                valid = valid and k < batch[j]["n_out"] and batch[j]["valid"]
            elif roll < 0.6:
                a, value, ok = self.ref()
                args.append(a)
                refs.append(("future", a))
                values.append(value)
                valid = valid and ok
            else:
                x = self.array() if self.rng.random() > 0.03 else np.zeros(3, np.int32)
                args.append(x)
                refs.append(None)
                values.append(x)
                valid = valid and x.dtype == np.float32 and x.shape == (4,)
        valid = valid and len(args) == n_in
        donate = (sorted(self.rng.sample(range(len(args)), self.rng.randint(1, len(args))))
                  if self.rng.random() < 0.4 else [])
        body: dict[str, Any] = {"program_id": self.ids[name], "args": args}
        if donate:
            body["donate"] = donate
        if self.rng.random() < 0.2:
            body["timeout_s"] = self.rng.choice([0.5, 5.0])
        known = valid and fn is not None and all(v is not None for v in values)
        return {"body": body, "refs": refs, "donate": donate, "n_out": n_out, "valid": valid,
                "expect": fn(*values) if known else None}

    def accepted(self, fid: str, call: dict[str, Any], batch: list[str | None]) -> None:
        """Call ``call`` became future ``fid``; what it donated is released (``batch``:
        the futures of the calls of its batch before it, ``None`` where refused)."""
        self.futures[fid] = {"outs": call["expect"] or [None] * call["n_out"],
                             "released": set(), "deleted": False}
        self.born[fid] = self.sent
        for i in call["donate"]:
            ref = call["refs"][i]
            if ref is not None and ref[0] == "future" and ref[1]["future"] in self.futures:
                self.futures[ref[1]["future"]]["released"].add(ref[1]["output"])
            elif ref is not None and ref[0] == "call" and batch[ref[1]] is not None:
                self.futures[batch[ref[1]]]["released"].add(ref[2])

    def found_gone(self, fid: str, answer: str) -> None:
        """The server no longer knows ``fid``, which the walk holds: never, here."""
        raise AssertionError(f"held future {fid}: {answer[:300]}")

    def known(self, fid: str) -> bool:
        """Whether the server still knows ``fid``: not deleted, nor all its outputs let go."""
        f = self.futures[fid]
        return not f["deleted"] and len(f["released"]) < len(f["outs"])

    def _lookup_lost(self, error: dict[str, Any]) -> bool:
        """A call whose lookup (its compile, or the executable's load into a restarted
        runtime) lost its runtime twice: taken for the cause (``Runtime.request``),
        ``compile_failed`` naming the loss. Only where runtimes are killed."""
        return (self.crash and error.get("code") == "compile_failed"
                and "stopped its runtime" in error.get("message", ""))

    def _foreign(self) -> str | None:
        """A future id another key's walk holds, if there is one."""
        held = [fid for other in self.others if other is not self for fid in other.futures]
        return self.rng.choice(held) if held else None

    def compare(self, fid: str, outputs: list[Any], which: list[int]) -> None:
        self.compared += 1
        f = self.futures[fid]
        for k, got in zip(which, outputs):
            want = f["outs"][k]
            if want is not None and k not in f["released"]:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                           err_msg=f"future {fid} output {k}")

    # -- the steps ------------------------------------------------------------------

    def step(self) -> None:
        op = self.rng.choices(["put", "execute", "calls", "result", "release", "delete", "crash"],
                              [1, 4, 3, 3, 1, 1, 0.3 if self.crash else 0])[0]
        getattr(self, f"_{op}")()

    def _crash(self) -> None:
        """SIGKILL a runtime that is up, as the kernel's OOM killer would."""
        # While one restarts, /readyz answers 503 and lists them in its error.
        ready = self.http.get("/readyz").json()
        runtimes = ready.get("runtimes") or ready.get("error", {}).get("runtimes", ())
        up = [r for r in runtimes if r.get("state") == "up" and r.get("pid")]
        if up:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.rng.choice(up)["pid"], signal.SIGKILL)
            self.crashes += 1

    def _put(self) -> None:
        xs = [self.array() for _ in range(self.rng.randint(1, 2))]
        r, body = self.post("/v1/arrays", {"arrays": xs})
        assert r.status_code == 201, r.text
        self.futures[body["future_id"]] = {"outs": xs, "released": set(), "deleted": False}
        self.born[body["future_id"]] = self.sent

    def _execute(self) -> None:
        call = self.call([])
        params: dict[str, Any] = {}
        if self.rng.random() < 0.5:
            params["wait"] = self.rng.choice([0, 50, 2000])
        body = {k: v for k, v in call["body"].items() if k != "program_id"}
        r, answer = self.post(f"/v1/programs/{call['body']['program_id']}/execute", body, **params)
        if r.status_code >= 400:
            return
        assert call["valid"], f"an invalid call was accepted: {call['refs']}"
        self.accepted(answer["future_id"], call, [])
        if r.status_code == 200:
            self.compare(answer["future_id"], answer["outputs"], list(range(call["n_out"])))

    def _calls(self) -> None:
        batch: list[dict[str, Any]] = []
        for _ in range(self.rng.randint(1, 4)):
            batch.append(self.call(batch))
        body: dict[str, Any] = {"calls": [c["body"] for c in batch]}
        release = None
        if self.futures and self.rng.random() < 0.3:
            release = {"future": self.rng.choice(list(self.futures)), "output": 0}
            body["release"] = [release]
            read = any(isinstance(a, dict) and a == release for c in batch for a in c["body"]["args"])
        r, answer = self.post("/v1/calls", body)
        assert r.status_code == 200, r.text
        made: list[str | None] = []
        for j, (call, entry) in enumerate(zip(batch, answer["calls"])):
            on_refused = any(ref is not None and ref[0] == "call" and made[ref[1]] is None
                             for ref in call["refs"])
            if "future_id" in entry:
                assert call["valid"] and not on_refused, f"call {j} accepted: {call['refs']}"
                self.accepted(entry["future_id"], call, made)
                made.append(entry["future_id"])
            else:
                assert entry["error"]["code"] and entry["error"]["message"], entry
                made.append(None)
        if release is not None:  # released wherever the batch ran (the calls read it first)
            # after the batch's calls started: what they donated is let go first, and a
            # future whose every output is let go is gone
            known = self.known(release["future"])
            gone = known and not read and not answer["released"]
            if gone:
                self.found_gone(release["future"], str(answer))
            assert read or gone or answer["released"] == known, (release, answer)
            self.futures[release["future"]]["released"].add(0)

    def _result(self) -> None:
        if not self.futures:
            return
        fid = self.rng.choice(list(self.futures))
        foreign = self._foreign() if self.rng.random() < 0.1 else None
        r = self.checked(self.http.get(f"/v1/futures/{foreign or fid}/result",
                                       headers={"accept": wire.MSGPACK},
                                       params={"wait": self.rng.choice([0, 100, 3000])}))
        if foreign is not None:
            assert r.status_code == 404, f"another key's future {foreign}: {r.status_code}"
            return
        f = self.futures[fid]  # asked for all its outputs: none let go, none may be gone
        if r.status_code == 404 and not (f["deleted"] or f["released"]):
            self.found_gone(fid, r.text)
        if r.status_code == 200:
            assert not self.futures[fid]["deleted"], f"deleted future {fid} answered"
            self.compare(fid, _body(r)["outputs"], list(range(len(self.futures[fid]["outs"]))))

    def _release(self) -> None:
        if not self.futures:
            return
        foreign = self._foreign() if self.rng.random() < 0.1 else None
        if foreign is not None:
            r, answer = self.post("/v1/futures/release", {"outputs": [{"future": foreign, "output": 0}]})
            assert r.status_code == 200 and answer["released"] == 0, (foreign, answer)
            return
        fid = self.rng.choice(list(self.futures))
        k = self.rng.randrange(2)
        known = self.known(fid)
        r, answer = self.post("/v1/futures/release", {"outputs": [{"future": fid, "output": k}]})
        assert r.status_code == 200, r.text
        want = known and k < len(self.futures[fid]["outs"])
        if want and not answer["released"]:
            self.found_gone(fid, str(answer))
        else:
            assert answer["released"] == want, (fid, k, answer)
        if k < len(self.futures[fid]["outs"]):
            self.futures[fid]["released"].add(k)

    def _delete(self) -> None:
        if not self.futures:
            return
        foreign = self._foreign() if self.rng.random() < 0.1 else None
        if foreign is not None:
            r = self.checked(self.http.delete(f"/v1/futures/{foreign}"))
            assert r.status_code == 404, f"another key's future {foreign}: {r.status_code}"
            return
        fid = self.rng.choice(list(self.futures))
        self.checked(self.http.delete(f"/v1/futures/{fid}"))
        self.futures[fid]["deleted"] = True

    # -- the end ------------------------------------------------------------------------

    def settle(self) -> collections.Counter[str]:
        """Wait for each future the client still holds to end; check how it ended."""
        ended: collections.Counter[str] = collections.Counter()
        for fid, f in self.futures.items():
            held = [k for k in range(len(f["outs"])) if k not in f["released"]]
            if f["deleted"] or not held:
                continue
            deadline = time.monotonic() + 120
            while True:
                r = self.checked(self.http.get(f"/v1/futures/{fid}", params={"wait": 5000}))
                if r.status_code == 404:
                    self.found_gone(fid, r.text)
                    break
                doc = r.json()
                if doc["status"] in ("done", "failed", "cancelled") or time.monotonic() > deadline:
                    break
            if r.status_code == 404:
                ended["expired"] += 1
                continue
            assert doc["status"] in ("done", "failed", "cancelled"), f"{fid} still {doc['status']}"
            if doc["status"] == "failed":
                assert doc["error"]["code"] in self.failures or self._lookup_lost(doc["error"]), \
                    doc["error"]
                ended[doc["error"]["code"]] += 1
                continue
            ended[doc["status"]] += 1
            if doc["status"] == "done":
                r = self.checked(self.http.get(
                    f"/v1/futures/{fid}/result", headers={"accept": wire.MSGPACK},
                    params={"outputs": ",".join(map(str, held))}))
                if r.status_code == 200:
                    self.compare(fid, _body(r)["outputs"], held)
                elif r.status_code == 404:
                    self.found_gone(fid, r.text)
                    ended["expired"] += 1
                else:  # done, then its runtime went: the answer says so
                    assert r.json()["error"]["cause"]["code"] in self.failures, r.text
        return ended


def _body(r: httpx.Response) -> Any:
    if not r.content:
        return None
    if r.headers.get("content-type", "").startswith(wire.MSGPACK):
        return wire.unpackb(r.content)
    return r.json()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_walk_loses_nothing_and_gets_the_values_right(
        server: tuple[httpx.Client, dict[str, str]], seed: int) -> None:
    http, ids = server
    walk = Walk(http, ids, seed)
    for _ in range(_STEPS):
        walk.step()
    ended = walk.settle()
    assert ended["done"] > 0, ended  # the walk did reach results
    assert http.get("/healthz").status_code == 200


@pytest.mark.parametrize("seed", [3, 4])
def test_a_random_walk_with_runtimes_killed_under_it_loses_nothing(
        server: tuple[httpx.Client, dict[str, str]], seed: int) -> None:
    """The walk, with a runtime SIGKILLed now and then (one step in about 45), as
    the OOM killer or a crashing program would: nothing accepted is lost (every
    future ends, those whose runtime crashed with ``runtime_crashed``), no answer is
    a 5xx, and what comes back is right. Over twelve more seeds, the walk found
    two ways a call could fail ``future_expired`` when its runtime was lost around it
    (tests/service: ``..._lost_before_it_was_sent_...``, ``..._went_with_its_runtime_...``)."""
    http, ids = server
    walk = Walk(http, ids, seed, crash=True)
    for i in range(_STEPS):
        deadline = time.monotonic() + 60
        while i == _STEPS // 2 and walk.crashes == 0:  # one for certain, whatever it drew
            assert time.monotonic() < deadline, "no runtime up to kill"
            walk._crash()
            time.sleep(0.1)
        walk.step()
    ended = walk.settle()
    # the walk did reach results: some read during it, or held to its end
    assert walk.crashes > 0 and walk.compared + ended["done"] > 0, (walk.crashes, ended)
    assert http.get("/healthz").status_code == 200


_TTL_S = 2.0


@pytest.fixture(scope="module")
def expiring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    env = {"JITSERVE_RUNTIMES": "2", "JITSERVE_EXECUTION_TIMEOUT_S": "2",
           "JITSERVE_FUTURE_TTL_S": str(_TTL_S)}
    for url in _serve(tmp_path_factory.mktemp("calls-expiring"), env):
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http, upload_programs(http)


class _ExpiringWalk(Walk):
    """``Walk`` on a server whose futures expire ``_TTL_S`` after they are made or end.
    A held future may be found gone only once that long has passed since the request
    that made it went (it cannot expire sooner); the walk then lets it go."""

    expired = 0

    def found_gone(self, fid: str, answer: str) -> None:
        age = time.monotonic() - self.born[fid]
        assert age >= _TTL_S, f"future {fid} gone {age:.2f} s after it was asked for: {answer[:300]}"
        self.futures[fid]["deleted"] = True
        self.expired += 1


@pytest.mark.parametrize("seed", [5, 6])
def test_a_random_walk_with_futures_expiring_under_it_loses_nothing_before_its_time(
        expiring: tuple[httpx.Client, dict[str, str]], seed: int) -> None:
    """The walk, its futures expiring as it goes (calls on them queued, running, or
    reading them, results fetched, outputs released): none is gone sooner than its
    TTL, what is read is right, the rest of the walk's checks hold, and what expires
    is refused as any unknown id is."""
    http, ids = expiring
    walk = _ExpiringWalk(http, ids, seed)
    for _ in range(_STEPS):
        walk.step()
    ended = walk.settle()
    assert walk.expired > 0 and walk.compared + ended["done"] > 0, (walk.expired, ended)
    assert http.get("/healthz").status_code == 200
