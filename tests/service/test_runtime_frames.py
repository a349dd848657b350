"""Arrays across the process boundary (``service.runtimes.frames``), without processes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jitserve.service.runtimes import frames


def _segments(prefix: str) -> list[str]:
    return sorted(p.name for p in frames.SHM_DIR.glob(f"{prefix}-*"))


def test_small_arrays_travel_inline_big_ones_in_one_segment() -> None:
    prefix = frames.new_prefix()
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3),
              np.arange(1 << 19, dtype=np.float64),               # 4 MiB
              np.array(True), np.ones((3,), ml_dtypes.bfloat16),
              np.arange(1 << 18, dtype=np.complex64)[::1]]      # 2 MiB
    descs, segment = frames.pack_arrays(arrays, prefix)
    assert segment is not None and _segments(prefix) == [segment.name]
    assert ["shm" in d for d in descs] == [False, True, False, False, True]
    assert all(d["offset"] % 64 == 0 for d in descs if "shm" in d)
    message = frames.unpack(frames.pack({"args": descs}))  # as it crosses the pipe
    segment.map.close()
    back = frames.unpack_arrays(message["args"])
    assert _segments(prefix) == []  # the reader unlinks it once mapped
    for want, got in zip(arrays, back):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_no_segment_for_small_messages() -> None:
    descs, segment = frames.pack_arrays([np.zeros((4,), np.int8)], frames.new_prefix())
    assert segment is None and descs[0]["data"] == bytes(4)


@pytest.mark.parametrize("name", ["../../etc/passwd", "jitserve-0-0", "other-file",
                                  "jitserve-abcdef01-0123456789abcdef/../x"])
def test_segment_names_outside_the_pattern_are_never_opened(name: str) -> None:
    with pytest.raises(ValueError, match="not a jitserve segment"):
        frames.unpack_arrays([{"dtype": "float32", "shape": [1], "shm": name, "offset": 0}])


def test_remove_all_cleans_up_after_a_process() -> None:
    prefix = frames.new_prefix()
    for _ in range(3):
        frames.Segment.create(prefix, 4096).map.close()
    assert len(_segments(prefix)) == 3
    frames.remove_all(prefix)
    assert _segments(prefix) == []
