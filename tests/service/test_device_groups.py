"""Device groups (issue 37): parsing ``JITSERVE_RUNTIME_DEVICES``, what each group's
runtimes see, and where calls are placed among groups of several sizes.

Placement is checked on a pool that is never started: it reads groups and
counters only.
"""

from __future__ import annotations

import pytest

from jitserve.service.runtimes import RuntimePool
from jitserve.service.runtimes import protocol as p
from jitserve.service.runtimes.devices import Group, group_env, host_device_count, parse_groups


def test_each_all_and_explicit_groups() -> None:
    assert parse_groups("each", 3) == [(0,), (1,), (2,)]
    assert parse_groups("all", 3) == [(0, 1, 2)]
    assert parse_groups("0-3;4-7", 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert parse_groups(" 0,1; 2 ;3", 4) == [(0, 1), (2,), (3,)]


@pytest.mark.parametrize(("spec", "words"), [
    ("0-4", "names device 4; this host has 4"),
    ("0,1;1,2", "device 1 in two groups"),
    ("3-1", "range 3-1 is empty"),
    ("gpu0", "'gpu0' is not a device id"),
    ("0;;1", "'' is not a device id"),
])
def test_a_bad_spec_says_what_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_groups(spec, 4)


def test_a_group_sees_its_own_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert group_env("gpu", (2, 3)) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert group_env("gpu", (1,), rocm=True) == {"HIP_VISIBLE_DEVICES": "1"}
    assert group_env("cpu", (0, 1, 2)) == {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    # An operator's own CUDA_VISIBLE_DEVICES is the host's numbering: groups index it.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert host_device_count("gpu", None) == 3
    assert group_env("gpu", (1, 2)) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert host_device_count("cpu", 8) == 8 and host_device_count("cpu", None) == 1


def _pool(*groups: tuple[int, ...], per_group: int = 1) -> RuntimePool:
    config: p.Config = {"settings": {"executor_threads": 2}, "platform": "cpu",
                        "max_memory_bytes": None, "log_level": "warning",
                        "isolate_network": False}
    return RuntimePool(per_group, config, {},
                       groups=[Group(i, g) for i, g in enumerate(groups)])


def test_a_sharded_program_goes_to_the_smallest_group_that_fits() -> None:
    pool = _pool((0, 1), (2,), (3, 4, 5, 6), (7, 8), per_group=2)
    assert [r.group.index for r in pool.runtimes] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert pool.max_devices == 4
    for hint in ("00000000", "7fffffff", "deadbeef", "12345678"):
        assert pool.place(None, hint, devices=2).group.size == 2
        assert pool.place(None, hint, devices=3).group.size == 4
        assert pool.place(None, hint, devices=4).group.size == 4
    # One device: any runtime, spread by program.
    assert {pool.place(None, f"{i:08x}").index for i in range(8)} == set(range(8))
    # A key is pinned once per size of group, each time to the least used runtime.
    first = pool.place("alice", devices=2)
    assert first.group.size == 2 and pool.place("alice", devices=2) is first
    assert pool.place("alice", devices=3).group.size == 4
    assert pool.place("bob", devices=2) is not first
    # A run placed again after its runtime was lost stays on a group as big.
    big = pool.runtimes[4]
    assert pool.replace(None, big).group.size >= 4


def test_the_devices_document_lists_groups_before_any_runtime_is_up() -> None:
    doc = _pool((0, 1), (2, 3)).devices_document()
    assert [d["id"] for d in doc["devices"]] == [0, 1, 2, 3]
    assert [d["group"] for d in doc["devices"]] == [0, 0, 1, 1]
    assert [d["default"] for d in doc["devices"]] == [True, False, True, False]
    assert doc["groups"] == [{"index": 0, "devices": [0, 1], "size": 2, "runtimes": [0]},
                             {"index": 1, "devices": [2, 3], "size": 2, "runtimes": [1]}]
    assert doc["max_program_devices"] == 2
