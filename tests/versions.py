"""The jax the server pins, for tests that run on another jax of the SDK's range.

The SDK supports a range of jax (``.ci/jax-range`` runs its tests on the oldest); the
server's own code, and its XLA, stay on the pin in pyproject's ``server`` extra.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import jax


def _server_jax() -> str:
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pins = [re.fullmatch(r"jax==(\S+)", d) for d in
            extras["project"]["optional-dependencies"]["server"]]
    return next(m.group(1) for m in pins if m)


SERVER_JAX = _server_jax()
#: Whether this process runs the server's jax, and so the same XLA: remote results then
#: match local ``jax.jit`` to the last bits. Another XLA may round differently.
ON_SERVER_JAX = jax.__version__ == SERVER_JAX
