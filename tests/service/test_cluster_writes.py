"""The mirror of futures' metadata in Redis (service/cluster/mirror.py), against a real Redis.

Writes of one future never overlap, so Redis ends with each future's last state;
a held future is written once, as it is when its execute answers; a future
removed before any write of it reaches Redis not at all; and a replica that
leaves marks what it held ``replica_lost``. The replicas themselves, with
haproxy, are in tests/e2e/test_replicas_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from jitserve.compiler import RedisSettings
from jitserve.service.api.schemas import FutureView
from jitserve.service.calls.futures import Future, FutureStore
from jitserve.service.cluster import Cluster
from jitserve.service.metrics import Metrics
from jitserve.wire import Aval


async def _replica(redis_url: str, prefix: str) -> tuple[Cluster[Future], FutureStore]:
    settings = RedisSettings.from_url(redis_url, prefix=prefix)
    store: FutureStore
    cluster: Cluster[Future] = Cluster(
        settings, peer_url="http://127.0.0.1:1", secret=b"k" * 32, heartbeat_s=1.0,
        future_ttl_s=60.0, metrics=Metrics(),
        document=lambda fut: FutureView.of(fut).model_dump(mode="json"),
        live=lambda: store.live())
    store = FutureStore(ttl_s=60.0, max_live=10_000, max_device_bytes=1 << 30,
                        on_change=cluster.mirror.changed, id_prefix=f"{cluster.replica_id}.")
    await cluster.start()
    return cluster, store


def _new(store: FutureStore) -> Future:
    return store.create(owner=None, executable_id="e" * 64, out_avals=[Aval((4,), "float32")],
                        out_tree=None)


async def _stored(redis_url: str, cluster: Cluster[Future], fid: str) -> dict[str, Any] | None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        raw = await client.get(cluster.keys.future(fid))
    finally:
        await client.aclose()
    return None if raw is None else json.loads(raw)


async def _events(redis_url: str, cluster: Cluster) -> Any:
    client = aioredis.Redis.from_url(redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.psubscribe(cluster.keys.changed("*"))
    return client, pubsub


async def _drain(pubsub: Any, seconds: float = 0.5) -> list[str]:
    """What was published so far (and within ``seconds``)."""
    seen = []
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        message = await pubsub.get_message(timeout=0.05)  # None too for ignored ones
        if message is not None:
            seen.append(message["channel"].decode().rpartition(":")[2])
    return seen


def test_each_future_ends_in_its_last_state(redis_url: str, redis_prefix: str) -> None:
    """Many futures changing at once, with writes under way: Redis ends with the last
    state of each, whatever the interleaving, and ``written`` waits for it."""

    async def main() -> None:
        cluster, store = await _replica(redis_url, redis_prefix)
        rng = random.Random(7)
        writing: set[str] = set()
        overlaps: list[str] = []
        real_write = cluster.mirror._write

        async def write(batch: dict[str, Future], lost: bool) -> None:
            overlaps.extend(writing & batch.keys())
            writing.update(batch)
            try:
                await real_write(batch, lost)
            finally:
                writing.difference_update(batch)

        cluster.mirror._write = write  # type: ignore[method-assign]
        try:
            futures = [_new(store) for _ in range(300)]
            for step in range(3):
                for fut in rng.sample(futures, len(futures)):
                    if step == 0:
                        store.mark_running(fut, 0.001)
                    elif step == 1:
                        store.complete(fut, [np.zeros(4, np.float32)], 0.002)
                    elif rng.random() < 0.3:
                        store.delete(fut)
                    if rng.random() < 0.2:
                        await asyncio.sleep(0)  # let writes start between changes
            await asyncio.gather(*(cluster.mirror.written(f) for f in futures))
            assert not overlaps  # two writes of one future were never under way at once
            for fut in futures:
                doc = await _stored(redis_url, cluster, fut.future_id)
                if fut.removed is not None:
                    assert doc is None, fut.future_id
                else:
                    assert doc is not None and doc["status"] == "done", (fut.future_id, doc)
            live = [f for f in futures if f.removed is None]
            assert set(cluster.mirror._version) == {f.future_id for f in live}  # nothing kept for the gone
        finally:
            await cluster.close()

    asyncio.run(main())


def test_a_write_of_other_futures_goes_while_one_is_under_way(redis_url: str,
                                                              redis_prefix: str) -> None:
    """Writes of different futures overlap: ``b``'s starts while ``a``'s is held. (The
    test above checked it too, but whether its writes overlapped depended on how
    fast Redis answered: under load, once, none did.)"""

    async def main() -> None:
        cluster, store = await _replica(redis_url, redis_prefix)
        real_write = cluster.mirror._write
        started: asyncio.Queue[set[str]] = asyncio.Queue()
        go = asyncio.Event()

        async def write(batch: dict[str, Future], lost: bool) -> None:
            started.put_nowait(set(batch))
            await go.wait()
            await real_write(batch, lost)

        cluster.mirror._write = write  # type: ignore[method-assign]
        try:
            a = _new(store)
            assert await asyncio.wait_for(started.get(), 10) == {a.future_id}
            b = _new(store)  # a's write is held
            assert await asyncio.wait_for(started.get(), 10) == {b.future_id}
            go.set()
            await asyncio.gather(cluster.mirror.written(a), cluster.mirror.written(b))
            for fut in (a, b):
                assert (await _stored(redis_url, cluster, fut.future_id)) is not None
        finally:
            go.set()
            await cluster.close()

    asyncio.run(main())


def test_a_held_future_is_written_once_as_it_answers(redis_url: str,
                                                        redis_prefix: str) -> None:
    async def main() -> None:
        cluster, store = await _replica(redis_url, redis_prefix)
        client, pubsub = await _events(redis_url, cluster)
        try:
            fut = _new(store)
            cluster.mirror.hold(fut)
            store.mark_running(fut, 0.001)
            await asyncio.sleep(0.2)  # the writer is free: it still writes nothing of it
            assert await _stored(redis_url, cluster, fut.future_id) is None
            store.complete(fut, [np.zeros(4, np.float32)], 0.002)
            await cluster.mirror.written(fut)
            assert (await _stored(redis_url, cluster, fut.future_id))["status"] == "done"

            gone = _new(store)  # an answer that deletes its future (keep=false)
            cluster.mirror.hold(gone)
            store.complete(gone, [np.zeros(4, np.float32)], 0.002)
            store.delete(gone)
            cluster.mirror.unhold(gone)
            await asyncio.sleep(0.2)
            assert await _stored(redis_url, cluster, gone.future_id) is None
            assert gone.future_id not in cluster.mirror._version
            assert await _drain(pubsub) == [fut.future_id]
        finally:
            await pubsub.aclose()
            await client.aclose()
            await cluster.close()

    asyncio.run(main())


def test_a_replica_that_leaves_marks_its_futures_lost(redis_url: str,
                                                      redis_prefix: str) -> None:
    async def main() -> None:
        cluster, store = await _replica(redis_url, redis_prefix)
        try:
            done, running = _new(store), _new(store)
            store.complete(done, [np.zeros(4, np.float32)], 0.002)
            store.mark_running(running, 0.001)
            held = _new(store)
            cluster.mirror.hold(held)  # its execute has not answered yet
            await cluster.leave(store.live())
            for fut in (done, running, held):
                doc = await _stored(redis_url, cluster, fut.future_id)
                assert doc is not None, fut.future_id
                assert doc["status"] == "failed", doc
                assert doc["error"]["code"] == "replica_lost", doc
            store.mark_running(held, 0.001)  # after leaving, nothing more is written
            await asyncio.sleep(0.2)
            assert (await _stored(redis_url, cluster, held.future_id))["status"] == "failed"
        finally:
            await cluster.close()

    asyncio.run(main())


def test_a_long_poll_listens_to_its_future_only_while_it_waits(redis_url: str,
                                                               redis_prefix: str) -> None:
    """Another replica's long-poll subscribes to that future's channel (confirmed
    before it reads), wakes on its write, and unsubscribes; no other replica hears
    of the future's writes."""

    async def main() -> None:
        (a, store), (b, _) = (await _replica(redis_url, redis_prefix),
                              await _replica(redis_url, redis_prefix))
        client = aioredis.Redis.from_url(redis_url)
        try:
            fut = _new(store)
            await a.mirror.written(fut)
            channel = a.keys.changed(fut.future_id)

            async def listeners() -> int:
                return dict(await client.pubsub_numsub(channel))[channel.encode()]

            assert await listeners() == 0  # nobody waits: the writes go nowhere
            poll = asyncio.create_task(b.watch.wait_change(fut.future_id, None, "pending", 30.0))
            for _ in range(100):
                if await listeners() == 1:
                    break
                await asyncio.sleep(0.01)
            assert await listeners() == 1 and not poll.done()
            store.complete(fut, [np.zeros(4, np.float32)], 0.002)
            doc = await asyncio.wait_for(poll, 10)  # woken by the write, not its 30 s
            assert doc["status"] == "done"
            for _ in range(100):
                if await listeners() == 0:
                    break
                await asyncio.sleep(0.01)
            assert await listeners() == 0
        finally:
            await client.aclose()
            await a.close()
            await b.close()

    asyncio.run(main())


def test_an_answer_goes_once_its_future_is_written(redis_url: str, redis_prefix: str) -> None:
    """``Mirror.answering``, as the execute route uses it: nothing is written while the
    answer is made; leaving, the future is written before the answer goes, unless the
    answer removed it (then never); an answer that fails leaves it to the writer."""

    async def main() -> None:
        cluster, store = await _replica(redis_url, redis_prefix)
        mirror = cluster.mirror
        try:
            fut = _new(store)
            async with mirror.answering(fut):
                store.complete(fut, [np.zeros(4, np.float32)], 0.002)
                await asyncio.sleep(0.2)  # the writer is free: it still writes nothing of it
                assert await _stored(redis_url, cluster, fut.future_id) is None
            assert (await _stored(redis_url, cluster, fut.future_id))["status"] == "done"

            gone = _new(store)  # keep=false: the answer deleted its future
            async with mirror.answering(gone):
                store.complete(gone, [np.zeros(4, np.float32)], 0.002)
                store.delete(gone)
            await asyncio.sleep(0.2)
            assert await _stored(redis_url, cluster, gone.future_id) is None
            assert gone.future_id not in mirror._version

            failed = _new(store)
            try:
                async with mirror.answering(failed):
                    raise LookupError("the answer failed")
            except LookupError:
                pass
            await mirror.written(failed)  # not held any more: the writer writes it
            assert (await _stored(redis_url, cluster, failed.future_id))["status"] == "pending"
        finally:
            await cluster.close()

    asyncio.run(main())
