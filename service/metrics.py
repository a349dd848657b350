"""Prometheus metrics, in a registry of their own per app (so tests do not collide).

Names (the Grafana dashboard and the acceptance tests read these)::

    jitserve_requests_total{route,status}     route is the template, e.g. /v1/futures/{future_id}
    jitserve_compilations_total               compiles that ran XLA
    jitserve_compile_seconds                  histogram of those compiles
    jitserve_cache_hits_total{tier}           memory | disk | redis
    jitserve_cache_misses_total
    jitserve_executions_total{status}         done | failed | cancelled
    jitserve_execute_seconds                  histogram of run time on the device
    jitserve_futures{state}                   live futures by state
    jitserve_device_bytes_in_use              output bytes held by live futures, and
                                              host inputs of calls not yet finished
    jitserve_transfer_bytes_total{direction}  array bytes decoded from requests (in)
                                              and encoded into responses (out)
    jitserve_redis_errors_total               failed Redis commands and probes
    jitserve_redis_bytes_total{direction}     entry and program bytes read from and
                                              written to Redis (read | written)
    jitserve_request_bodies_aborted_total{reason}
                                              bodies that did not arrive whole: the client
                                              disconnected (disconnect, counted as status
                                              499 above) or stalled (timeout, status 400)
    jitserve_connections_closed_total{reason} connections the server closed before a request
                                              head arrived whole (header_timeout,
                                              header_too_large)
    jitserve_execution_temp_bytes             device bytes of intermediates (XLA temp
                                              buffers) of executions in flight
    jitserve_runtimes_up                      runtime processes up (of jitserve_runtimes)
    jitserve_runtime_restarts_total{reason}   runtimes that exited and were restarted:
                                              timeout (an execution's deadline),
                                              request_timeout (an upload's, a lookup's), cancel,
                                              signal (a crash: SIGSEGV, SIGKILL, ...), exit
    jitserve_runtime_start_failures_total     runtime processes that died before ready
    jitserve_runs_resent_total                runs sent again: their runtime was lost
                                              while they were queued there
    jitserve_runtime_restart_seconds          the last restart, from exit to ready
    jitserve_runtime_moves_total              outputs moved between runtimes (a call on
    jitserve_runtime_move_bytes_total         one took a future that lives on another)
    jitserve_batch_calls                      histogram of calls per batched run, and
    jitserve_batch_rows                       of rows (before padding to a bucket)
                                              (docs/batching.md)
    jitserve_device_runs_total{device}        runs on each of the host's devices
    jitserve_runtime_relaid_total             kept outputs moved to another layout
    jitserve_runtime_runs_waited_total        runs sent ahead that waited in their runtime
                                              for the run making their inputs
    jitserve_device_memory_bytes{device,kind} each device's memory: in_use (on the CPU,
                                              the runtimes' live arrays there), and limit
                                              and peak where XLA reports them (GPU)
    jitserve_gc_frozen_objects                objects this process's garbage collector
                                              leaves out: what the server made to start
    python_gc_collections_total{generation}   prometheus_client's: collections, and the
    python_gc_objects_collected_total{...}    objects they freed, by generation
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jitserve.wire import FutureStatus, TierName

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "RequestMetricsMiddleware"]

_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Observations of a histogram kept before they are filed (``Metrics.observe``).
_OBSERVED_KEPT = 1024


class Metrics:
    """The server's metrics, registered in their own ``CollectorRegistry``."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # Every cached call counts itself six times over (its request, lookup, bytes
        # in and out, execution and run time). Those counts are tallied here and
        # filed into the metrics when they are read (``render``): a prometheus
        # ``inc`` goes through three layers and a lock, and on a call's path, where
        # none of that code is warm in the CPU's caches, the six cost 2-3% of it.
        self._tally: dict[Any, float] = {}
        self._observed: dict[Any, list[float]] = {}
        self._filing = threading.Lock()
        self.requests = Counter("jitserve_requests", "HTTP requests by route template and status",
                                ["route", "status"], registry=r)
        self.compilations = Counter("jitserve_compilations", "XLA compilations", registry=r)
        self.compile_seconds = Histogram("jitserve_compile_seconds", "XLA compile time",
                                         buckets=_SECONDS, registry=r)
        self.cache_hits = Counter("jitserve_cache_hits", "executable cache hits by tier",
                                  ["tier"], registry=r)
        self.cache_misses = Counter("jitserve_cache_misses", "executable cache misses", registry=r)
        self.executions = Counter("jitserve_executions", "finished executions by status",
                                  ["status"], registry=r)
        self.execute_seconds = Histogram("jitserve_execute_seconds", "run time on the device",
                                         buckets=_SECONDS, registry=r)
        self.futures = Gauge("jitserve_futures", "live futures by state", ["state"], registry=r)
        self.device_bytes = Gauge("jitserve_device_bytes_in_use",
                                  "output bytes held by live futures", registry=r)
        self.transfer_bytes = Counter("jitserve_transfer_bytes", "array bytes moved over HTTP",
                                      ["direction"], registry=r)
        # Errors talking to the shared Redis cache tier; 0 on the embedded default.
        self.redis_errors = Counter("jitserve_redis_errors", "errors talking to Redis", registry=r)
        self.redis_bytes = Counter("jitserve_redis_bytes", "bytes moved to and from Redis",
                                   ["direction"], registry=r)
        self._redis_seen = {"errors": 0, "bytes_read": 0, "bytes_written": 0}
        # Replicas (service/cluster/): bytes forwarded to and received from other
        # replicas, and replicas this one saw lost.
        self.peer_bytes_total = Counter("jitserve_peer_bytes", "bytes moved between replicas",
                                        ["direction"], registry=r)
        self.replicas_lost = Counter("jitserve_replicas_lost", "replicas noticed lost",
                                     registry=r)
        # Memory and connections: requests and connections cut short, and the scratch
        # memory of running programs (service/api/bodies.py, connections.py, executor.py).
        self.bodies_aborted = Counter("jitserve_request_bodies_aborted",
                                      "request bodies that did not arrive whole, by reason",
                                      ["reason"], registry=r)
        self.connections_closed = Counter("jitserve_connections_closed",
                                          "connections closed before a whole request head",
                                          ["reason"], registry=r)
        # JAX's IFRT proxy (service/ifrt): sessions, requests by type, bytes each way,
        # compiles by tier, refusals by status and requests per batch to the runtime.
        self.ifrt_sessions = Gauge("jitserve_ifrt_sessions", "open IFRT proxy sessions",
                                   registry=r)
        self.ifrt_sessions_closed = Counter("jitserve_ifrt_sessions_closed",
                                            "IFRT proxy sessions ended, by reason", ["reason"],
                                            registry=r)
        self.ifrt_requests = Counter("jitserve_ifrt_requests",
                                     "IFRT proxy requests by type and answer status",
                                     ["type", "status"], registry=r)
        self.ifrt_compiles = Counter("jitserve_ifrt_compiles",
                                     "IFRT proxy compiles by the tier that served them",
                                     ["tier"], registry=r)
        self.ifrt_bytes = Counter("jitserve_ifrt_bytes", "host-buffer bytes moved by the IFRT proxy",
                                  ["direction"], registry=r)
        self.ifrt_batch_requests = Histogram("jitserve_ifrt_batch_requests",
                                             "IFRT proxy requests per batch sent to a runtime",
                                             buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                                             registry=r)
        # This process's garbage collector: collections and what they found, by
        # generation (python_gc_*), and the objects left out of them
        # (``memory.freeze_startup_objects``: what the server made to start).
        GCCollector(registry=r)
        # Set once, when frozen (``cli.serve``).
        self.gc_frozen = Gauge("jitserve_gc_frozen_objects", "objects the garbage collector "
                               "leaves out: those the server made to start", registry=r)
        self.runtimes_up = Gauge("jitserve_runtimes_up", "runtime processes up", registry=r)
        self.runtimes_count = Gauge("jitserve_runtimes", "runtime processes", registry=r)
        self.runtime_restarts = Counter("jitserve_runtime_restarts",
                                        "runtime restarts by reason", ["reason"], registry=r)
        self.runs_resent = Counter("jitserve_runs_resent",
                                   "runs sent again after their runtime was lost before they began",
                                   registry=r)
        self.runtime_start_failures = Counter("jitserve_runtime_start_failures",
                                              "runtimes that died before ready", registry=r)
        self.runtime_restart_seconds = Gauge("jitserve_runtime_restart_seconds",
                                             "the last runtime restart, exit to ready",
                                             registry=r)
        self.runtime_moves = Counter("jitserve_runtime_moves",
                                     "outputs moved between runtimes", registry=r)
        self.runtime_move_bytes = Counter("jitserve_runtime_move_bytes",
                                          "bytes of outputs moved between runtimes", registry=r)
        self.runtime_relaid = Counter(
            "jitserve_runtime_relaid", "kept outputs moved device to device to the layout a "
            "run wanted (sharded programs), or gathered for a single-device one", registry=r)
        self.runtime_runs_waited = Counter(
            "jitserve_runtime_runs_waited", "runs sent ahead that waited in their runtime for "
            "the run making their inputs to end (docs/runtimes.md)", registry=r)
        self._seen: collections.Counter[str] = collections.Counter()
        self.device_memory_bytes = Gauge(
            "jitserve_device_memory_bytes", "each device's memory: in_use (on the CPU, the "
            "runtimes' live arrays there), and limit and peak where XLA reports them",
            ["device", "kind"], registry=r)
        self.device_runs = Counter("jitserve_device_runs", "runs on each of the host's devices "
                                   "(a sharded run counts on its first)", ["device"], registry=r)
        self._device_runs_seen: dict[int, int] = {}
        self._runtimes_seen: dict[str, int] = {}
        self.execution_temp_bytes = Gauge("jitserve_execution_temp_bytes",
                                          "device bytes of intermediates of running executions",
                                          registry=r)
        # Dynamic batching (service/calls/batching.py): the calls and rows of each batched run.
        self.batch_calls = Histogram("jitserve_batch_calls", "calls per batched run",
                                     buckets=_BATCH, registry=r)
        self.batch_rows = Histogram("jitserve_batch_rows", "rows per batched run, unpadded",
                                    buckets=_BATCH, registry=r)
        for reason in ("disconnect", "timeout"):
            self.bodies_aborted.labels(reason)
        for reason in ("header_timeout", "header_too_large"):
            self.connections_closed.labels(reason)
        # Series present at 0 from the start, so rates and dashboards need no special case.
        for direction in ("in", "out"):
            self.transfer_bytes.labels(direction)
        for direction in ("read", "written"):
            self.redis_bytes.labels(direction)
        for tier in (TierName.MEMORY, TierName.DISK, TierName.REDIS):
            self.cache_hits.labels(tier)
        for status in FutureStatus:
            if status.is_final:
                self.executions.labels(status)

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, kept: the call validates and locks each time,
        a cost every cached call paid four times over. Label values are bounded
        (route templates, statuses, tiers), and so is this."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def count(self, metric: Any, *values: str, amount: float = 1) -> None:
        """``metric.labels(*values).inc(amount)``, tallied until the metrics are read."""
        child = self.child(metric, *values)
        with self._filing:
            tally = self._tally
            tally[child] = tally.get(child, 0) + amount

    def observe(self, histogram: Any, value: float) -> None:
        """``histogram.observe(value)``, kept until the metrics are read (or until
        ``_OBSERVED_KEPT`` observations wait)."""
        with self._filing:
            kept = self._observed.get(histogram)
            if kept is None:
                kept = self._observed[histogram] = []
            kept.append(value)
            full = len(kept) >= _OBSERVED_KEPT
        if full:
            self.file()

    def file(self) -> None:
        """Put the tallied counts and kept observations into the metrics."""
        with self._filing:
            tally, self._tally = self._tally, {}
            observed, self._observed = self._observed, {}
        for child, amount in tally.items():
            child.inc(amount)
        for histogram, values in observed.items():
            for value in values:
                histogram.observe(value)

    def request(self, route: str, status: int) -> None:
        """Count one HTTP request answered with ``status`` by ``route`` (a template)."""
        self.count(self.requests, route, str(status))

    def lookup(self, tier: str, compile_seconds: float) -> None:
        """Count one executable lookup that ended in ``tier``."""
        if tier == TierName.COMPILED:
            self.cache_misses.inc()
            self.compilations.inc()
            self.compile_seconds.observe(compile_seconds)
        else:
            self.count(self.cache_hits, tier)

    def transferred(self, direction: str, nbytes: int) -> None:
        """Count array bytes moved ``"in"`` (requests) or ``"out"`` (responses)."""
        self.count(self.transfer_bytes, direction, amount=nbytes)

    def run_resent(self) -> None:
        """Count a run sent again: its runtime was lost before the run began there."""
        self.runs_resent.inc()

    def replica_lost(self) -> None:
        """Count a replica noticed lost."""
        self.replicas_lost.inc()

    def body_aborted(self, reason: str) -> None:
        """Count a request body cut short: ``"disconnect"`` or ``"timeout"``."""
        self.bodies_aborted.labels(reason).inc()

    def connection_closed(self, reason: str) -> None:
        """Count a connection closed for its head: ``"header_timeout"``, ``"header_too_large"``."""
        self.connections_closed.labels(reason).inc()

    def execution_finished(self, status: str) -> None:
        self.count(self.executions, status)

    def redis(self, stats: Mapping[str, Any]) -> None:
        """Bring the Redis series up to ``Catalog.shared_stats()`` (its counters are monotonic)."""
        seen = self._redis_seen
        self.redis_errors.inc(max(0, stats["errors"] - seen["errors"]))
        self.redis_bytes.labels("read").inc(max(0, stats["bytes_read"] - seen["bytes_read"]))
        self.redis_bytes.labels("written").inc(
            max(0, stats["bytes_written"] - seen["bytes_written"]))
        self._redis_seen = {k: max(seen[k], stats[k]) for k in seen}

    def runtimes(self, stats: Mapping[str, Any]) -> None:
        """Bring the runtime series up to ``RuntimePool.stats()`` (its counters are monotonic)."""
        self.runtimes_up.set(stats["up"])
        self.runtimes_count.set(stats["count"])
        if stats.get("last_restart_s") is not None:
            self.runtime_restart_seconds.set(stats["last_restart_s"])
        seen = self._runtimes_seen
        for name, value in stats["counters"].items():
            delta = value - seen.get(name, 0)
            if delta <= 0:
                continue
            seen[name] = value
            if name.startswith("restarts:"):
                self.runtime_restarts.labels(name.partition(":")[2]).inc(delta)
            elif name == "start_failures":
                self.runtime_start_failures.inc(delta)
            elif name == "moves":
                self.runtime_moves.inc(delta)
            elif name == "move_bytes":
                self.runtime_move_bytes.inc(delta)

    def relaid(self, total: int) -> None:
        """Bring ``jitserve_runtime_relaid_total`` up to the runtimes' count (``RuntimePool.report``)."""
        self._catch_up(self.runtime_relaid, "relaid", total)

    def runs_waited(self, total: int) -> None:
        """Bring ``jitserve_runtime_runs_waited_total`` up to the runtimes' count."""
        self._catch_up(self.runtime_runs_waited, "runs_waited", total)

    def _catch_up(self, counter: Counter, key: str, total: int) -> None:
        if total > self._seen[key]:
            counter.inc(total - self._seen[key])
            self._seen[key] = total

    def runs_by_device(self, totals: Mapping[int, int]) -> None:
        """Bring ``jitserve_device_runs_total`` up to the runtimes' counts, by host device id."""
        for device, total in totals.items():
            seen = self._device_runs_seen.get(device, 0)
            if total > seen:
                self.device_runs.labels(str(device)).inc(total - seen)
                self._device_runs_seen[device] = total

    def device_memory(self, by_device: Mapping[int, Mapping[str, int]]) -> None:
        """Set ``jitserve_device_memory_bytes`` from the runtimes' reports, by host device id."""
        for device, stats in by_device.items():
            for kind, value in stats.items():
                self.device_memory_bytes.labels(str(device), kind).set(value)

    def render(self, futures_by_state: Mapping[str, int], device_bytes: int) -> bytes:
        """The Prometheus text exposition, with the gauges brought up to date."""
        for state, n in futures_by_state.items():
            self.futures.labels(state).set(n)
        self.device_bytes.set(device_bytes)
        self.file()
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Counts every HTTP request by route template and status code.

    A pure ASGI middleware (no response buffering, so big results stream through).
    Requests that match no route count under ``route="unmatched"``, which keeps
    the label's values bounded whatever paths clients try.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.request(route, status)
