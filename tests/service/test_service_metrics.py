"""Metrics a cached call tallies (``Metrics.count``, ``Metrics.observe``) reach the
exposition whole, whichever thread counted them."""

from __future__ import annotations

import threading

from jitserve.service.metrics import Metrics


def test_tallied_counts_are_filed_when_the_metrics_are_read() -> None:
    metrics = Metrics()
    metrics.request("/v1/programs/{program_id}/execute", 200)
    metrics.transferred("in", 4096)
    metrics.lookup("memory", 0.0)
    metrics.execution_finished("done")
    sample = metrics.registry.get_sample_value
    route = {"route": "/v1/programs/{program_id}/execute", "status": "200"}
    assert not sample("jitserve_requests_total", route)  # tallied, not filed yet
    text = metrics.render({}, 0).decode()
    assert 'jitserve_requests_total{route="/v1/programs/{program_id}/execute",status="200"} 1.0' \
        in text
    assert sample("jitserve_transfer_bytes_total", {"direction": "in"}) == 4096
    assert sample("jitserve_cache_hits_total", {"tier": "memory"}) == 1
    assert sample("jitserve_executions_total", {"status": "done"}) == 1


def test_counts_from_many_threads_are_all_filed() -> None:
    metrics = Metrics()
    per_thread, threads = 5000, 4

    def count() -> None:
        for _ in range(per_thread):
            metrics.request("/healthz", 200)
            metrics.observe(metrics.execute_seconds, 0.002)

    def read() -> None:  # filing meanwhile, as a scrape would
        for _ in range(50):
            metrics.file()

    workers = [threading.Thread(target=count) for _ in range(threads)]
    workers.append(threading.Thread(target=read))
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    metrics.render({}, 0)
    sample = metrics.registry.get_sample_value
    assert sample("jitserve_requests_total", {"route": "/healthz", "status": "200"}) \
        == per_thread * threads
    assert sample("jitserve_execute_seconds_count") == per_thread * threads


def test_kept_observations_are_filed_before_they_pile_up() -> None:
    metrics = Metrics()
    for _ in range(1500):  # never read: a server nobody scrapes keeps no backlog
        metrics.observe(metrics.execute_seconds, 0.5)
    filed = metrics.registry.get_sample_value("jitserve_execute_seconds_count")
    assert filed is not None and 1024 <= filed <= 1500
    assert sum(len(v) for v in metrics._observed.values()) < 1024


def test_no_access_line_is_made_below_its_level() -> None:
    import asyncio
    import logging

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from jitserve.service.api.connections import HeadLimits, guarded_protocol

    async def app(scope: object, receive: object, send: object) -> None: ...

    protocol = guarded_protocol(HeadLimits(timeout_s=5, max_bytes=1 << 16), HttpToolsProtocol)
    access = logging.getLogger("uvicorn.access")
    level, handlers = access.level, list(access.handlers)
    loop = asyncio.new_event_loop()
    try:
        seen = {}
        for name in ("warning", "info"):
            config = uvicorn.Config(app, log_level=name)  # sets uvicorn.access's level
            config.load()
            seen[name] = protocol(config, ServerState(), {}, _loop=loop).access_log  # type: ignore[call-arg]
    finally:
        loop.close()
        access.setLevel(level)
        access.handlers = handlers
    assert seen == {"warning": False, "info": True}
