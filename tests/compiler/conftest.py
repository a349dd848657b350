"""Fixtures for the compiler tests: shared and per-test ``Compiler`` instances.

A ``Compiler`` compiles in a worker subprocess whose first start costs a few
seconds, so modules share one (``compiler``) wherever the tests do not need a
cache directory of their own; tests that do use ``make_compiler``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jitserve.compiler import Compiler, CompilerConfig, Limits

MakeCompiler = Callable[..., Compiler]


def new_compiler(cache_dir: Path | None = None, **overrides: Any) -> Compiler:
    """A ``Compiler`` with the test defaults; ``overrides`` replace ``CompilerConfig`` fields."""
    config: dict[str, Any] = dict(
        cache_dir=cache_dir, l1_max_entries=256, l1_max_bytes=1 << 30,
        compile_timeout_s=120, compile_workers=1, limits=Limits(),
    )
    config.update(overrides)
    return Compiler(CompilerConfig(**config))


@pytest.fixture(scope="module")
def compiler() -> Iterator[Compiler]:
    """One Compiler (no disk tier) shared by every test of a module."""
    c = new_compiler()
    yield c
    c.close()


@pytest.fixture
def make_compiler() -> Iterator[MakeCompiler]:
    """A factory of Compilers (same arguments as ``new_compiler``), all closed at teardown."""
    made: list[Compiler] = []

    def make(cache_dir: Path | None = None, **overrides: Any) -> Compiler:
        made.append(new_compiler(cache_dir, **overrides))
        return made[-1]

    yield make
    for c in made:
        c.close()
