"""The IFRT proxy's wire, its limits and its quotas, on real ``jitserve serve`` processes.

Wire-level tests speak the protocol with grpc's Python client and the message classes
jitserve builds from jaxlib's descriptors, against one server started for this module
as ``test_ifrt_programs`` starts its own (API keys, two runtimes, a 3 s deadline); the
others start servers of their own, for TLS, session limits and quotas, and run
unmodified programs through jaxlib's client as that module does.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from e2e.conftest import _free_port, _serve, metric_total
from e2e.test_ifrt_programs import KEYS, program_env, run_program, serve_ifrt

from jitserve.compiler.ifrt_protos import message

P = "xla.ifrt.proxy."
SESSION = "/xla.ifrt.proxy.GrpcIfrtService/IfrtSession"


# Sessions open at once: per key, and in all (``test_sessions_open_at_once_are_bounded``).
SESSION_LIMITS = {"JITSERVE_TENANT_MAX_IFRT_SESSIONS": "2", "JITSERVE_IFRT_MAX_SESSIONS": "3"}


@pytest.fixture(scope="module")
def ifrt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from serve_ifrt(tmp_path_factory, SESSION_LIMITS)


# -- the wire ------------------------------------------------------------------------


class Session:
    """One IFRT session over grpc's Python client, request by request."""

    def __init__(self, target: str, key: str | None = KEYS[0], protocol: int = 25) -> None:
        self.channel = grpc.insecure_channel(target)
        opening = message(P + "GrpcIfrtSessionMetadata")()
        opening.version.protocol_version = protocol
        opening.version.ifrt_serdes_version_number = 3
        if key is not None:
            opening.initialization_data.attributes["jitserve_api_key"].string_value = key.encode()
        self._early: dict[int, Any] = {}  # answers read while looking for another's
        self.order: list[int] = []  # the op ids of the answers, as they came
        import queue
        import threading

        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._lock = threading.Lock()
        call = self.channel.stream_stream(SESSION)
        self._responses = call(iter(self._queue.get, None), metadata=[
            ("ifrt-proxy-grpc-ifrt-session-metadata-bin", opening.SerializeToString())])
        self.op = 0
        self._answered: set[int] = set()
        self.opened = self.request(init_request={})  # a refused session's answer says why
        self.session_id = self.opened.init_response.session_id

    def send(self, data: bytes) -> Any:
        """Send raw bytes as a request; the next answer (garbage has no op id)."""
        self._queue.put(data)
        return self._next()

    def send_ahead(self, data: bytes) -> None:
        """Send raw bytes as a request, without reading an answer (``next_answer`` does)."""
        self._queue.put(data)

    def next_answer(self) -> Any:
        return self._next()

    def answer(self, op: int | None = None) -> Any:
        """The answer to request ``op`` (the oldest unanswered one sent by ``put``, by
        default): answers come in any order, matched by ``op_id``, as jaxlib's client
        matches them."""
        op = min(set(range(1, self.op + 1)) - self._answered) if op is None else op
        while op not in self._early:
            response = self._next()
            self._early[response.response_metadata.op_id] = response
        self._answered.add(op)
        return self._early.pop(op)

    def _next(self) -> Any:
        response = message(P + "IfrtResponse").FromString(next(self._responses))
        self.order.append(response.response_metadata.op_id)
        return response

    def request(self, **fields: Any) -> Any:
        return self.answer(self.put(**fields))

    def put(self, **fields: Any) -> int:
        """Send a request without waiting for its answer (``answer`` reads it); its op id."""
        self.op += 1
        request = message(P + "IfrtRequest")(**fields)
        request.request_metadata.op_id = self.op
        self._queue.put(request.SerializeToString())
        return self.op

    def store(self, handle: int, data: bytes) -> None:
        meta = message(P + "GrpcHostBufferStoreMetadata")(session_id=self.session_id, handle=handle,
                                                         buffer_size=len(data))
        store = self.channel.stream_unary("/xla.ifrt.proxy.GrpcIfrtService/HostBufferStore")
        store(iter([message(P + "GrpcHostBufferStoreRequest")(data=data).SerializeToString()]),
              metadata=[("ifrt-proxy-grpc-host-buffer-store-metadata-bin", meta.SerializeToString())])

    def make_array(self, handle: int, buffer: int, values: np.ndarray,
                   wait: bool = True) -> Any:
        single = message("xla.ifrt.SingleDeviceShardingProto")(device_id=0)
        request = {"make_array_from_host_buffer_request": {
            "dtype": {"kind": message("xla.ifrt.DTypeProto").Kind.Value("KIND_F32")},
            "shape": {"dims": list(values.shape)}, "host_buffer_handle": buffer,
            "array_handle": handle,
            "sharding": {"serialized_sharding": {"type_name": "xla::ifrt::SingleDeviceSharding",
                                                 "data": single.SerializeToString()}}}}
        if not wait:
            return self.put(**request)
        return self.request(**request)

    def store_started(self, handle: int, size: int, go: threading.Event) -> grpc.Future:
        """A store of ``size`` zero bytes that sends its first 100 and waits for ``go``
        before the rest (set it, and it ends; leave it, and the server's body timeout
        ends it); its future."""
        meta = message(P + "GrpcHostBufferStoreMetadata")(session_id=self.session_id, handle=handle,
                                                         buffer_size=size)

        def chunks() -> Iterator[bytes]:
            yield message(P + "GrpcHostBufferStoreRequest")(data=b"\x00" * 100).SerializeToString()
            go.wait(300)
            yield message(P + "GrpcHostBufferStoreRequest")(
                data=b"\x00" * (size - 100)).SerializeToString()

        store = self.channel.stream_unary("/xla.ifrt.proxy.GrpcIfrtService/HostBufferStore")
        return store.future(chunks(), metadata=[
            ("ifrt-proxy-grpc-host-buffer-store-metadata-bin", meta.SerializeToString())])

    def close(self) -> None:
        self._queue.put(None)
        self.channel.close()


def _status(response: Any) -> tuple[int, str]:
    status = response.response_metadata.status
    return status.code, status.message


def test_each_session_sees_only_its_own_arrays(ifrt: dict[str, str]) -> None:
    alice, bob = Session(ifrt["target"], KEYS[0]), Session(ifrt["target"], KEYS[1])
    try:
        values = np.arange(4, dtype=np.float32)
        alice.store(11, values.tobytes())
        assert _status(alice.make_array(5, 11, values))[0] == 0
        read = alice.request(copy_to_host_buffer_request={"array_handle": 5, "host_buffer_handle": 12})
        assert _status(read)[0] == 0
        data = _read(alice, 12)
        assert np.frombuffer(data, np.float32).tolist() == values.tolist()
        lookup = alice.channel.unary_stream("/xla.ifrt.proxy.GrpcIfrtService/HostBufferLookup")
        # Bob names Alice's handle: his session has no such array.
        code, text = _status(bob.request(copy_to_host_buffer_request={"array_handle": 5,
                                                                      "host_buffer_handle": 13}))
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and "unknown array handle 5" in text
        # ...nor can he read Alice's host buffers with his own session id.
        with pytest.raises(grpc.RpcError) as refused:
            list(lookup(message(P + "GrpcHostBufferLookupRequest")(
                session_id=bob.session_id, handle=12).SerializeToString()))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        alice.close()
        bob.close()


def test_requests_behind_a_host_buffer_on_its_way_go_to_the_runtime_with_it(
        ifrt: dict[str, str]) -> None:
    """jaxlib's client sends an array's request before its host buffer, and the call
    that uses the array right behind it: they wait for the buffer together and go to
    the runtime as one batch, not a runtime round trip apart."""
    session = Session(ifrt["target"])
    url = ifrt["url"]
    try:
        values = np.arange(3, dtype=np.float32)
        for buffer, stored in ((71, True), (72, False)):  # it comes; it never does (2 s)
            batches = metric_total(url, "jitserve_ifrt_batch_requests_count")
            requests = metric_total(url, "jitserve_ifrt_batch_requests_sum")
            made = session.make_array(buffer - 10, buffer, values, wait=False)
            _wait_for_sessions(url, lambda s, b=buffer: s["waiting_for_host_buffers"] == [b])
            ready = session.put(check_value_ready_request={"value_handles": [buffer - 10]})
            if stored:
                session.store(buffer, values.tobytes())
                assert _status(session.answer(made)) == (0, "")
                assert _status(session.answer(ready)) == (0, "")
            else:
                code, text = _status(session.answer(made))
                assert code == grpc.StatusCode.NOT_FOUND.value[0] and "never arrived" in text
                assert "failed earlier" in _status(session.answer(ready))[1]
            # The batch's last request, which a client waits on, is answered first.
            assert session.order[-2:] == [ready, made]
            assert metric_total(url, "jitserve_ifrt_batch_requests_count") == batches + 1
            assert metric_total(url, "jitserve_ifrt_batch_requests_sum") == requests + 2
    finally:
        session.close()


def test_sessions_open_at_once_are_bounded_per_key_and_in_all(ifrt: dict[str, str],
                                                               tmp_path: Path) -> None:
    """Two sessions per key, three in all (``SESSION_LIMITS``): one more is refused as it
    opens, naming the limit, and an unmodified program fails to start saying so; once
    one has ended, a new one opens."""
    target, url = ifrt["target"], ifrt["url"]
    _until(lambda: metric_total(url, "jitserve_ifrt_sessions") == 0)  # earlier tests' ended
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    opened: list[Session] = []
    try:
        opened += [Session(target, KEYS[0]), Session(target, KEYS[0])]
        assert [_status(s.opened)[0] for s in opened] == [0, 0]
        third = Session(target, KEYS[0])
        third.close()
        code, text = _status(third.opened)
        assert code == exhausted and "quota ifrt_sessions: this key has 2 IFRT sessions open; " \
            "its quota is 2 (JITSERVE_TENANT_MAX_IFRT_SESSIONS)" in text, text
        # jaxlib's client tries again until its connect timeout (2 s here), then raises.
        program = run_program(ifrt, "import jax\nprint(jax.devices())\n", tmp_path, key=KEYS[0],
                              env={"JITSERVE_IFRT_CONNECT_TIMEOUT_S": "2"})
        assert program.returncode != 0 and "RESOURCE_EXHAUSTED" in program.stderr
        assert "quota ifrt_sessions" in program.stderr, program.stderr[-2000:]
        # The other key has its own two, but the server holds three in all.
        opened.append(Session(target, KEYS[1]))
        assert _status(opened[-1].opened)[0] == 0
        past = Session(target, KEYS[1])
        past.close()
        code, text = _status(past.opened)
        assert code == exhausted and "this server has 3 IFRT sessions open, its limit " \
            "(JITSERVE_IFRT_MAX_SESSIONS=3)" in text, text
        # A program started meanwhile starts once a session has ended, within its timeout.
        refused = 'jitserve_ifrt_sessions_closed_total{reason="too_many_sessions"}'
        before = metric_total(url, refused)
        path = tmp_path / "waits.py"
        path.write_text("import jax\nprint(float(jax.numpy.ones(3).sum()))\n")
        waits = subprocess.Popen([sys.executable, str(path)], text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env={**program_env(ifrt, KEYS[0]),
                                                              "JITSERVE_IFRT_CONNECT_TIMEOUT_S": "120"})
        try:
            _until(lambda: metric_total(url, refused) > before)  # it is refused, and tries again
            opened.pop(0).close()
            out, err = waits.communicate(timeout=150)
        finally:
            waits.kill()
        assert waits.returncode == 0 and out.strip() == "3.0" and err == "", err[-2000:]
        _until(lambda: metric_total(url, "jitserve_ifrt_sessions") == 2)
        opened.append(Session(target, KEYS[1]))
        assert _status(opened[-1].opened)[0] == 0
    finally:
        for session in opened:
            session.close()
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200


def test_a_client_that_sends_faster_than_its_runtime_answers_is_held_back(
        ifrt: dict[str, str]) -> None:
    """Requests read and not yet sent on are bounded (64 MiB, then the server reads the
    stream no further and gRPC holds the client back), so sending ahead cannot fill the
    API process's memory: behind a request that waits 2 s for a host buffer that never
    comes, 200 requests of 1 MiB wait in the client, not the server. Then every one is
    answered, and the session goes on."""
    session = Session(ifrt["target"])
    try:
        made = session.make_array(60, 990, np.zeros(3, np.float32), wait=False)  # never stored
        for _ in range(200):
            session.send_ahead(b"\xff" * (1 << 20))  # not an IfrtRequest: answered as such
        queued = []

        def waiting(entry: dict[str, Any]) -> bool:
            queued.append(entry["request_bytes_queued"])
            return entry["waiting_for_host_buffers"] != [990]

        _wait_for_sessions(ifrt["url"], waiting)
        assert 32 << 20 <= max(queued) <= (64 + 1) << 20, max(queued)
        answers = [session.next_answer() for _ in range(201)]
        [answer] = [a for a in answers if a.response_metadata.op_id == made]
        code, text = _status(answer)
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and "never arrived" in text
        answers.remove(answer)
        assert {_status(a) for a in answers} == {
            (grpc.StatusCode.INVALID_ARGUMENT.value[0],
             "the request is not an IfrtRequest jitserve can read")}
        session._answered.add(made)
        assert _status(session.request(init_request={}))[0] == 0
    finally:
        session.close()


def _until(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


def _wait_for_sessions(url: str, ready: Any, timeout: float = 60.0) -> None:
    """Until some open session of KEYS[0] is ``ready`` (a condition on its console entry)."""
    deadline = time.monotonic() + timeout
    while True:
        sessions = httpx.get(f"{url}/v1/console/sessions", timeout=10,
                             headers={"Authorization": f"Bearer {KEYS[0]}"}).json()["sessions"]
        if any(ready(s) for s in sessions):
            return
        assert time.monotonic() < deadline, sessions
        time.sleep(0.01)


def test_bad_input_on_the_wire_is_an_error_status_never_a_crash(ifrt: dict[str, str]) -> None:
    target = ifrt["target"]
    channel = grpc.insecure_channel(target)
    version = channel.unary_unary("/xla.ifrt.proxy.GrpcIfrtService/GetVersion")
    old = message(P + "GrpcGetVersionRequest")()
    old.min_version.protocol_version, old.max_version.protocol_version = 1, 3
    with pytest.raises(grpc.RpcError) as refused:
        version(old.SerializeToString())
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "16-25" in (refused.value.details() or "")
    with pytest.raises(grpc.RpcError) as garbage:
        version(b"\xff\xff\xff")
    assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as bare:  # no session metadata
        list(channel.stream_stream(SESSION)(iter([b""])))
    assert bare.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as unknown:
        list(channel.unary_stream("/xla.ifrt.proxy.GrpcIfrtService/HostBufferLookup")(
            message(P + "GrpcHostBufferLookupRequest")(session_id=12345, handle=1).SerializeToString()))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()

    session = Session(target)
    try:
        invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert _status(session.send(b"\x0a\x02garbage"))[0] == invalid  # not an IfrtRequest
        assert "names no operation" in _status(session.request())[1]  # a request of no type
        code, text = _status(session.request(check_value_ready_request={"value_handles": [987654]}))
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and "987654" in text
        code, text = _status(session.request(loaded_executable_execute_request={
            "loaded_executable_handle": 42}))
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and "executable" in text
        # A host buffer that never comes: a bounded wait, then NOT_FOUND, and its handle
        # holds that error for whoever uses it next.
        code, text = _status(session.make_array(7, 999, np.zeros(3, np.float32)))
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and "never arrived" in text
        code, text = _status(session.request(check_value_ready_request={"value_handles": [7]}))
        assert "failed earlier" in text
        # A chain of arrays, each made from the one before, from that failed one: every
        # link names the first failure once (each nested the one before's).
        texts = [_status(session.request(fully_replicated_shard_request={
            "array_handle": 7 if link == 0 else 100 + link - 1, "result_handle": 100 + link}))[1]
            for link in range(30)]
        assert texts[-1].startswith("array 128 failed earlier: ") and "never arrived" in texts[-1]
        assert texts[-1].count("failed earlier") == 1, texts[-1]
        assert len(texts[-1]) == len(texts[1]), texts
        # A host buffer of the wrong size for its array.
        session.store(21, b"\x00" * 5)
        code, text = _status(session.make_array(8, 21, np.zeros(3, np.float32)))
        assert code == invalid and "5 bytes" in text
        # Compile of something that is not a program.
        code, text = _status(session.request(compile_request={
            "program": {"type_name": "xla::ifrt::XlaProgram", "data": b"not mlir"},
            "compile_options": {"type_name": "xla::ifrt::XlaCompileOptions", "data": b""}}))
        assert code == invalid and "refused the program" in text
        # An array read after its buffers were deleted: refused, naming why.
        session.store(22, np.zeros(3, np.float32).tobytes())
        assert _status(session.make_array(9, 22, np.zeros(3, np.float32)))[0] == 0
        assert _status(session.request(delete_array_request={"array_handle": [9]}))[0] == 0
        code, text = _status(session.request(copy_to_host_buffer_request={
            "array_handle": 9, "host_buffer_handle": 23}))
        assert code == invalid and "Array has been deleted: array 9" in text, text
        # A layout of an impossible shape: XLA's own refusal, with its code.
        code, text = _status(session.request(get_default_layout_request={
            "dtype": {"kind": message("xla.ifrt.DTypeProto").Kind.Value("KIND_F32")},
            "dims": [-1], "device_id": 0}))
        assert code == invalid and "dimension size -1" in text, text
        assert _status(session.request(init_request={}))[0] == 0  # the session goes on
    finally:
        session.close()
    assert httpx.get(f"{ifrt['url']}/healthz", timeout=10).status_code == 200


def test_a_failed_request_lets_go_of_its_host_buffer(ifrt: dict[str, str]) -> None:
    """A failed request's error stays on its handles, and its host buffer goes: the
    runtime unmaps a big buffer's shared memory once the batch is answered. (The error's
    traceback held the frames that read the buffer, and so its mapping, until a garbage
    collection: a runtime near its memory cap then failed the next sessions' buffers.)"""
    session = Session(ifrt["target"])
    try:
        session.store(31, np.zeros(3 << 20, np.float32).tobytes())  # 12 MiB: shared memory
        code, text = _status(session.make_array(32, 31, np.zeros(5, np.float32)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "12582912 bytes" in text, text
        assert "failed earlier" in _status(session.request(
            check_value_ready_request={"value_handles": [32]}))[1]
        index = next(s["runtime"] for s in _sessions(ifrt["url"])
                     if s["session"] == f"{session.session_id:016x}")
        pid = next(r["pid"] for r in httpx.get(f"{ifrt['url']}/readyz", timeout=10).json()["runtimes"]
                   if r["index"] == index)
        mapped = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                  if "/dev/shm/jitserve-" in line]
        big = [line for line in mapped if _span(line) > 4 << 20]  # SegmentMaps keeps small ones
        assert big == [], big
    finally:
        session.close()


def _span(maps_line: str) -> int:
    start, end = maps_line.split()[0].split("-")
    return int(end, 16) - int(start, 16)


def _sessions(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/v1/console/sessions", timeout=10,
                          headers={"Authorization": f"Bearer {KEYS[0]}"}).json()["sessions"])


OVER_THE_BODY_LIMIT = """
    import jax, jax.numpy as jnp, numpy as np
    try:  # 4 MiB: over the server's JITSERVE_MAX_BODY_BYTES of 256 KiB
        print(float(jax.device_put(np.ones(1 << 20, np.float32)).sum()))
        raise SystemExit("the big array went through")
    except jax.errors.JaxRuntimeError as e:
        print("refused:", e)
    print("after:", float((jnp.ones(3) * 2).sum()))
    # Eight arrays of 4,000 bytes at once, over the session's JITSERVE_IFRT_MAX_HOST_BYTES
    # of 4096 together: each store waits for the one before to be used.
    tree = jax.device_put([np.full(1000, i, np.float32) for i in range(8)])
    print("tree:", [float(x.sum()) for x in tree])
"""


def test_a_session_s_limits_host_bytes_held_and_idle_time(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """A host buffer over a limit fails the request that names it (its array holds the
    error), not the session: jaxlib's client gives a session up on a failed upload, and
    then aborts the program at its next ``device_put``."""
    port = _free_port()
    env = {"JITSERVE_IFRT_PORT": str(port), "JITSERVE_IFRT_SESSION_IDLE_S": "2",
           "JITSERVE_IFRT_MAX_HOST_BYTES": "4096",  # and E2E_ENV's 256 KiB body limit
           "JITSERVE_BODY_TIMEOUT_S": "1", "JITSERVE_IFRT_HOST_BUFFER_WAIT_S": "10"}
    for url in _serve(tmp_path_factory.mktemp("ifrt-idle"), env):
        done = run_program({"target": f"127.0.0.1:{port}"}, OVER_THE_BODY_LIMIT, tmp_path,
                           key=None)
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("refused: RESOURCE_EXHAUSTED: array 1 failed earlier: a host buffer of "
                "4,194,304 bytes is over this server's limit of 262,144 (JITSERVE_MAX_BODY_BYTES)"
                in done.stdout), done.stdout
        assert "after: 6.0" in done.stdout, done.stdout
        assert f"tree: {[1000.0 * i for i in range(8)]}" in done.stdout, done.stdout
        closed = metric_total(url, "jitserve_ifrt_sessions_closed_total")
        session = Session(f"127.0.0.1:{port}", key=None)
        go, stalls = threading.Event(), threading.Event()
        try:
            # Stores on their way count too: one that does not fit beside them (and what
            # is held) waits until it does, then comes.
            first = session.store_started(4, 1000, go)
            _wait_for_sessions(url, lambda s: s["host_bytes_incoming"] == 1000)
            whole = threading.Event()
            whole.set()
            behind = session.store_started(6, 3500, whole)
            _wait_for_sessions(url, lambda s: s["stores_held_back"] == [6]
                               and s["host_bytes_incoming"] == 1000)
            go.set()
            first.result(timeout=60)
            assert _status(session.make_array(14, 4, np.zeros(250, np.float32)))[0] == 0
            behind.result(timeout=60)
            assert _status(session.make_array(16, 6, np.zeros(875, np.float32)))[0] == 0
            session.store(1, b"\x00" * 3000)  # held: no request has used it
            session.store(2, b"\x00" * 5000)  # over JITSERVE_IFRT_MAX_HOST_BYTES alone: refused
            session.store(3, b"\x00" * (300 << 10))  # over JITSERVE_MAX_BODY_BYTES: refused
            for handle, limit in ((2, "JITSERVE_IFRT_MAX_HOST_BYTES"),
                                  (3, "JITSERVE_MAX_BODY_BYTES")):
                code, text = _status(session.make_array(10 + handle, handle, np.zeros(4, np.float32)))
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and limit in text, text
            # A store that does not fit beside what is held waits until a request uses it.
            behind = session.store_started(7, 3000, whole)
            _wait_for_sessions(url, lambda s: s["stores_held_back"] == [7])
            made = session.make_array(11, 1, np.zeros(750, np.float32))  # the session goes on
            assert _status(made)[0] == 0, made
            behind.result(timeout=60)
            assert _status(session.make_array(17, 7, np.zeros(750, np.float32)))[0] == 0
            _wait_for_sessions(url, lambda s: s["host_bytes_held"] == 0)
            # Copies to host not read count too: past what the session's arrays hold on
            # the devices (1000 + 3500 + 3000 + 3000) plus JITSERVE_IFRT_MAX_HOST_BYTES, a
            # copy is refused.
            for copy in (200, 201, 202, 203):
                assert _status(session.request(copy_to_host_buffer_request={
                    "array_handle": 11, "host_buffer_handle": copy}))[0] == 0
            code, text = _status(session.request(copy_to_host_buffer_request={
                "array_handle": 11, "host_buffer_handle": 204}))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], text
            assert "JITSERVE_IFRT_MAX_HOST_BYTES" in text and "read the copies" in text, text
            assert len(_read(session, 200)) == 3000  # read: room for another
            assert _status(session.request(copy_to_host_buffer_request={
                "array_handle": 11, "host_buffer_handle": 204}))[0] == 0
            for copy in (201, 202, 203, 204):
                assert len(_read(session, copy)) == 3000
            _wait_for_sessions(url, lambda s: s["host_bytes_held"] == 0)
            # A store whose bytes stop coming ends after JITSERVE_BODY_TIMEOUT_S, and
            # what it held is free again.
            stalled = session.store_started(5, 3000, stalls)
            with pytest.raises(grpc.RpcError) as late:
                stalled.result(timeout=60)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, late.value
            assert "JITSERVE_BODY_TIMEOUT_S" in (late.value.details() or ""), late.value
            _wait_for_sessions(url, lambda s: s["host_bytes_incoming"] == 0)
            # A store held back, let through for the request that names it, whose bytes
            # then stop: that request is answered (the buffer never arrived, after
            # JITSERVE_IFRT_HOST_BUFFER_WAIT_S), and the session goes on. It waited for
            # ever, and the session with it.
            session.store(1, b"\x00" * 3000)  # held
            cut = session.store_started(8, 3000, stalls)
            _wait_for_sessions(url, lambda s: s["stores_held_back"] == [8])
            code, text = _status(session.make_array(18, 8, np.zeros(750, np.float32)))
            assert code == grpc.StatusCode.NOT_FOUND.value[0] and "never arrived" in text, text
            with pytest.raises(grpc.RpcError) as late:
                cut.result(timeout=60)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, late.value
            assert _status(session.make_array(19, 1, np.zeros(750, np.float32)))[0] == 0
            _wait_for_sessions(url, lambda s: s["host_bytes_held"] == 0
                               and s["host_bytes_incoming"] == 0 and s["stores_held_back"] == [])
            deadline = time.monotonic() + 30
            while metric_total(url, "jitserve_ifrt_sessions_closed_total") < closed + 1:
                assert time.monotonic() < deadline, "the idle session was not closed"
                time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as ended:
                session.request(init_request={})
            assert ended.value.code() == grpc.StatusCode.ABORTED
            assert "JITSERVE_IFRT_SESSION_IDLE_S" in (ended.value.details() or "")
            assert metric_total(url, "jitserve_ifrt_sessions") == 0
        finally:
            go.set()
            stalls.set()
            session.close()


def _read(session: Session, handle: int) -> bytes:
    """Host buffer ``handle`` of ``session`` (a ``HostBufferLookup``)."""
    lookup = session.channel.unary_stream("/xla.ifrt.proxy.GrpcIfrtService/HostBufferLookup")
    chunks = lookup(message(P + "GrpcHostBufferLookupRequest")(
        session_id=session.session_id, handle=handle).SerializeToString())
    return b"".join(message(P + "GrpcHostBufferLookupResponse").FromString(c).data for c in chunks)


def _certificates(where: Path) -> tuple[Path, Path, Path]:
    """A private CA, and a certificate it signed for localhost and 127.0.0.1: (ca, cert, key)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", "-subj", "/CN=jitserve test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=localhost")
    (where / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")
    return where / "ca.pem", where / "server.pem", where / "server.key"


def test_tls_with_a_private_ca_through_the_backend_s_forwarder(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    ca, cert, key = _certificates(tmp_path_factory.mktemp("tls"))
    port = _free_port()
    env = {"JITSERVE_IFRT_PORT": str(port), "JITSERVE_IFRT_TLS_CERT": str(cert),
           "JITSERVE_IFRT_TLS_KEY": str(key)}
    for _url in _serve(tmp_path_factory.mktemp("ifrt-tls"), env):
        server = {"target": f"grpcs://localhost:{port}"}
        secure = run_program(server, "import jax.numpy as jnp\nprint(float((jnp.ones(4) * 3).sum()))\n",
                             tmp_path, key=None, env={"JITSERVE_IFRT_CA": str(ca)})
        assert secure.returncode == 0 and secure.stdout.strip() == "12.0", secure.stderr[-3000:]
        assert secure.stderr == ""
        # Without the CA the server's certificate is not trusted, and plaintext is not served.
        for target, extra in ((f"grpcs://localhost:{port}", {}), (f"127.0.0.1:{port}", {})):
            refused = run_program({"target": target}, "import jax\nprint(jax.devices())\n", tmp_path,
                                  key=None, env={"JITSERVE_IFRT_CONNECT_TIMEOUT_S": "2", **extra})
            assert refused.returncode != 0 and "Unable to establish connection" in refused.stderr


def test_quotas_are_per_key(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Device bytes and compiles per minute, counted per key: one key past its quotas
    gets errors that name them; the other key's programs run."""
    port = _free_port()
    env = {"JITSERVE_IFRT_PORT": str(port), "JITSERVE_API_KEYS": ",".join(KEYS),
           "JITSERVE_TENANT_MAX_DEVICE_BYTES": str(16 << 20),
           "JITSERVE_TENANT_COMPILES_PER_MINUTE": "4", "JITSERVE_MAX_BODY_BYTES": str(64 << 20)}
    for _url in _serve(tmp_path_factory.mktemp("ifrt-quotas"), env):
        server = {"target": f"127.0.0.1:{port}"}
        greedy = run_program(server, """
            import jax, jax.numpy as jnp, numpy as np
            held = [jax.device_put(np.ones(1 << 20, np.float32)) for _ in range(3)]  # 12 MiB
            jax.block_until_ready(held)
            try:
                jax.device_put(np.ones(2 << 20, np.float32)).block_until_ready()  # 8 MiB more
            except Exception as e:
                print("BYTES", e)
            del held
            for i in range(8):
                try:
                    jax.jit(lambda x, i=i: x * (i + 1.5))(np.ones(3, np.float32)).block_until_ready()
                except Exception as e:
                    print("COMPILES", e)
                    break
        """, tmp_path, key=KEYS[1])
        assert "BYTES" in greedy.stdout and "quota device_bytes" in greedy.stdout, (
            greedy.stdout, greedy.stderr[-2000:])
        assert "COMPILES" in greedy.stdout and "quota compiles_per_minute" in greedy.stdout
        other = run_program(server, """
            import jax, numpy as np
            x = jax.device_put(np.ones(3 << 20, np.float32))  # 12 MiB: within its own quota
            print(float(jax.jit(lambda v: v.sum())(x)))
        """, tmp_path, key=KEYS[0])
        assert other.returncode == 0 and other.stdout.strip() == str(float(3 << 20)), other.stderr[-2000:]


def test_a_keys_futures_and_session_arrays_share_its_quotas(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """One account per key across protocols: what its /v1 futures hold counts against
    its IFRT sessions' quota, and what its sessions hold against its futures'."""
    from jitserve.client import Client
    from jitserve.client.errors import APIError

    port = _free_port()
    env = {"JITSERVE_IFRT_PORT": str(port), "JITSERVE_API_KEYS": ",".join(KEYS),
           "JITSERVE_TENANT_MAX_DEVICE_BYTES": str(16 << 20), "JITSERVE_MAX_BODY_BYTES": str(64 << 20)}
    for url in _serve(tmp_path_factory.mktemp("ifrt-shared-quota"), env):
        server = {"target": f"127.0.0.1:{port}"}
        with Client(url, api_key=KEYS[0]) as client:
            kept = client.device_put(np.ones(3 << 20, np.float32))  # 12 MiB through /v1
            kept.block_until_ready()
            session = run_program(server, """
                import jax, numpy as np
                try:
                    jax.device_put(np.ones(2 << 20, np.float32)).block_until_ready()  # 8 MiB
                except Exception as e:
                    print("BYTES", e)
                print(float(jax.device_put(np.ones(1 << 10, np.float32)).sum()))  # 4 KiB fit
            """, tmp_path, key=KEYS[0])
            assert "BYTES" in session.stdout and "quota device_bytes" in session.stdout, (
                session.stdout, session.stderr[-2000:])
            assert "its /v1 futures 1, holding 12,582,912 bytes" in session.stdout
            assert session.stdout.split()[-1] == "1024.0"
            del kept  # frees its 12 MiB on the server

            path = tmp_path / "holds.py"
            path.write_text(textwrap.dedent("""
                import sys, jax, numpy as np
                x = jax.device_put(np.ones(3 << 20, np.float32))  # 12 MiB through the proxy
                x.block_until_ready()
                print("HELD", flush=True)
                sys.stdin.readline()
            """))
            holder = subprocess.Popen([sys.executable, str(path)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=program_env(server, KEYS[0]))
            try:
                assert holder.stdout is not None and holder.stdin is not None
                assert holder.stdout.readline().strip() == "HELD", holder.stderr
                with pytest.raises(APIError) as refused:
                    client.device_put(np.ones(2 << 20, np.float32)).block_until_ready()
                assert refused.value.status_code == 429 and refused.value.code == "too_many_requests"
                assert "holds 12,582,912 of its 16,777,216 device bytes (of which its IFRT " \
                    "sessions: 1 arrays, 12,582,912 bytes)" in str(refused.value), refused.value
                # Another key's account is its own.
                with Client(url, api_key=KEYS[1]) as other:
                    mine = other.device_put(np.ones(2 << 20, np.float32))
                    assert float(np.asarray(mine).sum()) == float(2 << 20)
                _, err = holder.communicate("\n", timeout=60)  # closes the pipes too
                assert holder.returncode == 0, err
            finally:
                if holder.poll() is None:
                    holder.kill()
                holder.communicate(timeout=10)
            # The session is closed: its 12 MiB no longer count.
            again = client.device_put(np.ones(2 << 20, np.float32))
            assert float(np.asarray(again).sum()) == float(2 << 20)



def test_a_keys_compiles_per_minute_are_one_budget_across_protocols(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    from jitserve.client import Client
    from jitserve.client.errors import APIError

    port = _free_port()
    env = {"JITSERVE_IFRT_PORT": str(port), "JITSERVE_API_KEYS": ",".join(KEYS),
           "JITSERVE_TENANT_COMPILES_PER_MINUTE": "3"}
    x = np.ones(3, np.float32)
    for url in _serve(tmp_path_factory.mktemp("ifrt-shared-compiles"), env):
        with Client(url, api_key=KEYS[0]) as client:
            for scale in (2.0, 3.0):  # two real compiles through /v1
                np.testing.assert_allclose(np.asarray(client.jit(lambda v, s=scale: v * s)(x)),
                                           x * scale)
            session = run_program({"target": f"127.0.0.1:{port}"}, """
                import jax, numpy as np
                x = np.ones(3, np.float32)
                for i in range(4):
                    try:
                        print("RAN", float(jax.jit(lambda v, i=i: (v * (i + 5.5)).sum())(x)))
                    except Exception as e:
                        print("REFUSED", e)
                        break
            """, tmp_path, key=KEYS[0])
            assert "REFUSED" in session.stdout, (session.stdout, session.stderr[-2000:])
            assert "quota compiles_per_minute" in session.stdout
            assert "(2 of them through /v1)" in session.stdout
            assert session.stdout.count("RAN") <= 1  # the one compile left of three
            with pytest.raises(APIError) as refused:
                client.jit(lambda v: v * 4.0)(x).block_until_ready()
            # (The SDK compiles inside the call's future, so the refusal is its error.)
            assert "started 3 compiles in the last minute (1 of them in IFRT sessions)" in \
                str(refused.value), refused.value
        with Client(url, api_key=KEYS[1]) as other:  # another key's budget is its own
            np.testing.assert_allclose(np.asarray(other.jit(lambda v: v * 4.0)(x)), x * 4.0)
