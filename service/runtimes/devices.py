"""Device groups: which of a host's devices each runtime gets.

``JITSERVE_RUNTIME_DEVICES`` splits the host's devices into groups, each served by
its own runtime(s) (``JITSERVE_RUNTIMES`` of them per group):

- ``each``: one group per device (the default on GPU: every device used);
- ``all``: one group of every device (the default on CPU);
- explicit groups, ``;`` between groups, each a list of ``,``-separated ids or
  ``a-b`` ranges: ``0-3;4-7``, ``0,1;2;3``. Ids are the host's device numbers (on
  GPU, positions in ``CUDA_VISIBLE_DEVICES`` when it is set); a device may be in
  one group only.

A GPU runtime sees its group's devices only (``CUDA_VISIBLE_DEVICES``, on ROCm
``HIP_VISIBLE_DEVICES``), and so do the compile workers it starts; a CPU runtime
gets as many simulated host devices as its group has. The API process counts the
devices without starting a backend (``host_device_count``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Group", "group_env", "host_device_count", "parse_groups"]

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


@dataclasses.dataclass(frozen=True)
class Group:
    """Devices served together: a program sharded across up to ``size`` of them runs here.

    Attributes:
      index: its place in the server's groups.
      devices: the host's device ids in it, in order.
      env: what its runtimes' environment adds (the devices they see).
    """

    index: int
    devices: tuple[int, ...]
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.devices)


def parse_groups(spec: str, count: int) -> list[tuple[int, ...]]:
    """The groups ``spec`` names among ``count`` devices; ``ValueError`` says what is wrong."""
    spec = spec.strip().lower()
    if spec == "each":
        return [(i,) for i in range(count)]
    if spec == "all":
        return [tuple(range(count))]
    groups: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for part in spec.split(";"):
        ids: list[int] = []
        for item in part.split(","):
            match = _RANGE.fullmatch(item.strip())
            if match is None:
                raise ValueError(f"JITSERVE_RUNTIME_DEVICES: {item.strip()!r:.40} is not a device "
                                 "id or a range a-b (e.g. '0-3;4-7', '0,1;2;3', 'each', 'all')")
            first = int(match.group(1))
            last = int(match.group(2)) if match.group(2) is not None else first
            if last < first:
                raise ValueError(f"JITSERVE_RUNTIME_DEVICES: range {item.strip()} is empty")
            ids.extend(range(first, last + 1))
        for i in ids:
            if i >= count:
                raise ValueError(f"JITSERVE_RUNTIME_DEVICES names device {i}; this host has "
                                 f"{count} (0-{count - 1})")
            if i in seen:
                raise ValueError(f"JITSERVE_RUNTIME_DEVICES names device {i} in two groups")
            seen.add(i)
        groups.append(tuple(ids))
    return groups


def host_device_count(platform: str, cpu_devices: int | None) -> int:
    """How many devices the runtimes may share, found without starting a backend.

    CPU: ``JITSERVE_CPU_DEVICES`` (1 unset). GPU: the entries of
    ``CUDA_VISIBLE_DEVICES``/``HIP_VISIBLE_DEVICES`` when set, else the devices the
    driver lists (``/dev/nvidiaN``; ROCm's KFD topology), at least 1.
    """
    if platform == "cpu":
        return cpu_devices or 1
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        visible = os.environ.get(name)
        if visible is not None:
            return max(1, len([v for v in visible.split(",") if v.strip()]))
    nvidia = [p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    if nvidia:
        return len(nvidia)
    nodes = Path("/sys/class/kfd/kfd/topology/nodes")
    amd = [n for n in nodes.glob("*") if _reads_nonzero(n / "gpu_id")] if nodes.is_dir() else []
    return max(1, len(amd))


def group_env(platform: str, devices: Sequence[int], rocm: bool = False) -> dict[str, str]:
    """The environment a runtime of the group ``devices`` adds: on GPU the devices it sees
    (as the host numbers them: positions in an existing ``*_VISIBLE_DEVICES``), on CPU
    its count of simulated host devices."""
    if platform == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")
        return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={len(devices)}"
                .strip()}
    name = "HIP_VISIBLE_DEVICES" if rocm else "CUDA_VISIBLE_DEVICES"
    visible = os.environ.get(name)
    ids = ([v.strip() for v in visible.split(",") if v.strip()] if visible is not None
           else [str(i) for i in range(max(devices) + 1)])
    return {name: ",".join(ids[i] for i in devices)}


def _reads_nonzero(path: Path) -> bool:
    try:
        return path.read_text().strip() not in ("", "0")
    except OSError:
        return False
