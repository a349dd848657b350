"""The program store: uploaded programs, content-addressed and persisted.

A program's id is the sha256 of its bytes, so an upload is idempotent: the same
bytes give the same id, and a second upload skips decoding. Programs live in
memory (a bounded LRU) and on disk under ``<cache_dir>/programs/<id>``, so they
survive a restart; a disk copy is re-validated when it is read back.
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

from compiler.errors import CompilerError
from compiler.programs import Program
from service.errors import NotFound

__all__ = ["ProgramDecoder", "ProgramStore"]

log = logging.getLogger("jitserve.programs")

_PROGRAM_ID = re.compile(r"[0-9a-f]{64}")


class ProgramDecoder(Protocol):
    """What the store needs from the compiler: ``Compiler.decode``."""

    def decode(self, data: bytes, format: str | None = None) -> Program: ...


class ProgramStore:
    """Programs by id: an in-memory LRU in front of ``<root>/<id>`` files.

    Args:
      root: the directory for program files (created if missing).
      decoder: decodes and validates bytes (the compiler).
      max_in_memory: how many decoded programs to keep in memory.
    """

    def __init__(self, root: Path, decoder: ProgramDecoder, max_in_memory: int = 256) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
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
        path = self.root / program_id
        try:
            data = path.read_bytes()
            fmt = (self.root / f"{program_id}.format").read_text().strip() or None
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != program_id:
            log.warning("program file %s does not match its hash; ignoring it", path)
            return None
        try:
            return self._decoder.decode(data, fmt)
        except CompilerError as e:
            # Limits or the allowlist may have tightened since it was stored.
            log.warning("stored program %s no longer decodes: %s", program_id, e)
            return None

    def _persist(self, program: Program) -> None:
        try:
            self._write(program)
        except OSError as e:
            # A full or read-only disk costs persistence, not the upload.
            log.warning("could not store program %s under %s: %s", program.program_id, self.root, e)

    def _write(self, program: Program) -> None:
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
