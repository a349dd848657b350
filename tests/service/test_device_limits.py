"""The device-bytes limits a server derives when they are left unset (issue 38).

``derive_device_limits`` is given what runtimes report at start: each device's memory
limit where XLA's allocator has one (a GPU: the device's memory times the runtime's
fraction), nothing on the CPU, where the runtime's memory cap counts instead. The CPU
path runs end to end in tests/e2e/test_memory_e2e.py.
"""

from __future__ import annotations

from jitserve.service.runtimes import CPU_ARRAY_SHARE, RuntimePool, derive_device_limits, device_limits
from jitserve.service.settings import Settings

GiB = 1 << 30


def test_a_gpu_runtime_gets_what_xla_lets_it_hold() -> None:
    # An 80 GiB H100 at the default fraction (0.75): XLA reports a 60 GiB limit.
    assert derive_device_limits([[60 * GiB]], None) == (60 * GiB, 60 * GiB)


def test_runtimes_sum_and_a_run_gets_the_least_device() -> None:
    # Eight GPUs, one runtime each: the futures may hold all eight shares, one run
    # (per device, as XLA's memory analysis counts) one share.
    assert derive_device_limits([[60 * GiB]] * 8, None) == (480 * GiB, 60 * GiB)
    # A group of two devices beside a smaller one.
    assert derive_device_limits([[60 * GiB, 60 * GiB], [30 * GiB]], None) == (150 * GiB, 30 * GiB)


def test_a_cpu_runtime_gets_a_share_of_its_memory_cap() -> None:
    share = int(8 * GiB * CPU_ARRAY_SHARE)
    assert derive_device_limits([[None], [None]], 8 * GiB) == (2 * share, share)
    # Simulated host devices split the runtime's share.
    assert derive_device_limits([[None] * 4], 8 * GiB) == (share, share // 4)


def test_unknown_memory_derives_nothing() -> None:
    assert derive_device_limits([[None]], None) is None
    assert derive_device_limits([], 8 * GiB) is None


def test_a_started_cpu_runtime_derives_from_its_cap_and_settings_win(runtimes: RuntimePool) -> None:
    cap = runtimes.memory_cap
    assert cap and all("memory_limit" not in d for d in runtimes.runtimes[0].info["devices"])
    share = int(cap * CPU_ARRAY_SHARE)
    derived = device_limits(Settings(env="test"), runtimes)
    assert (derived.max_device_bytes, derived.max_execution_bytes) == (share, share)
    # What the operator sets stands; one run never gets more than all runs together.
    small = device_limits(Settings(env="test", max_device_bytes=GiB), runtimes)
    assert (small.max_device_bytes, small.max_execution_bytes) == (GiB, min(GiB, share))
    both = device_limits(Settings(env="test", max_device_bytes=GiB, max_execution_bytes=2 * GiB),
                         runtimes)
    assert (both.max_device_bytes, both.max_execution_bytes) == (GiB, 2 * GiB)
