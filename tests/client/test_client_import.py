"""``import client`` needs only numpy, httpx, msgpack and ml_dtypes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter where the server-side packages cannot be imported.
SCRIPT = textwrap.dedent("""
    import importlib.abc, sys

    BLOCKED = {"jax", "jaxlib", "fastapi", "uvicorn", "redis", "starlette", "pydantic",
               "compiler", "service"}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked for this test: {name}")
            return None

    sys.meta_path.insert(0, Block())

    import numpy as np
    import client
    from client import Client, AsyncClient, wire

    c = Client("http://127.0.0.1:1", api_key=None)
    f = c.jit(lambda x: x)                      # jax is only needed on the first call
    blob = wire.packb({"args": [np.arange(3, dtype=np.float32)]})
    assert wire.unpackb(blob)["args"][0].tolist() == [0.0, 1.0, 2.0]
    c.close()
    loaded = sorted({m.split(".")[0] for m in sys.modules} & BLOCKED)
    assert not loaded, loaded
    print("ok")
""")


def test_import_without_server_packages_or_jax() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
