"""The runtime protocol (``service.runtimes.protocol``), against real runtime processes.

Every request the API process sends has a handler in the runtime's table, and
nothing else has one; no op is spelled as a string outside the protocol. A
request with an op the runtime has no handler for, or one that is no map, is
answered with a protocol error that names it, and the runtime serves on. Each
answer carries the fields its type declares. The API process trusts no reply: one
that is no map stops the reading (the runtime is killed as garbled), and one whose
id no request has is dropped.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NotRequired, get_origin, get_type_hints

import numpy as np
import pytest

import jitserve.service
from jitserve.service.runtimes import Op, RemoteError, RuntimeLost, RuntimePool, child, frames
from jitserve.service.runtimes import protocol as p

SERVICE = Path(jitserve.service.__file__).parent
# Where the runtime's side of the protocol is written; everything else is the API process's.
RUNTIME_SIDE = {SERVICE / "runtimes" / "child.py", SERVICE / "runtimes" / "protocol.py"}
SENDERS = {"request", "send", "send_then", "broadcast", "ask"}


def _api_side() -> list[tuple[Path, ast.AST]]:
    return [(path, ast.parse(path.read_text(), str(path)))
            for path in sorted(SERVICE.rglob("*.py")) if path not in RUNTIME_SIDE]


def test_the_runtime_handles_every_op_the_api_process_sends_and_nothing_else() -> None:
    named = {Op[node.attr] for _, tree in _api_side() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
             and node.value.id == "Op"}
    assert named == set(Op)  # every op has a sender
    assert set(child.HANDLERS) == named
    assert all(callable(handler) for handler in child.HANDLERS.values())


def test_no_op_is_a_string_outside_the_protocol() -> None:
    spelled = []
    for path, tree in _api_side():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and _name(node.func) in SENDERS:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    spelled.append(f"{path.name}:{node.lineno}: {first.value!r}")
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if (isinstance(key, ast.Constant) and key.value in ("op", "kind")
                            and isinstance(value, ast.Constant)):
                        spelled.append(f"{path.name}:{node.lineno}: {key.value}={value.value!r}")
    assert spelled == []


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


@pytest.mark.parametrize("op", ["nonsense", "op_run", "_send", "", 7, ["run"], None])
async def test_an_unknown_op_is_a_protocol_error_and_the_runtime_serves_on(
        runtimes: RuntimePool, op: Any) -> None:
    runtime = runtimes.runtimes[0]
    pid, restarts = runtime.pid, runtime.restarts
    with pytest.raises(RemoteError) as caught:
        await runtime.request(op, {}, timeout_s=60)
    assert not isinstance(caught.value, RuntimeLost)
    assert caught.value.code == "internal"
    assert f"protocol error: a runtime has no op {op!r}" in str(caught.value)
    assert "it answers decode, program, lookup, run" in str(caught.value)
    stats = await runtime.request(Op.STATS, {}, timeout_s=60)
    assert stats["buffers"] >= 0
    assert (runtime.pid, runtime.restarts) == (pid, restarts)


def test_a_runtime_answers_what_is_no_request_and_serves_on(runtimes: RuntimePool) -> None:
    """A runtime of its own, spoken to frame by frame: the answers the pool would
    drop (``id`` 0) are seen here."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "jitserve.service.runtimes.child", str(to_child_r),
         str(from_child_w)], pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
        env=runtimes.child_env(runtimes.runtimes[0]))
    os.close(to_child_r)
    os.close(from_child_w)
    pipe = frames.Pipe(from_child_r, to_child_w)

    def answer(message: Any) -> dict[str, Any]:
        pipe.send_bytes(frames.pack(message))
        assert pipe.poll(60), "no answer"
        return frames.unpack(pipe.recv_bytes())

    try:
        ready = answer(runtimes.child_config(0))
        assert (ready["id"], ready["kind"], ready["pid"]) == (0, "ready", process.pid)
        assert answer([1, 2]) == {"id": 0, "kind": "error", "code": "internal",
                                  "message": "protocol error: a request is a map, not [1, 2]"}
        refused = answer({"id": 5, "op": "nonsense"})
        assert (refused["id"], refused["kind"], refused["code"]) == (5, "error", "internal")
        assert "no op 'nonsense'" in refused["message"]
        stats = answer({"id": 6, "op": Op.STATS})
        assert (stats["id"], stats["kind"]) == (6, "ok")
        assert process.poll() is None
    finally:
        pipe.close()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    assert process.returncode == 0  # its pipe closed: it ended, not crashed


def _fields(typed: type) -> tuple[set[str], set[str]]:
    """The keys a TypedDict requires, and all it allows (``NotRequired`` read from the
    annotations: ``__required_keys__`` misses it under ``from __future__ import
    annotations`` before Python 3.14)."""
    hints = get_type_hints(typed, include_extras=True)
    if not typed.__total__:  # type: ignore[attr-defined]
        return set(), set(hints)
    return {k for k, v in hints.items() if get_origin(v) is not NotRequired}, set(hints)


def _check(answer: dict[str, Any], typed: type) -> None:
    required, allowed = _fields(typed)
    got = set(answer) - {"id", "kind", "generation"}  # the envelope, and the pool's mark
    assert required <= got <= allowed, (typed.__name__, sorted(got))


async def test_each_answer_carries_the_fields_its_type_declares(
        runtimes: RuntimePool, programs: dict[str, bytes]) -> None:
    runtime = runtimes.runtimes[0]
    data = programs["add_mul"]
    program_id = hashlib.sha256(data).hexdigest()
    (desc,), _ = frames.pack_arrays([np.frombuffer(data, np.uint8)], None)
    decode: p.DecodeRequest = {"program": desc, "format": "jax_export"}
    _check(await runtime.request(Op.DECODE, decode, timeout_s=60), p.DecodeAnswer)
    _check(await runtime.request(Op.PROGRAM, {"program_id": program_id}, timeout_s=60),
           p.ProgramAnswer)
    lookup: p.LookupRequest = {"program_id": program_id, "static_key": "", "donate": [],
                               "avals": None}
    found = await runtime.request(Op.LOOKUP, lookup, timeout_s=120)
    _check(found, p.LookupAnswer)
    exe = found["executable"]
    _check(exe, p.ExecutableDoc)

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    args, _ = frames.pack_arrays([x, x], None)
    run: p.RunRequest = {"executable_id": exe["executable_id"], "program_id": program_id,
                         "static_key": "", "donate": [], "avals": exe["in_avals"], "args": args}
    ran = await runtime.request(Op.RUN, run, timeout_s=60)
    _check(ran, p.RunAnswer)
    fetched = await runtime.request(Op.FETCH, {"handles": ran["handles"]}, timeout_s=60)
    _check(fetched, p.FetchAnswer)
    np.testing.assert_array_equal(frames.unpack_arrays(fetched["arrays"])[0], x + x)
    runtime.send_free(ran["handles"], ran["generation"])

    put: p.PutRequest = {"args": args}
    kept = await runtime.request(Op.PUT, put, timeout_s=60)
    _check(kept, p.PutAnswer)
    runtime.send_free(kept["handles"], kept["generation"])
    _check(await runtime.request(Op.FORGET, {"executable_id": "0" * 64}, timeout_s=60),
           p.ForgetAnswer)
    _check(await runtime.request(Op.STATS, {}, timeout_s=60), p.StatsAnswer)


@pytest.mark.parametrize("rid", [[1], {"a": 1}, 12345, None], ids=repr)
@pytest.mark.parametrize("kind", ["ok", "started", "error"])
def test_a_reply_whose_id_no_request_has_is_dropped(rid: Any, kind: str) -> None:
    config: p.Config = {"settings": {}, "platform": "cpu", "max_memory_bytes": None,
                        "log_level": "warning", "isolate_network": False}
    runtime = RuntimePool(1, config, {}).runtimes[0]  # never started: nothing in flight
    runtime._dispatch({"id": rid, "kind": kind})
    assert runtime.in_flight() == []


def test_a_runtime_out_of_memory_outside_any_request_exits_saying_so() -> None:
    """Under too small an address-space cap a runtime cannot load jax's libraries or
    start its threads: it exits with ``EXIT_OUT_OF_MEMORY``, which the pool reports
    naming the cap, not as a bare exit status. (The settings refuse a cap under 1 GiB,
    and 1 GiB starts, so no real runtime shows it here.)"""
    from jitserve.service.runtimes.child import _out_of_memory
    from jitserve.service.runtimes.pool import _exit_reason
    from jitserve.service.runtimes.protocol import EXIT_OUT_OF_MEMORY

    assert _out_of_memory(RuntimeError("can't start new thread"))
    assert _out_of_memory(OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert _out_of_memory(ImportError("libjax_common.so: failed to map segment from shared object"))
    assert _out_of_memory(MemoryError())
    assert not _out_of_memory(RuntimeError("dictionary changed size during iteration"))
    assert not _out_of_memory(OSError(errno.EBADF, "Bad file descriptor"))
    reason = _exit_reason(EXIT_OUT_OF_MEMORY, None)
    assert "ran out of memory" in reason and "JITSERVE_RUNTIME_MAX_MEMORY_BYTES" in reason
    assert _exit_reason(1, None) == "exited with status 1"
