"""The program store of the routes: the compiler's stored programs, scoped per tenant.

Programs are content-addressed and kept by the compiler in the same tiers as
executables (``jitserve.compiler.StoredPrograms``: memory, ``<cache_dir>/programs``,
and Redis when one is shared), re-validated like an upload whenever they are
read back. This module adds what the service needs: async calls that run the
blocking reads in the thread pool, one reader at a time; the tenant's view
(``service.tenants``: a tenant sees only what it uploaded, though the bytes are
stored once for all); and ``NotFound``, with one message for an unknown id and
another tenant's, so ids cannot be probed.
"""

from __future__ import annotations

import asyncio
import hashlib

from starlette.concurrency import run_in_threadpool

from jitserve.compiler import Program, StoredPrograms
from jitserve.service.errors import NotFound
from jitserve.service.tenants import Tenants

__all__ = ["ProgramStore"]


class ProgramStore:
    """Programs by id for the route handlers, as each tenant sees them.

    Args:
      programs: the compiler's stored programs (``Compiler.programs``).
      tenants: who owns which program; omitted, nothing is scoped (one tenant).
    """

    def __init__(self, programs: StoredPrograms, tenants: Tenants | None = None) -> None:
        self._programs = programs
        self._tenants = tenants or Tenants()
        self._lock = asyncio.Lock()

    async def put(self, data: bytes, format: str | None = None,
                  owner: str | None = None) -> tuple[Program, bool]:
        """Store ``data`` as ``owner``'s program; returns it and whether it is new to ``owner``.

        Raises a ``CompilerError`` when the bytes are not a valid program, and
        ``QuotaExceeded`` past the owner's program-bytes quota (checked before
        anything is stored).
        """
        if self._tenants.scoped and owner is not None:
            program_id = await run_in_threadpool(_sha256, data)
            self._tenants.check_program_room(owner, program_id, len(data))
        program, stored_now = await run_in_threadpool(self._programs.put, data, format)
        created = self._tenants.claim_program(owner, program.program_id, len(data),
                                              stored_before=not stored_now)
        return program, created

    async def get(self, program_id: str, owner: str | None = None) -> Program:
        """``owner``'s program ``program_id``; ``NotFound`` when it has none by that id."""
        if not self._tenants.sees_program(owner, program_id):
            raise _not_found(program_id)
        program = self._programs.cached(program_id)
        if program is None:
            # One reader at a time, so a burst of requests decodes a stored program once.
            async with self._lock:
                program = await run_in_threadpool(self._programs.get, program_id)
        if program is None:
            raise _not_found(program_id)
        return program

    async def delete(self, program_id: str, owner: str | None = None) -> None:
        """Take ``program_id`` from ``owner``; ``NotFound`` when it is not the owner's.

        The bytes stay stored (other tenants may hold the same program).
        """
        if not self._tenants.scoped or owner is None:
            await self.get(program_id, owner)  # unscoped: it must exist to be deleted
        if not self._tenants.drop_program(owner, program_id):
            raise _not_found(program_id)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _not_found(program_id: str) -> NotFound:
    # One message for "unknown" and "another tenant's": the answer must not tell them apart.
    return NotFound(f"no program {program_id!r:.80}; upload it with POST /v1/programs")
