"""The program store of the routes: the compiler's stored programs, off the event loop.

Programs are content-addressed and kept by the compiler in the same tiers as
executables (``jitserve.compiler.StoredPrograms``: memory, ``<cache_dir>/programs``,
and Redis when one is shared), re-validated like an upload whenever they are
read back. This module adds only what the service needs: async calls that run
the blocking reads in the thread pool, one reader at a time, and ``NotFound``.
"""

from __future__ import annotations

import asyncio

from starlette.concurrency import run_in_threadpool

from jitserve.compiler import Program, StoredPrograms
from jitserve.service.errors import NotFound

__all__ = ["ProgramStore"]


class ProgramStore:
    """Programs by id for the route handlers.

    Args:
      programs: the compiler's stored programs (``Compiler.programs``).
    """

    def __init__(self, programs: StoredPrograms) -> None:
        self._programs = programs
        self._lock = asyncio.Lock()

    async def put(self, data: bytes, format: str | None = None) -> tuple[Program, bool]:
        """Store ``data`` as a program; returns it and whether it was new.

        Raises a ``CompilerError`` when the bytes are not a valid program.
        """
        return await run_in_threadpool(self._programs.put, data, format)

    async def get(self, program_id: str) -> Program:
        """The program called ``program_id``; ``NotFound`` when there is none."""
        program = self._programs.cached(program_id)
        if program is None:
            # One reader at a time, so a burst of requests decodes a stored program once.
            async with self._lock:
                program = await run_in_threadpool(self._programs.get, program_id)
        if program is None:
            raise NotFound(f"no program {program_id!r:.80}; upload it with POST /v1/programs")
        return program
