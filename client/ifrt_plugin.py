"""The ``jitserve`` JAX backend: unmodified JAX programs run on a jitserve server.

Installed with ``jitserve[jit]`` and found by jax itself (the ``jax_plugins`` entry
point), so nothing in the program changes::

    JAX_PLATFORMS=jitserve JITSERVE_IFRT_TARGET=gpu-host:50051 JITSERVE_API_KEY=... python train.py

jax then talks to the server with jaxlib's own IFRT proxy client
(``jaxlib._ifrt_proxy``): ``jax.devices()`` lists the server's devices, and every
array, ``jax.jit`` and eager op lives and runs there. This module only registers the
backend and sets the client up:

- ``JITSERVE_IFRT_TARGET`` (``host:port``, or ``grpc://host:port``) is where the server's
  ``JITSERVE_IFRT_PORT`` listens; ``JITSERVE_API_KEY`` goes in the session's
  initialization data; ``JITSERVE_IFRT_CONNECT_TIMEOUT_S`` bounds the first connection.
- The session lives on one group of the server's devices, one of the largest unless
  ``JITSERVE_IFRT_DEVICES=N`` asks for the smallest group of at least N: ``jax.devices()``
  lists that group's, and shardings, ``shard_map`` and ``pmap`` run across them.
- The backend is registered as ``jitserve``, and, once connected, under the platform
  the server reports as well (``cpu``, or ``gpu`` and ``cuda``), so code that names a
  platform (``jax.devices("cpu")``, ``jax.jit(f, backend="cpu")``) finds the server's.
- The client speaks plaintext gRPC (its only other transport is ALTS): use it on
  loopback or a private network (docs/ifrt.md).
- At exit the session is ended cleanly before the interpreter tears down: otherwise
  jaxlib's client logs an error per live executable and aborts the process.
- jax's persistent compilation cache leaves this backend alone (jaxlib's client cannot
  serialize executables; the server caches them).
- ``Device.memory_stats()`` answers ``None`` (jaxlib's client has no way to ask the
  server, and raises), as a local device without statistics does.
- Big transfers reuse the memory the last ones freed, up to
  ``JITSERVE_IFRT_RETAIN_FREED_BYTES`` (1 GiB; ``0``: glibc's defaults), instead of
  fresh pages each time (``_reuse_transfer_memory``).

Imports nothing heavy until jax asks for the backend.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["BACKEND", "initialize"]

BACKEND = "jitserve"
_ALIASES = {"gpu": ("gpu", "cuda"), "cuda": ("cuda", "gpu"), "rocm": ("rocm", "gpu")}
_client: Any = None


def initialize() -> None:
    """Register the backend with jax (called by jax's plugin discovery)."""
    from jax._src import xla_bridge

    # Only where asked for (JAX_PLATFORMS=jitserve): jax tries every registered backend
    # when no platform is named, and this one would connect somewhere, or log why not.
    asked = xla_bridge.config.jax_platforms.value or ""
    if BACKEND not in asked.split(",") or BACKEND in xla_bridge._backend_factories:
        return
    xla_bridge.register_backend_factory(BACKEND, _make_client, priority=-100, fail_quietly=True)


def target() -> str:
    """The server to connect to, as jaxlib's client wants it (``grpc://host:port``).

    A ``grpcs://host:port`` target (the server has ``JITSERVE_IFRT_TLS_CERT``) is reached
    through a TLS forwarder on this machine's loopback (``jitserve.client._tls_forward``):
    jaxlib's client itself speaks only plaintext or ALTS.
    """
    value = os.environ.get("JITSERVE_IFRT_TARGET", "").strip()
    if not value:
        raise RuntimeError("JAX_PLATFORMS=jitserve needs JITSERVE_IFRT_TARGET=host:port "
                           "(a jitserve server's JITSERVE_IFRT_PORT)")
    if value.startswith("grpcs://"):
        host, _, port = value.removeprefix("grpcs://").rpartition(":")
        return f"grpc://127.0.0.1:{_start_forwarder(host.strip('[]'), int(port))}"
    return value if "://" in value else f"grpc://{value}"


def _start_forwarder(host: str, port: int) -> int:
    """Start the TLS forwarder to ``host:port`` as a child process; its loopback port.

    A process, not a thread: jaxlib's client waits for answers holding the GIL, so
    a forwarder thread in this process could never pass them on. The child exits
    when this process does (its stdin closes).
    """
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-m", "jitserve.client._tls_forward", host, str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if not line.isdigit():
        child.kill()
        raise RuntimeError(f"the TLS forwarder to {host}:{port} did not start")
    _forwarders.append(child)  # its stdin stays open as long as this process lives
    return int(line)


_forwarders: list[Any] = []


def _make_client() -> Any:
    global _client
    from jax._src import xla_bridge
    from jaxlib import _ifrt_proxy

    # The client's transport: plaintext gRPC unless told otherwise (its only other
    # choice is ALTS, which needs Google's infrastructure).
    os.environ.setdefault("IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS", "true")
    options = _ifrt_proxy.ClientConnectionOptions()
    options.connection_timeout_in_seconds = int(float(
        os.environ.get("JITSERVE_IFRT_CONNECT_TIMEOUT_S", "30")))
    asked = {"jitserve_api_key": os.environ.get("JITSERVE_API_KEY", ""),
             "jitserve_devices": os.environ.get("JITSERVE_IFRT_DEVICES", "")}
    if any(asked.values()):
        options.initialization_data = {k: v.strip().encode() for k, v in asked.items() if v.strip()}
    _reuse_transfer_memory()  # before the client starts its threads
    with _quiet_stderr():
        client = _ifrt_proxy.get_client(target(), options)
    _client = client
    for name in _ALIASES.get(client.platform, (client.platform,)):
        xla_bridge._backends.setdefault(name, client)
    _pass_strided_inputs_whole()
    _memory_stats_unknown()
    _no_local_executable_cache()
    atexit.register(_end_session)
    return client


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def _reuse_transfer_memory() -> bool:
    """Let jaxlib's client reuse freed memory for big transfers, up to
    ``JITSERVE_IFRT_RETAIN_FREED_BYTES`` (1 GiB by default; ``0`` leaves glibc's
    defaults). ``False`` where nothing was changed (turned off, or no glibc).

    ``np.asarray`` of an array of hundreds of MiB makes the client copy it twice into
    buffers of that size (jaxlib's ``Cord::Flatten`` of the chunks, then the numpy
    array), on a thread of its own. glibc gives every such block fresh pages and
    unmaps it when freed: a thread's arena cannot hold a block over 64 MiB, and blocks
    over 32 MiB are mapped on their own anyway. Fresh pages are what bound the read
    (``perf``: half the client's samples in the kernel zeroing them). So, as
    ``jitserve serve`` does for itself (``service/memory.py``): one arena for the
    process's threads, and blocks under the bound taken from and given back to its
    heap, whose free top is trimmed past the bound. Only with ``JAX_PLATFORMS=jitserve``
    alone: then nothing runs XLA in this process, and the threads that share that arena
    are jaxlib's client's and the program's own.
    """
    from jax._src import xla_bridge

    raw = os.environ.get("JITSERVE_IFRT_RETAIN_FREED_BYTES", "").strip() or str(1 << 30)
    try:
        bound = int(raw)
    except ValueError:
        raise RuntimeError(f"JITSERVE_IFRT_RETAIN_FREED_BYTES={raw!r} is not a number of "
                           "bytes (0 turns it off)") from None
    platforms = {p.strip() for p in (xla_bridge.config.jax_platforms.value or "").split(",")}
    if bound <= 0 or platforms != {BACKEND}:
        return False  # off, or local XLA in this process too, whose threads want their arenas
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc: its allocator decides, as without this
    bound = min(max(bound, 32 << 20), 2**31 - 1)  # glibc's own ceiling; mallopt takes an int
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, bound), (_M_TRIM_THRESHOLD, bound)))


def _pass_strided_inputs_whole() -> None:
    """numpy inputs with zero or negative strides (``np.broadcast_to``, ``x[::-1]``) as
    contiguous copies: jaxlib's client refuses them ("Negative or zero strides are not
    fully supported") before anything reaches the server. Wraps the one call jax moves
    host arrays to devices with, for this backend's devices only."""
    import numpy as np
    from jax._src.interpreters import pxla

    original = pxla.batched_device_put
    if getattr(original, "_jitserve", False):
        return

    def whole(x: Any) -> Any:
        strides = getattr(x, "strides", None)
        if not strides or all(s > 0 for s in strides) or getattr(x, "size", 0) <= 1:
            return x
        if isinstance(x, np.ndarray):
            return np.ascontiguousarray(x)
        # jax 0.8's host literal (``jax._src.literals.TypedNdArray``): a numpy array
        # ``val`` and its ``weak_type``, which the copy keeps.
        val = getattr(x, "val", None)
        if isinstance(val, np.ndarray) and hasattr(x, "weak_type"):
            return type(x)(np.ascontiguousarray(val), x.weak_type)
        return x

    def batched_device_put(aval: Any, sharding: Any, xs: Any, devices: Any, *args: Any,
                           **kwargs: Any) -> Any:
        if devices and getattr(devices[0], "client", None) is _client:
            xs = [whole(x) for x in xs]
        return original(aval, sharding, xs, devices, *args, **kwargs)

    batched_device_put._jitserve = True  # type: ignore[attr-defined]
    pxla.batched_device_put = batched_device_put


def _memory_stats_unknown() -> None:
    """``Device.memory_stats()`` of this backend's devices answers ``None``, as jax's does
    for a device that keeps no statistics (a local CPU's): jaxlib's client raises
    ("MemoryStats is only supported for addressable PjRt devices") and has no request
    that would ask the server, so a program that logs its memory would die of it."""
    try:
        from jaxlib import _jax
        original = _jax.Device.memory_stats
    except (ImportError, AttributeError):  # another jaxlib's layout: its own answer, then
        return
    if getattr(original, "_jitserve", False):
        return

    def memory_stats(self: Any) -> Any:
        if getattr(self, "client", None) is _client:
            return None
        return original(self)

    memory_stats._jitserve = True  # type: ignore[attr-defined]
    memory_stats.__doc__ = original.__doc__
    _jax.Device.memory_stats = memory_stats


def _no_local_executable_cache() -> None:
    """jax's persistent compilation cache (``jax_compilation_cache_dir``) skips this
    backend, as it skips any backend that cannot serialize its executables: jaxlib's
    client cannot ("IFRT service executable does not support `Serialize`"), so with the
    cache configured every compile warned of a failed write. The server caches the
    executables itself, for every session. jax reads the answer from the backend's
    ``supports_executable_serialization``, which jaxlib's clients do not define."""
    try:
        from jaxlib import _jax
        if getattr(_jax.Client, "supports_executable_serialization", None) is None:
            _jax.Client.supports_executable_serialization = property(
                lambda self: self is not _client)
    except (ImportError, AttributeError, TypeError):  # another jaxlib: jax's default, then
        pass


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Connecting, jaxlib's client warns on every run that its credentials are plaintext
    (which is the point: docs/ifrt.md); its failures still come back as exceptions.
    ``JITSERVE_IFRT_LOGS=1`` shows its logs (jax itself sets ``TF_CPP_MIN_LOG_LEVEL``,
    so that cannot tell)."""
    if os.environ.get("JITSERVE_IFRT_LOGS"):
        yield
        return
    import sys

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _end_session() -> None:
    """Drop every executable and array while the session is still up, then let go of
    the client: what is destroyed after gRPC has shut down makes jaxlib's client
    abort the process."""
    global _client
    if _client is None:
        return
    import gc

    import jax
    from jax._src import xla_bridge

    if not os.environ.get("JITSERVE_IFRT_LOGS"):
        _mute_native_stderr()
    try:
        jax.clear_caches()
        for array in _client.live_arrays():
            array.delete()
    except Exception:  # noqa: BLE001 - exiting anyway; never mask the program's own status
        pass
    xla_bridge._clear_backends()
    _client = None
    gc.collect()


def _mute_native_stderr() -> None:
    """From here to the end of the process, what native code writes to descriptor 2
    is dropped; Python's ``sys.stderr`` keeps writing where it did.

    Letting go of jaxlib's client (here, or in the interpreter's teardown) makes it log
    a warning and a stack trace ("IFRT proxy server disconnected: CANCELLED") after
    the program's work is done: noise on every run.
    """
    import sys

    try:
        sys.stderr.flush()
        kept = os.dup(2)
        sys.stderr = open(kept, "w", buffering=1, encoding=sys.stderr.encoding,  # noqa: SIM115
                          errors=sys.stderr.errors, closefd=True)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
