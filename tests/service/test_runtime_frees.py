"""Frees of runtime buffers (``Runtime.send_free``): small ones ride on the next
request to the runtime, or go after a short delay; big ones go at once; frees
from a process that has since been replaced are dropped. A real runtime process;
its ``stats`` answer counts the buffers it holds."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jitserve.service.runtimes import Runtime, RuntimePool, frames
from jitserve.service.runtimes.pool import _FREE_AFTER_S, _FREE_NOW_BYTES, RemoteError


async def _put(runtime: Runtime, *arrays: np.ndarray) -> tuple[list[int], int]:
    descs, _ = frames.pack_arrays(list(arrays), None)
    reply = await runtime.request("put", {"args": descs}, timeout_s=60)
    return reply["handles"], reply["generation"]


async def _held(runtime: Runtime) -> int:
    return (await runtime.request("stats", {}, timeout_s=60))["buffers"]


async def test_a_small_free_rides_on_the_next_request(runtimes: RuntimePool) -> None:
    runtime = runtimes.runtimes[0]
    before = await _held(runtime)
    handles, generation = await _put(runtime, np.ones(4), np.zeros(3))
    runtime.send_free(handles, generation, 56)
    assert runtime._frees == handles  # not sent on its own
    assert await _held(runtime) == before  # the stats request carried it, and it came first
    assert runtime._frees == []


async def test_a_small_free_with_no_request_after_it_goes_alone(runtimes: RuntimePool) -> None:
    runtime = runtimes.runtimes[0]
    before = await _held(runtime)
    handles, generation = await _put(runtime, np.ones(4))
    runtime.send_free(handles, generation, 32)
    await asyncio.sleep(_FREE_AFTER_S * 5)
    assert runtime._frees == []  # the timer sent it
    assert await _held(runtime) == before


async def test_a_big_free_goes_at_once(runtimes: RuntimePool) -> None:
    runtime = runtimes.runtimes[0]
    before = await _held(runtime)
    handles, generation = await _put(runtime, np.ones(4))
    runtime.send_free(handles, generation, _FREE_NOW_BYTES)
    assert runtime._frees == []
    assert await _held(runtime) == before


async def test_frees_of_another_process_are_dropped(runtimes: RuntimePool) -> None:
    runtime = runtimes.runtimes[0]
    handles, generation = await _put(runtime, np.ones(4))
    runtime.send_free(handles, generation - 1, 32)  # as from the process before this one
    assert runtime._frees == []
    held = await _held(runtime)
    runtime.send_free(handles, generation, 32)
    assert await _held(runtime) == held - 1


async def test_a_run_that_fails_before_it_takes_what_it_was_given_drops_it(
        runtimes: RuntimePool) -> None:
    """The API process sends no free for a buffer it gave up to a run (``give``): the
    runtime drops it with the run, even one that failed before it took it (here, an
    executable no tier has, nor its program)."""
    runtime = runtimes.runtimes[0]
    before = await _held(runtime)
    handles, _ = await _put(runtime, np.ones(4))
    run = {"executable_id": "0" * 64, "program_id": "0" * 64, "static_key": "", "donate": [0],
           "avals": [], "args": [{"handle": handles[0], "give": True}]}
    with pytest.raises(RemoteError, match="no program"):
        await runtime.request("run", run, timeout_s=60)
    assert await _held(runtime) == before
