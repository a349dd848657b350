"""XLA compiles in worker processes.

A compile runs in a separate process so that (1) its time limit is real — a
worker past the limit is killed, not abandoned on a thread — and (2) XLA aborting
on a hostile module takes down a worker, never the server. The worker returns
the serialized executable; the server loads it, exactly as on an L2 hit.

The pipe carries bytes only (``send_bytes``/``recv_bytes``): a module in, a
status byte plus the executable or an error message out.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from jitserve.compiler.errors import CompileFailed, CompileTimeout

__all__ = ["CompilePool", "Pipe", "compile_options", "configure_jax", "device_count"]

logger = logging.getLogger("jitserve.compiler.worker")

_OK, _ERR = b"K", b"E"
# A request that starts with this byte carries its compile options before the module
# (4-byte length, a serialized ``CompileOptionsProto``); MLIR bytecode and text never
# start with it.
_WITH_OPTIONS = b"\x01"


def configure_jax() -> None:
    """The process-wide jax settings programs run under; called where a process starts.

    - x64 on, so that float64 and complex128 programs run as written (jax's default
      would silently narrow them while lowering).
    - jaxlib's linear-algebra kernels made ready. jaxlib hands its LAPACK kernels
      their BLAS/LAPACK entry points only when jax's own linalg lowering runs
      (``initialize_lapack``), and the GPU hybrid kernels likewise. A raw StableHLO
      program never lowers through jax, so without this its first ``lapack_*``
      custom call jumps through a null pointer and kills the process.
    """
    import jax
    from jax._src.lax import linalg
    from jaxlib import gpu_solver

    jax.config.update("jax_enable_x64", True)
    linalg.initialize_lapack()
    gpu_solver.initialize_hybrid_kernels()


def compile_options(partitions: int = 1, replicas: int = 1,
                    device_ids: tuple[int, ...] | None = None,
                    overrides: Sequence[tuple[str, Any]] = ()) -> Any:
    """The XLA compile options of jitserve's executables (their digest is in the key):
    SPMD over ``partitions`` devices, or ``replicas``, on the first devices of the
    process, in order (the device assignment is the same for every process and
    executable of that size, so it is no part of a key but their count).
    ``device_ids``: another assignment, to load an executable onto other devices
    (``Compiler.on_device``). ``overrides``: a caller's ``compiler_options``, checked
    (``compiler.options``), as ``jax.jit`` passes its own to XLA."""
    import numpy as np
    from jax._src import compiler

    env = dict(overrides) if overrides else None
    if partitions == replicas == 1 and device_ids is None:
        return compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                            env_options_overrides=env)
    ids = device_ids if device_ids is not None else range(replicas * partitions)
    assignment = np.array(ids).reshape(replicas, partitions)
    return compiler.get_compile_options(num_replicas=replicas, num_partitions=partitions,
                                        device_assignment=assignment, env_options_overrides=env)


def device_count(options: Any) -> int:
    """The devices an executable compiled with ``options`` runs on."""
    build = options.executable_build_options
    return max(1, int(build.num_replicas)) * max(1, int(build.num_partitions))


def _worker_main(conn: Pipe) -> None:
    from jax._src.lib import xla_client as xc
    from jax.extend import backend as xb

    configure_jax()
    backend = xb.get_backend()
    default_options = compile_options()
    try:
        conn.send_bytes(_OK)  # ready
    except OSError:
        return  # whoever started this worker is gone (a runtime killed while it warmed up)
    while True:
        try:
            module = conn.recv_bytes()
        except EOFError:
            return
        options = default_options
        try:
            if module[:1] == _WITH_OPTIONS:  # an IFRT proxy client's own (sanitized) options
                size = int.from_bytes(module[1:5], "big")
                options = xc.CompileOptions.ParseFromString(module[5:5 + size])
                module = module[5 + size:]
            devices = backend.devices()[:device_count(options)]
            exe = backend.compile_and_load(module, xc.DeviceList(tuple(devices)), options)
            reply = _OK + backend.serialize_executable(exe)
        except Exception as e:  # XLA's refusal, returned to the caller as text
            reply = _ERR + str(e).encode("utf-8", "replace")[:8000]
        conn.send_bytes(reply)


class _Worker:
    """One ``python -m compiler._compile_worker`` process and the pipes to it.

    A plain subprocess, not multiprocessing's spawn: nothing re-imports the
    caller's ``__main__``, and nothing is pickled.
    """

    def __init__(self, env: dict[str, str]) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # The same interpreter, which has jitserve installed: no sys.path games, so
        # the worker sees exactly the packages the server does.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jitserve.compiler._compile_worker", str(to_child_r),
             str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
            env={**os.environ, **env})
        os.close(to_child_r)
        os.close(from_child_w)
        self.conn = Pipe(from_child_r, to_child_w)
        self.ready = False

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        self.conn.close()


class Pipe:
    """Both directions between two processes: two pipes, framed as multiprocessing does.

    The compile workers use it, and so do the service's runtime processes.
    """

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._r = Connection(read_fd, writable=False)
        self._w = Connection(write_fd, readable=False)

    def send_bytes(self, data: bytes) -> None:
        self._w.send_bytes(data)

    def recv_bytes(self) -> bytes:
        return self._r.recv_bytes()

    def poll(self, timeout: float) -> bool:
        return self._r.poll(timeout)

    def fileno(self) -> int:
        """The descriptor answers are read from."""
        return self._r.fileno()

    def writer_fileno(self) -> int:
        """The descriptor ``send_bytes`` writes to."""
        return self._w.fileno()

    def close(self) -> None:
        for conn in (self._r, self._w):
            try:
                conn.close()
            except OSError:
                pass


class CompilePool:
    """At most ``workers`` compiles at once, each in a worker process with a time limit."""

    def __init__(self, *, workers: int, timeout_s: float, platform: str) -> None:
        self.timeout_s = timeout_s
        self._env = {"JAX_PLATFORMS": platform, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                     "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
        self._slots = threading.BoundedSemaphore(max(1, workers))
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def warm(self) -> None:
        """Start one worker now, so the first compile does not pay for jax's import."""
        with self._slots:
            worker = self._take()
            try:
                self._wait_ready(worker, deadline=time.monotonic() + 120)
            except CompilerTimeoutOrCrash:
                return
            self._give_back(worker)

    def compile(self, module: bytes, options: bytes | None = None) -> bytes:
        """Compile a StableHLO module (bytecode); the serialized executable.

        ``options``: a serialized ``CompileOptionsProto`` to compile with instead of
        ``compile_options()``: a sharded program's, or an IFRT proxy client's (already
        sanitized: ``compiler.ifrt.sanitize_options``). It runs on the first
        ``device_count(options)`` devices.
        """
        if options is not None:
            module = _WITH_OPTIONS + len(options).to_bytes(4, "big") + options + module
        with self._slots:
            worker = self._take()
            deadline = time.monotonic() + self.timeout_s
            try:
                self._wait_ready(worker, deadline + 60)  # a cold start is not the program's fault
                worker.conn.send_bytes(module)
                reply = self._receive(worker, deadline)
            except CompilerTimeoutOrCrash as e:
                worker.kill()
                raise e.error from None
            self._give_back(worker)
        if reply[:1] == _ERR:
            raise CompileFailed(f"XLA could not compile the program: {reply[1:].decode()}")
        return reply[1:]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise CompileFailed("the compiler is shut down")
            if self._idle:
                return self._idle.pop()
        return _Worker(self._env)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _wait_ready(self, worker: _Worker, deadline: float) -> None:
        if not worker.ready:
            if self._receive(worker, deadline) != _OK:
                raise CompilerTimeoutOrCrash(CompileFailed("compile worker failed to start"))
            worker.ready = True

    def _receive(self, worker: _Worker, deadline: float) -> bytes:
        try:
            if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                raise CompilerTimeoutOrCrash(CompileTimeout(
                    f"compile ran past its time limit of {self.timeout_s:g} s and was stopped"))
            return worker.conn.recv_bytes()
        except (EOFError, OSError):
            try:
                code = worker.process.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            raise CompilerTimeoutOrCrash(CompileFailed(
                f"XLA crashed while compiling the program (worker exit code {code})")) from None


class CompilerTimeoutOrCrash(Exception):
    """Internal: the worker must be killed; ``error`` is what the caller sees."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error

