"""The program store: uploaded programs, content-addressed and persisted.

A program's id is the sha256 of its bytes, so an upload is idempotent: the same
bytes give the same id, and a second upload skips decoding. Programs live in
memory (a bounded LRU), on disk under ``<cache_dir>/programs/<id>`` (unless the
disk tier is off), so they survive a restart, and in Redis when one is shared
(``REDIS_URL``), so a program uploaded through one process runs through any
other. A copy read back from disk or Redis is re-validated like an upload.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from starlette.concurrency import run_in_threadpool

from jitserve.compiler.errors import CompilerError
from jitserve.compiler.programs import Program
from jitserve.compiler.redis_tier import StoredProgram
from jitserve.service.errors import NotFound

__all__ = ["ProgramDecoder", "ProgramStore", "SharedPrograms"]

log = logging.getLogger("jitserve.programs")

_PROGRAM_ID = re.compile(r"[0-9a-f]{64}")


class ProgramDecoder(Protocol):
    """What the store needs from the compiler: ``Compiler.decode``."""

    def decode(self, data: bytes, format: str | None = None) -> Program: ...


class SharedPrograms(Protocol):
    """Programs shared between processes (``compiler.redis_tier.RedisTier``).

    Implementations never raise for their own failures: a write is skipped and
    a read is ``None``.
    """

    def put_program(self, program_id: str, data: bytes, format: str | None) -> None: ...

    def has_program(self, program_id: str) -> bool | None: ...

    def get_program(self, program_id: str) -> StoredProgram | None: ...


class ProgramStore:
    """Programs by id: an in-memory LRU in front of ``<root>/<id>`` files and Redis.

    Args:
      root: the directory for program files (created if missing); ``None`` for
        no files.
      decoder: decodes and validates bytes (the compiler).
      max_in_memory: how many decoded programs to keep in memory.
      shared: programs shared with other processes (Redis), or ``None``.
    """

    def __init__(self, root: Path | None, decoder: ProgramDecoder, max_in_memory: int = 256,
                 shared: SharedPrograms | None = None) -> None:
        self.root = root
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
        self._shared = shared
        self._decoder = decoder
        self._max = max_in_memory
        self._programs: OrderedDict[str, Program] = OrderedDict()
        self._lock = asyncio.Lock()

    async def put(self, data: bytes, format: str | None = None) -> tuple[Program, bool]:
        """Store ``data`` as a program; returns it and whether it was new.

        Raises a ``CompilerError`` when the bytes are not a valid program.
        """
        program_id = hashlib.sha256(data).hexdigest()
        known = await self._lookup(program_id)
        if known is not None:
            if self._shared is not None:  # e.g. uploaded here while Redis was down
                await run_in_threadpool(self._share_if_missing, known)
            return known, False
        program = await run_in_threadpool(self._decoder.decode, data, format)
        await run_in_threadpool(self._persist, program)
        self._remember(program)
        return program, True

    async def get(self, program_id: str) -> Program:
        """The program called ``program_id``; ``NotFound`` when there is none."""
        program = await self._lookup(program_id)
        if program is None:
            raise NotFound(f"no program {program_id!r:.80}; upload it with POST /v1/programs")
        return program

    async def _lookup(self, program_id: str) -> Program | None:
        if not _PROGRAM_ID.fullmatch(program_id):
            return None  # also keeps odd ids away from the file system
        if program_id in self._programs:
            self._programs.move_to_end(program_id)
            return self._programs[program_id]
        # One reader at a time, so a burst of requests decodes a file once.
        async with self._lock:
            if program_id in self._programs:
                return self._programs[program_id]
            program = await run_in_threadpool(self._read, program_id)
        if program is not None:
            self._remember(program)
        return program

    def _remember(self, program: Program) -> None:
        self._programs[program.program_id] = program
        self._programs.move_to_end(program.program_id)
        while len(self._programs) > self._max:
            self._programs.popitem(last=False)

    def _read(self, program_id: str) -> Program | None:
        stored, from_redis = self._read_file(program_id), False
        if stored is None and self._shared is not None:
            stored, from_redis = self._shared.get_program(program_id), True  # hash checked
        if stored is None:
            return None
        program = self._decode_stored(program_id, stored)
        if program is not None and from_redis and self.root is not None:
            self._persist_file(program)  # a restart of this host needs no Redis
        return program

    def _read_file(self, program_id: str) -> StoredProgram | None:
        if self.root is None:
            return None
        path = self.root / program_id
        try:
            data = path.read_bytes()
            fmt = (self.root / f"{program_id}.format").read_text().strip() or None
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != program_id:
            log.warning("program file %s does not match its hash; ignoring it", path)
            return None
        return StoredProgram(data, fmt)

    def _decode_stored(self, program_id: str, stored: StoredProgram) -> Program | None:
        try:
            return self._decoder.decode(stored.data, stored.format)
        except CompilerError as e:
            # Limits or the allowlist may have tightened since it was stored.
            log.warning("stored program %s no longer decodes: %s", program_id, e)
            return None

    def _persist(self, program: Program) -> None:
        if self.root is not None:
            self._persist_file(program)
        if self._shared is not None:
            self._shared.put_program(program.program_id, program.payload, program.format.value)

    def _share_if_missing(self, program: Program) -> None:
        if self._shared is not None and self._shared.has_program(program.program_id) is False:
            self._shared.put_program(program.program_id, program.payload, program.format.value)

    def _persist_file(self, program: Program) -> None:
        try:
            self._write(program)
        except OSError as e:
            # A full or read-only disk costs persistence, not the upload.
            log.warning("could not store program %s under %s: %s", program.program_id, self.root, e)

    def _write(self, program: Program) -> None:
        assert self.root is not None
        # The format file goes first: a payload file means the entry is complete.
        _atomic_write(self.root / f"{program.program_id}.format", program.format.value.encode())
        _atomic_write(self.root / program.program_id, program.payload)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
