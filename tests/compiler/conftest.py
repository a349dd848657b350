"""Fixtures for the compiler tests: shared and per-test ``Compiler`` instances.

A ``Compiler`` compiles in a worker subprocess whose first start costs a few
seconds, so modules share one (``compiler``) wherever the tests do not need a
cache directory of their own; tests that do use ``make_compiler``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

# The corpus lives in tests/; make it importable whatever pytest's import mode. The
# repository root goes first: with tests/ alone on sys.path (plain `pytest`, prepend
# mode), tests/compiler/ would shadow the real `compiler` package as a namespace package.
_ROOT, _TESTS_DIR = (str(p) for p in Path(__file__).resolve().parents[2:0:-1])
for _path in (_TESTS_DIR, _ROOT):
    if _path in sys.path:
        sys.path.remove(_path)
    sys.path.insert(0, _path)

import pytest  # noqa: E402

from compiler import Compiler, CompilerConfig, Limits  # noqa: E402

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
