"""The program store of the routes: programs by id, scoped per tenant.

An upload is decoded and validated by a runtime (``service.runtimes``), never
here: the bytes of a program are untrusted, and decoding them has crashed
processes before. The runtime keeps the program in the cache tiers (memory,
``<cache_dir>/programs``, and Redis when one is shared), and answers with its
signature, which this store keeps beside the bytes (``Program``, bounded like
the runtimes' own cache): a runtime that has not seen a program (another one,
or one restarted since) is sent the bytes again (``calls.ask``).

The tenant's view (``service.tenants``): a tenant sees only what it uploaded,
though the bytes are stored once for all; ``NotFound`` has one message for an
unknown id and another tenant's, so ids cannot be probed.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Protocol

from starlette.concurrency import run_in_threadpool

from jitserve.compiler.cache import MemoryCache
from jitserve.compiler.records import Program

from ..errors import NotFound
from ..runtimes import Op, RemoteError, RuntimePool
from ..runtimes.protocol import ProgramRequest
from .calls import refusal
from .tenants import Tenants

__all__ = ["ProgramClaims", "ProgramStore"]

# Hashing this much or more goes to a thread (about a millisecond per MiB).
_HASH_IN_THREAD_BYTES = 1 << 20


class ProgramClaims(Protocol):
    """Which programs each API key uploaded through any replica (``cluster.Ownership``)."""

    async def claim(self, owner: str, program_id: str) -> None: ...

    async def owns(self, owner: str, program_id: str) -> bool: ...

    async def drop(self, owner: str, program_id: str) -> None: ...


class ProgramStore:
    """Programs by id for the route handlers, as each tenant sees them.

    Args:
      runtimes: where programs are decoded.
      tenants: who owns which program; omitted, nothing is scoped (one tenant).
      max_entries, max_bytes: bounds of the programs kept here.
      timeout_s: the longest a runtime may take to decode one.
      claims: the uploads of every replica, with Redis; omitted, this process's only.
    """

    def __init__(self, runtimes: RuntimePool, tenants: Tenants | None = None, *,
                 max_entries: int = 256, max_bytes: int = 1 << 30,
                 timeout_s: float = 120.0, claims: ProgramClaims | None = None) -> None:
        self._runtimes = runtimes
        self._tenants = tenants or Tenants()
        self._memory: MemoryCache[Program] = MemoryCache(max_entries, max_bytes)
        self._timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._claims = claims

    async def put(self, data: bytes | bytearray, format: str | None = None,
                  owner: str | None = None) -> tuple[Program, bool]:
        """Store ``data`` as ``owner``'s program; returns it and whether it is new to ``owner``.

        Raises a ``CompilerError`` when the bytes are not a valid program, and
        ``QuotaExceeded`` past the owner's program-bytes quota (checked before
        anything is stored).
        """
        program_id = (await run_in_threadpool(_sha256, data) if len(data) >= _HASH_IN_THREAD_BYTES
                      else _sha256(data))
        if self._tenants.scoped and owner is not None:
            self._tenants.check_program_room(owner, program_id, len(data))
        # Always through a runtime, even when known here: it stores the program again
        # in any tier that lost it (Redis evicted it, or was down at the first upload).
        runtime = self._runtimes.place(owner, program_id)
        try:
            reply = await runtime.decode(data, format, timeout_s=self._timeout_s)
        except RemoteError as e:
            raise refusal(e, "decoding") from None
        stored_now = bool(reply["created"])
        program = self._memory.get(program_id)
        if program is None:
            program = Program.from_json(reply["program"], bytes(data))
            self._memory.put(program_id, program, len(data))
        if self._claims is not None and owner is not None:
            await self._claims.claim(owner, program.program_id)
        created = self._tenants.claim_program(owner, program.program_id, len(data),
                                              stored_before=not stored_now)
        return program, created

    async def get(self, program_id: str, owner: str | None = None, *,
                  vouched: bool = False) -> Program:
        """``owner``'s program ``program_id``; ``NotFound`` when it has none by that id.

        ``vouched``: another replica, which checked that the program is ``owner``'s,
        forwarded the request (``service.cluster``); it becomes ``owner``'s here too.
        """
        seen = self._tenants.sees_program(owner, program_id)
        if not seen and not vouched and (
                self._claims is None or owner is None
                or not await self._claims.owns(owner, program_id)):
            raise _not_found(program_id)
        program = self._memory.get(program_id)
        if program is None:
            # One reader at a time, so a burst of requests decodes a stored program once.
            async with self._lock:
                program = self._memory.get(program_id) or await self._read(program_id, owner)
        if program is None:
            raise _not_found(program_id)
        if not seen:
            self._tenants.claim_program(owner, program_id, len(program.payload),
                                        stored_before=True)
        return program

    async def _read(self, program_id: str, owner: str | None) -> Program | None:
        """The program from the cache tiers, decoded again by a runtime; ``None`` if none has it."""
        runtime = self._runtimes.place(owner, program_id)
        try:
            reply = await runtime.request(Op.PROGRAM, ProgramRequest(program_id=program_id),
                                          timeout_s=self._timeout_s, retry=True)
        except RemoteError as e:
            raise refusal(e, "decoding") from None
        doc, payload = reply.get("program"), reply.get("payload")
        if doc is None or not isinstance(payload, bytes) or _sha256(payload) != program_id:
            return None
        program = Program.from_json(doc, payload)
        self._memory.put(program_id, program, len(payload))
        return program

    async def delete(self, program_id: str, owner: str | None = None) -> None:
        """Take ``program_id`` from ``owner``; ``NotFound`` when it is not the owner's.

        The bytes stay stored (other tenants may hold the same program).
        """
        if not self._tenants.scoped or owner is None:
            await self.get(program_id, owner)  # unscoped: it must exist to be deleted
        if self._claims is not None and owner is not None:
            await self._claims.drop(owner, program_id)
        if not self._tenants.drop_program(owner, program_id):
            raise _not_found(program_id)


def _sha256(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def _not_found(program_id: str) -> NotFound:
    # One message for "unknown" and "another tenant's": the answer must not tell them apart.
    return NotFound(f"no program {program_id!r:.80}; upload it with POST /v1/programs")
