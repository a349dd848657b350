"""Uploaded programs, content-addressed and kept in the same tiers as executables.

A program's id is the sha256 of its bytes, so an upload is idempotent: the same
bytes give the same id, and a second upload skips decoding. Programs go through
one ``compiler.cache.TieredStore`` of kind ``PROGRAMS``: decoded programs in
memory, program blobs on disk (``<cache_dir>/programs/``) so they survive a
restart, and in Redis when one is shared, so a program uploaded through one
process runs through any other.

A blob is the program's format and bytes in one frame (one file, one Redis
string), so a reader never sees one without the other. Blobs read back are
untrusted: their bytes must hash to their id, and they are decoded and validated
again exactly like an upload.

Unlike executable entries, blobs carry no MAC (``compiler.cache.CacheSecret``),
and need none: they are content-addressed, so a blob moved under another id
fails the hash check, and a blob that a writer to the tier stores under its own
id is no more than an upload of that program, which anyone may make and which
is validated the same way. The format name is outside the hash, but the formats'
encodings differ (a flatbuffer, MLIR, a JSON or msgpack document), so another
name makes the decode fail: a miss, not another program.
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
from collections.abc import Callable, Sequence

from jitserve.compiler.cache import PROGRAMS, CorruptEntry, MemoryCache, Tier, TieredStore
from jitserve.compiler.errors import CompilerError
from jitserve.compiler.records import Program
from jitserve.wire import ProgramFormat

__all__ = ["PROGRAM_BLOB_VERSION", "StoredPrograms", "decode_program_blob", "encode_program_blob"]

logger = logging.getLogger("jitserve.compiler.programs")

_MAGIC = b"JSXP"
# Program blob framing. Blobs of another version are misses (and get overwritten
# by the next upload), never errors.
# 2026-11-23: 1, first version. Before it, the disk kept ``programs/<id>`` and a
#   ``programs/<id>.format`` side file, and Redis a hash; those are not read.
PROGRAM_BLOB_VERSION = 1
_HEADER = struct.Struct("<4sHB")  # magic, version, length of the format name
_PROGRAM_ID = re.compile(r"[0-9a-f]{64}")

Decode = Callable[[bytes, str | None], Program]


def encode_program_blob(data: bytes, format: str) -> bytes:
    """The blob the tiers keep for a program: a header, its format's name, its bytes."""
    name = format.encode()
    return _HEADER.pack(_MAGIC, PROGRAM_BLOB_VERSION, len(name)) + name + data


def decode_program_blob(program_id: str, blob: bytes) -> tuple[bytes, str]:
    """The bytes and format name kept in ``blob``; ``CorruptEntry`` unless they are ``program_id``'s."""
    if len(blob) < _HEADER.size:
        raise CorruptEntry(f"program blob is {len(blob)} bytes, shorter than its header")
    magic, version, name_len = _HEADER.unpack_from(blob)
    if magic != _MAGIC or version != PROGRAM_BLOB_VERSION:
        raise CorruptEntry(f"program blob has magic {magic!r} version {version}")
    start = _HEADER.size + name_len
    name = blob[_HEADER.size:start].decode("ascii", "replace")
    if name not in {f.value for f in ProgramFormat}:
        raise CorruptEntry(f"program blob names format {name!r:.40}")
    data = blob[start:]
    if hashlib.sha256(data).hexdigest() != program_id:
        raise CorruptEntry("program bytes do not match their id (sha256)")
    return data, name


class StoredPrograms:
    """Programs by id: ``Compiler.programs``. Blocking; a server calls it from a thread pool.

    Args:
      tiers: the L2 tiers of kind ``PROGRAMS``, fastest first.
      memory: the cache of decoded programs (count and bytes bounded).
      decode: decodes and validates bytes (``Compiler.decode``).

    Example::

        program, created = compiler.programs.put(exported.serialize())
        assert compiler.programs.get(program.program_id) == program
    """

    def __init__(self, tiers: Sequence[Tier], memory: MemoryCache[Program], decode: Decode) -> None:
        self._decode = decode
        self.store: TieredStore[Program] = TieredStore(
            PROGRAMS, tiers, memory, self._load, lambda p: len(p.payload))

    def cached(self, program_id: str) -> Program | None:
        """The program if it is in memory, else ``None``: never blocks."""
        return self.store.cached(program_id) if _PROGRAM_ID.fullmatch(program_id) else None

    def get(self, program_id: str) -> Program | None:
        """The program called ``program_id`` from the first tier that has it; ``None`` if none."""
        if not _PROGRAM_ID.fullmatch(program_id):
            return None  # also keeps odd ids away from the file system
        found = self.store.get(program_id)
        return None if found is None else found[0]

    def put(self, data: bytes, format: str | None = None) -> tuple[Program, bool]:
        """Keep ``data`` as a program; returns it and whether it was new.

        Raises a ``CompilerError`` when the bytes are not a valid program.
        """
        program_id = hashlib.sha256(data).hexdigest()
        known = self.get(program_id)
        if known is not None:
            # e.g. uploaded here while Redis was down, or evicted from it since.
            self.store.fill(program_id, _blob(known))
            return known, False
        program = self._decode(data, format)
        self.store.put(program_id, _blob(program), program)
        return program, True

    def _load(self, program_id: str, blob: bytes) -> Program | None:
        data, name = decode_program_blob(program_id, blob)
        try:
            return self._decode(data, name)
        except CompilerError as e:
            # Limits or the allowlist may have tightened since it was stored; the
            # blob stays for servers that still accept it.
            logger.warning("stored program %s no longer decodes: %s", program_id, e)
            return None


def _blob(program: Program) -> bytes:
    return encode_program_blob(program.payload, program.format.value)
