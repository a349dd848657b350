"""The SDK on the jax a user has: the range it supports, and what it says past it.

These run on every jax of the range (``.ci/jax-range`` runs the SDK's tests on the
oldest); the server's reading of each release's spellings is checked against a real
server in ``tests/e2e/test_jaxpr_e2e.py``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

from jitserve import wire
from jitserve.client.jaxpr import SUPPORTED_JAX, JaxprEncodeError, encode_function

ROOT = Path(__file__).resolve().parents[2]


def _extra(name: str) -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"][name]


def test_the_jit_extra_takes_the_range_the_writer_supports() -> None:
    jit = _extra("jit")
    assert f"jax{SUPPORTED_JAX}" in jit and f"jaxlib{SUPPORTED_JAX}" in jit
    # The server keeps its pin: its cache keys carry the versions.
    assert any(d.startswith("jax==") for d in _extra("server"))


def test_the_readme_names_the_range() -> None:
    readme = (ROOT / "README.md").read_text()
    low, high = SUPPORTED_JAX.split(",")
    assert low.removeprefix(">=") in readme and high.removeprefix("<") in readme


def test_the_running_jax_is_in_the_range() -> None:
    low, high = (v.lstrip("><=") for v in SUPPORTED_JAX.split(","))
    version = tuple(int(p) for p in jax.__version__.split(".")[:3])
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split(".")))


def test_a_primitive_the_format_does_not_know_is_refused_by_name() -> None:
    # What a jax newer than the range adds: the writer says so, rather than sending
    # a document that the server would refuse, or misread.
    newer = Primitive("fused_softmax_v9")
    newer.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    with pytest.raises(JaxprEncodeError) as info:
        encode_function(lambda x: jnp.sin(newer.bind(x)), np.ones(3, np.float32))
    message = str(info.value)
    assert "eqn 0 (fused_softmax_v9)" in message
    assert "not in the jitserve jaxpr format (version 1)" in message
    assert SUPPORTED_JAX in message and jax.__version__ in message
    assert "format='jax_export'" in message


def test_every_primitive_of_this_jax_is_written_in_the_formats_names() -> None:
    # The format's vocabulary, as the wire contract ships it, holds the basic ops of
    # every supported jax (no release renames them).
    assert {"add", "mul", "sin", "jit", "scan", "while", "cond", "dot_general"} <= \
        wire.JAXPR_PRIMITIVES
