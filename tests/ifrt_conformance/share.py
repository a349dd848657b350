"""A pytest plugin: run a fixed share of a test file, ``JITSERVE_CONFORMANCE_SHARE=N``.

Keeps the tests whose name hashes (crc32 of ``file::Class::test``) to 0 modulo N, the
same ones on every machine and in every run, locally and through jitserve alike.
"""

from __future__ import annotations

import os
import zlib
from typing import Any


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    share = int(os.environ.get("JITSERVE_CONFORMANCE_SHARE", "1"))
    if share <= 1:
        return
    kept, dropped = [], []
    for item in items:
        name = item.nodeid.rsplit("/", 1)[-1]
        (kept if zlib.crc32(name.encode()) % share == 0 else dropped).append(item)
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)
