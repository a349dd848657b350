"""A fake jitserve for ``httpx.MockTransport``, so client tests need no network.

``FakeServer`` follows docs/api.md closely enough to run real ``jax_export``
programs (with ``jax.export.deserialize(...).call``), keep futures, and answer
long-polls; knobs let a test make it slow, fail, or lose state. The end-to-end
tests against the real service live in tests/e2e.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from typing import Any

import httpx
import numpy as np
import pytest
from versions import ON_SERVER_JAX, SERVER_JAX

from jitserve import wire
from jitserve.client import Timeout


def server_decoder() -> Any:
    """The server's jaxpr decoder, for a fake that runs documents here; skips the test
    on another jax than the server's, where tests/e2e/test_jaxpr_e2e.py sends this
    jax's documents to a real server instead."""
    import jax

    if not ON_SERVER_JAX:
        pytest.skip(f"the server's jaxpr decoder runs on the server's jax {SERVER_JAX}, "
                    f"not {jax.__version__}")
    from jitserve.compiler.jaxpr import decode_document

    return decode_document


def error(status: int, code: str, message: str, headers: dict[str, str] | None = None,
          **extra: Any) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message, **extra}},
                          headers=headers)


def executes(server: FakeServer) -> list[dict[str, Any]]:
    """The body of every call started, in order: an execute's, or a call of a batch
    (``POST /v1/calls``, each with its ``program_id``)."""
    bodies: list[dict[str, Any]] = []
    for r in list(server.requests):
        if r.url.path.endswith("/execute"):
            bodies.append(wire.unpackb(r.content))
        elif r.url.path == "/v1/calls":
            bodies.extend(wire.unpackb(r.content)["calls"])
    return bodies


def held(server: FakeServer) -> list[str | None]:
    """The ``wait`` each call asked for (``None``: none), in order: an execute's
    ``?wait``, or its batch's for a call of a batch marked ``inline``."""
    waits: list[str | None] = []
    for r in list(server.requests):
        if r.url.path.endswith("/execute"):
            waits.append(r.url.params.get("wait"))
        elif r.url.path == "/v1/calls":
            waits.extend(r.url.params.get("wait") if c.get("inline") else None
                         for c in wire.unpackb(r.content)["calls"])
    return waits


class FakeServer:
    """An in-memory server: programs, futures, results; every request is recorded."""

    def __init__(self) -> None:
        self.programs: dict[str, bytes] = {}
        self.futures: dict[str, dict[str, Any]] = {}
        self.requests: list[httpx.Request] = []
        self.api_key: str | None = None
        self.pending_polls = 0        # result polls answered 409 before a future is done
        self.hold_execute = False     # answer 202 even when the caller asked to wait
        self.fail_with: dict[str, Any] | None = None  # next futures fail with this error
        self.devices_doc: Any = {"platform": "cpu", "device_kind": "cpu", "device_count": 1}
        self.released: list[tuple[str, int]] = []  # every (future, output) released, in order
        self.calls_gate: threading.Event | None = None  # POST /v1/calls waits for it
        self._ids = itertools.count()

    # ------------------------------------------------------------ plumbing

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path.startswith("/v1") and self.api_key is not None:
            if request.headers.get("authorization") != f"Bearer {self.api_key}":
                return error(401, "unauthorized", "missing or wrong API key",
                             headers={"WWW-Authenticate": "Bearer"})
        parts = request.url.path.strip("/").split("/")
        route = getattr(self, "_" + "_".join([request.method.lower(), *self._shape(parts)]), None)
        if route is None:
            return error(404, "not_found", f"no route {request.method} {request.url.path}")
        return route(request, *self._ids_in(parts))  # type: ignore[no-any-return]

    @staticmethod
    def _shape(parts: list[str]) -> list[str]:
        # /v1/programs/{id}/execute -> ["programs", "id", "execute"]
        return ["id" if i == 2 else p for i, p in enumerate(parts) if i > 0 or p != "v1"] \
            if parts[0] == "v1" else parts

    @staticmethod
    def _ids_in(parts: list[str]) -> list[str]:
        return [parts[2]] if parts[0] == "v1" and len(parts) > 2 else []

    def paths(self) -> list[str]:
        """The requests made, but the releases the client sends in the background (``released``)."""
        return [f"{r.method} {r.url.path}" for r in self.requests
                if r.url.path != "/v1/futures/release"]

    @staticmethod
    def body(request: httpx.Request) -> Any:
        if not request.content:
            return None
        if request.headers.get("content-type") == wire.JSON:
            return wire.loads_json(request.content)
        return wire.unpackb(request.content)

    @staticmethod
    def answer(request: httpx.Request, doc: Any, status: int = 200) -> httpx.Response:
        if "msgpack" in request.headers.get("accept", ""):
            return httpx.Response(status, content=wire.packb(doc),
                                  headers={"content-type": wire.MSGPACK})
        return httpx.Response(status, content=wire.dumps_json(doc),
                              headers={"content-type": wire.JSON})

    # ------------------------------------------------------------ programs

    def program_doc(self, pid: str) -> dict[str, Any]:
        import jax

        exp = jax.export.deserialize(bytearray(self.programs[pid]))
        avals = lambda xs: [{"shape": list(a.shape), "dtype": a.dtype.name} for a in xs]  # noqa: E731
        return {"program_id": pid, "format": "jax_export", "in_avals": avals(exp.in_avals),
                "out_avals": avals(exp.out_avals), "in_tree": None, "out_tree": None,
                "platforms": list(exp.platforms)}

    def _post_programs(self, request: httpx.Request) -> httpx.Response:
        pid = hashlib.sha256(request.content).hexdigest()
        status = 200 if pid in self.programs else 201
        self.programs[pid] = request.content
        return httpx.Response(status, json=self.program_doc(pid))

    def _get_programs_id(self, request: httpx.Request, pid: str) -> httpx.Response:
        if pid not in self.programs:
            return error(404, "not_found", f"unknown program {pid}")
        return httpx.Response(200, json=self.program_doc(pid))

    def _post_programs_id_compile(self, request: httpx.Request, pid: str) -> httpx.Response:
        if pid not in self.programs:
            return error(404, "not_found", f"unknown program {pid}")
        doc = self.program_doc(pid)
        return httpx.Response(200, json={
            "executable_id": "e" * 64, "tier": "compiled", "compile_seconds": 0.5,
            "in_avals": doc["in_avals"], "out_avals": doc["out_avals"], "out_tree": None})

    def _post_programs_id_execute(self, request: httpx.Request, pid: str) -> httpx.Response:
        started = self._start(pid, self.body(request))
        if isinstance(started, httpx.Response):
            return started
        fid, fut = started
        if "wait" in request.url.params and not self.hold_execute and fut["status"] == "done":
            return self.answer(request, {"future_id": fid, "outputs": fut["outputs"],
                                         "out_tree": None})
        return self.answer(request, {"future_id": fid, "status": "pending",
                                     "out_avals": fut["out_avals"], "out_tree": None,
                                     "executable_id": "e" * 64, "tier": "memory"}, 202)

    def _post_calls(self, request: httpx.Request) -> httpx.Response:
        """``POST /v1/calls``: each call started as an execute, in order; with ``?wait``,
        the entries of ``inline`` calls carry their outputs (unless ``hold_execute``)."""
        if self.calls_gate is not None:
            assert self.calls_gate.wait(30), "a test left POST /v1/calls waiting"
        entries: list[dict[str, Any]] = []
        for call in self.body(request)["calls"]:
            args = []
            for a in call["args"]:
                if isinstance(a, dict) and "call" in a:
                    earlier = entries[a["call"]]
                    if "error" in earlier:
                        args = None
                        break
                    a = {"future": earlier["future_id"], "output": a["output"]}
                args.append(a)
            if args is None:
                entries.append({"error": {"code": "future_failed", "message": "an earlier "
                                          "call of this batch was refused"}})
                continue
            started = self._start(call["program_id"], {**call, "args": args})
            if isinstance(started, httpx.Response):
                entries.append(started.json())
                continue
            fid, fut = started
            entry = {"future_id": fid, "status": "pending", "executable_id": "e" * 64,
                     "tier": "memory"}
            if (call.get("inline") and "wait" in request.url.params and not self.hold_execute
                    and fut["status"] == "done"):
                entry.update(status="done", outputs=fut["outputs"])
            entries.append(entry)
        return self.answer(request, {"calls": entries})

    def _start(self, pid: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | httpx.Response:
        """Start an execute's ``body`` of program ``pid``: its future, or the error answer."""
        if pid not in self.programs:
            return error(404, "not_found", f"unknown program {pid}")
        args = []
        for a in body["args"]:
            if wire.is_future_ref(a):
                fut = self.futures.get(a["future"])
                if fut is None:
                    return error(404, "not_found", f"unknown future {a['future']}")
                a = fut["outputs"][a["output"]]
            args.append(a)
        if "cpu" not in self.program_doc(pid)["platforms"]:
            return error(422, "platform_mismatch", "this server runs cpu programs")
        fid = f"fut{next(self._ids)}"
        self.futures[fid] = fut = self._run(pid, args)
        fut["future_id"] = fid
        self._release([body["args"][i] for i in body.get("donate", ())])
        return fid, fut

    def _run(self, pid: str, args: list[np.ndarray]) -> dict[str, Any]:
        import jax

        exp = jax.export.deserialize(bytearray(self.programs[pid]))
        if self.fail_with is not None:
            return {"status": "failed", "error": self.fail_with, "outputs": [], "out_avals": []}
        call_args, call_kw = jax.tree_util.tree_unflatten(exp.in_tree, args)
        outs = [np.asarray(o) for o in jax.tree_util.tree_leaves(exp.call(*call_args, **call_kw))]
        avals = [{"shape": list(o.shape), "dtype": o.dtype.name} for o in outs]
        return {"status": "done", "error": None, "outputs": outs, "out_avals": avals}

    # ------------------------------------------------------------ futures

    def _get_futures_id(self, request: httpx.Request, fid: str) -> httpx.Response:
        fut = self.futures.get(fid)
        if fut is None:
            return error(404, "not_found", f"unknown future {fid}")
        status = "running" if self.pending_polls else fut["status"]
        return httpx.Response(200, json={
            "future_id": fid, "status": status, "out_avals": fut["out_avals"], "out_tree": None,
            "error": fut["error"], "timings": {"queued_s": 0.0, "compile_s": 0.0, "run_s": 0.1},
            "created": 1.0, "expires_at": 2.0})

    def _get_futures_id_result(self, request: httpx.Request, fid: str) -> httpx.Response:
        fut = self.futures.get(fid)
        if fut is None:
            return error(404, "not_found", f"unknown future {fid}")
        if self.pending_polls:
            self.pending_polls -= 1
            return error(409, "future_pending", f"future {fid} is not done")
        if fut["status"] == "failed":
            return error(422, "future_failed", fut["error"]["message"], cause=fut["error"])
        asked = request.url.params.get("outputs")
        wanted = range(len(fut["outputs"])) if asked is None else [int(i) for i in asked.split(",")]
        # A test that shortens ``outputs`` plays a server that sends fewer than asked.
        wanted = [i for i in wanted if i < len(fut["outputs"])]
        if any(fut["outputs"][i] is None for i in wanted):
            return error(404, "not_found", f"an output of future {fid} was released")
        return self.answer(request, {"outputs": [fut["outputs"][i] for i in wanted],
                                     "out_tree": None})

    def _post_futures_id(self, request: httpx.Request, what: str) -> httpx.Response:
        if what != "release":
            return error(404, "not_found", f"no route POST /v1/futures/{what}")
        released = self._release(self.body(request)["outputs"])
        return self.answer(request, {"released": released,
                                     "unknown": len(self.body(request)["outputs"]) - released})

    def _release(self, refs: list[dict[str, Any]]) -> int:
        """Free outputs (a future goes when all of its have); how many were known."""
        known = 0
        for ref in refs:
            fut = self.futures.get(ref["future"])
            if fut is None or fut["outputs"][ref["output"]] is None:
                continue
            known += 1
            self.released.append((ref["future"], ref["output"]))
            fut["outputs"][ref["output"]] = None
            if all(o is None for o in fut["outputs"]):
                del self.futures[ref["future"]]
        return known

    def _post_arrays(self, request: httpx.Request) -> httpx.Response:
        arrays = self.body(request)["arrays"]
        fid = f"fut{next(self._ids)}"
        avals = [{"shape": list(a.shape), "dtype": a.dtype.name} for a in arrays]
        self.futures[fid] = {"future_id": fid, "status": "done", "error": None,
                             "outputs": list(arrays), "out_avals": avals}
        return self.answer(request, {"future_id": fid, "status": "done", "out_avals": avals,
                                     "out_tree": None, "executable_id": "", "tier": "put"}, 201)

    def _delete_futures_id(self, request: httpx.Request, fid: str) -> httpx.Response:
        if self.futures.pop(fid, None) is None:
            return error(404, "not_found", f"unknown future {fid}")
        return httpx.Response(200, json={"future_id": fid, "status": "done"})

    # ------------------------------------------------------------ the rest

    def _get_devices(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=json.dumps(self.devices_doc),
                              headers={"content-type": wire.JSON})

    def _get_healthz(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ok"})

    def _get_readyz(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ready"})


FAST = Timeout(5.0, poll=0.2)
