"""Arrays across the process boundary (``service.runtimes.frames``), without runtimes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from jitserve.service.runtimes import frames


def _segments(prefix: str) -> list[str]:
    return sorted(p.name for p in frames.SHM_DIR.glob(f"{prefix}-*"))


@pytest.fixture
def cache():
    c = frames.SegmentCache(frames.new_prefix(), max_bytes=64 << 20)
    yield c
    c.close()
    frames.remove_all(c.prefix)


def test_small_arrays_travel_inline_big_ones_in_one_segment(cache) -> None:
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3),
              np.arange(1 << 19, dtype=np.float64),               # 4 MiB
              np.array(True), np.ones((3,), ml_dtypes.bfloat16),
              np.arange(1 << 18, dtype=np.complex64)]              # 2 MiB
    descs, segment = frames.pack_arrays(arrays, cache)
    assert segment is not None and _segments(cache.prefix) == [segment.name]
    assert ["shm" in d for d in descs] == [False, True, False, False, True]
    assert all(d["offset"] % 64 == 0 for d in descs if "shm" in d)
    message = frames.unpack(frames.pack({"args": descs}))  # as it crosses the pipe
    back = frames.unpack_arrays(message["args"])  # as the other process maps it
    for want, got in zip(arrays, back):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_segments_are_reused_within_the_bound(cache) -> None:
    big = np.ones(2 << 20, np.float32)  # 8 MiB
    _, first = frames.pack_arrays([big], cache)
    cache.give_back(first)
    _, again = frames.pack_arrays([big[: 1 << 20]], cache)  # 4 MiB fits in it
    assert again is first
    cache.give_back(again)
    huge = cache.take(128 << 20)  # past the cache's bound when given back: unlinked
    cache.give_back(huge)
    assert huge.name not in _segments(cache.prefix)


def test_a_lease_gives_the_segment_back_when_its_arrays_are_gone(cache) -> None:
    segment = cache.take(8 << 20)
    descs = frames.write_arrays([np.full(1 << 20, 7, np.float32)], [0], segment.map, segment.name)
    (array,) = frames.unpack_arrays(descs, {segment.name: cache.lease(segment)})
    assert cache.take(8 << 20) is not segment  # still leased: another one is made
    assert array[123] == 7
    del array
    gc.collect()
    assert cache.take(8 << 20) is segment


def test_no_segment_for_small_messages(cache) -> None:
    descs, segment = frames.pack_arrays([np.zeros((4,), np.int8)], cache)
    assert segment is None and descs[0]["data"] == bytes(4)


@pytest.mark.parametrize("name", ["../../etc/passwd", "jitserve-0-0", "other-file",
                                  "jitserve-abcdef01-0123456789abcdef/../x"])
def test_segment_names_outside_the_pattern_are_never_opened(name: str) -> None:
    with pytest.raises(ValueError, match="not a jitserve segment"):
        frames.unpack_arrays([{"dtype": "float32", "shape": [1], "shm": name, "offset": 0}])


def test_remove_all_cleans_up_after_a_pool() -> None:
    prefix = frames.new_prefix()
    for _ in range(3):
        frames.Segment.create(prefix, 4096)
    assert len(_segments(prefix)) == 3
    frames.remove_all(prefix)
    assert _segments(prefix) == []
    assert not (frames.SHM_DIR / f"{prefix}.lock").exists()


_POOL = """
from jitserve.service.runtimes import frames
prefix = frames.new_prefix()
frames.Segment.create(prefix, 4096)
print(prefix, flush=True)
input()
"""


def test_segments_of_a_pool_whose_process_was_killed_go_with_the_next_pool() -> None:
    """A process SIGKILLed (or OOM-killed) before its cleanup leaves its segments in
    /dev/shm: the next pool made on the host removes them, and not those of pools
    whose processes live, in this process or another."""
    procs = [subprocess.Popen([sys.executable, "-c", _POOL], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    live = frames.new_prefix()
    try:
        frames.Segment.create(live, 4096)
        killed, other = (p.stdout.readline().strip() for p in procs if p.stdout)
        procs[0].kill()
        procs[0].wait()
        old = time.time() - 60  # past the grace a lock file just made gets
        for prefix in (killed, other, live):
            assert len(_segments(prefix)) == 1
            os.utime(frames.SHM_DIR / f"{prefix}.lock", (old, old))
        frames.remove_all(frames.new_prefix())
        assert _segments(killed) == [] and not (frames.SHM_DIR / f"{killed}.lock").exists()
        assert len(_segments(other)) == 1 and len(_segments(live)) == 1
    finally:
        for p in procs:
            p.kill()
            p.communicate()  # and closes its pipes
        frames.remove_all(live)
    frames.remove_all(frames.new_prefix())
    assert _segments(other) == []  # its process is gone now too


def test_inputs_of_64_kib_go_by_small_segments(cache) -> None:
    """``inline_max=SHARED_FROM_BYTES`` (a run's inputs): 64 KiB and more go by shared
    memory, in a segment as small as fits (a loop running ahead holds dozens)."""
    arrays = [np.arange(1 << 14, dtype=np.float32), np.zeros(100, np.int32)]
    descs, segment = frames.pack_arrays(arrays, cache, frames.SHARED_FROM_BYTES)
    assert segment is not None and segment.size == 64 << 10
    assert ["shm" in d for d in descs] == [True, False]
    back = frames.unpack_arrays(frames.unpack(frames.pack({"a": descs}))["a"])
    for want, got in zip(arrays, back):
        np.testing.assert_array_equal(got, want)
    cache.give_back(segment)
    assert cache.take(100 << 10) is not segment  # too small for it
    assert cache.take(50 << 10) is segment


def test_a_runtime_keeps_its_last_mappings_and_not_big_ones(cache) -> None:
    maps = frames.SegmentMaps(count=2, max_size=1 << 20)
    made = [cache.take(64 << 10) for _ in range(3)]
    for s in made:
        descs = frames.write_arrays([np.ones(16, np.float32)], [0], s.map, s.name)
        frames.unpack_arrays(descs, maps)
    assert list(maps) == [made[1].name, made[2].name]  # the oldest went
    big = cache.take(4 << 20)
    frames.unpack_arrays(frames.write_arrays([np.ones(16, np.float32)], [0], big.map, big.name),
                         maps)
    assert big.name not in maps
