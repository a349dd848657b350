"""Warming: compile a manifest's programs x signatures before the first caller needs them.

``jitserve warm MANIFEST`` (``service.cli.warm``) compiles into the shared tiers
(the disk and/or Redis) and exits; ``jitserve serve --warm MANIFEST``
(``JITSERVE_WARM``) does the same in the server, and ``/readyz`` answers 503
``warming`` until it is done. Both go through the server's own objects
(``ProgramStore.put`` to decode, ``Calls.compile`` to look up), so the programs
are decoded and compiled by runtimes, never in this process, and the keys are
the ones the server's calls will ask for.

A manifest is TOML or JSON; paths are relative to it::

    [[programs]]
    file = "model.export"               # program bytes (jax_export, stablehlo, jaxpr)
    format = "jax_export"               # optional: detected when omitted
    signatures = [["float32[8,3]"],     # input avals; each also {shape = [8, 3], dtype = "float32"}
                  ["float32[16,3]"]]    # optional: the program's own avals (static programs)
    static_keys = ["", "train"]         # optional: each signature with each static key
    donate = [0]                        # optional: inputs the runs may consume
    compiler_options = {xla_cpu_enable_fast_math = true}  # optional: jax.jit's, as the calls give them

Example::

    items = load_manifest(Path("warm.toml"))
    warming = Warming(items)
    await warming.run(programs, calls, concurrency=2)   # warming.finished, .failed
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jitserve.compiler.errors import InvalidProgram
from jitserve.compiler.options import check_compiler_options
from jitserve.wire import Aval, WireError

if TYPE_CHECKING:
    from ..settings import Settings
    from .calls import Calls
    from .programs import ProgramStore

__all__ = ["ManifestError", "WarmItem", "WarmResult", "Warming", "load_manifest", "start_warming"]

log = logging.getLogger("jitserve.warm")

_AVAL = re.compile(r"^\s*(\w+)\s*\[([^\]]*)\]\s*$")
_PROGRAM_KEYS = frozenset({"file", "format", "signatures", "static_keys", "donate",
                           "compiler_options"})


class ManifestError(ValueError):
    """A manifest that cannot be read; the message names the file and the entry."""


@dataclasses.dataclass(frozen=True)
class WarmItem:
    """One executable to compile.

    Attributes:
      file: the program's bytes.
      format: ``jax_export``, ``stablehlo``, ``jaxpr``, or ``None`` to detect it.
      in_avals: concrete input avals; ``None`` for the program's own (static) ones.
      static_key, donate, compiler_options: as an execute's (``CallOptions``).
    """

    file: Path
    format: str | None
    in_avals: tuple[Aval, ...] | None
    static_key: str = ""
    donate: tuple[int, ...] = ()
    compiler_options: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        avals = "own avals" if self.in_avals is None else ", ".join(map(str, self.in_avals))
        static = f" static={self.static_key!r}" if self.static_key else ""
        return f"{self.file.name}({avals}){static}"


def _aval(spec: Any, where: str) -> Aval:
    """``"float32[8,3]"`` or ``{shape, dtype}`` as an ``Aval``."""
    try:
        if isinstance(spec, str):
            found = _AVAL.match(spec)
            if not found:
                raise ManifestError(f"{where}: {spec!r} is not an aval such as 'float32[8,3]'")
            dims = [d.strip() for d in found.group(2).split(",") if d.strip()]
            return Aval(tuple(int(d) for d in dims), found.group(1))
        return Aval.from_json(spec)
    except (WireError, ValueError) as e:
        if isinstance(e, ManifestError):
            raise
        raise ManifestError(f"{where}: {e}") from None


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
        doc = json.loads(text) if path.suffix == ".json" else tomllib.loads(text.decode())
    except (OSError, ValueError) as e:
        raise ManifestError(f"manifest {path}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("programs"), list):
        raise ManifestError(f"manifest {path}: expected a list 'programs' "
                            "([[programs]] in TOML)")
    return doc


def _items_of(entry: Any, base: Path, where: str) -> list[WarmItem]:
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        raise ManifestError(f"{where}: each program needs 'file' (a path)")
    unknown = set(entry) - _PROGRAM_KEYS
    if unknown:
        raise ManifestError(f"{where}: unknown keys {sorted(unknown)}; known: "
                            f"{sorted(_PROGRAM_KEYS)}")
    file = base / entry["file"]
    if not file.exists():
        raise ManifestError(f"{where}: no program file {file}")
    signatures = entry.get("signatures")
    statics = entry.get("static_keys", [""])
    donate = entry.get("donate", [])
    if not (isinstance(statics, list) and all(isinstance(s, str) for s in statics)):
        raise ManifestError(f"{where}: 'static_keys' is a list of strings")
    if not (isinstance(donate, list) and all(isinstance(i, int) for i in donate)):
        raise ManifestError(f"{where}: 'donate' is a list of input indices")
    try:
        options = check_compiler_options(entry.get("compiler_options"))
    except InvalidProgram as e:
        raise ManifestError(f"{where}: {e}") from None
    if signatures is not None and not (isinstance(signatures, list)
                                       and all(isinstance(s, list) for s in signatures)):
        raise ManifestError(f"{where}: 'signatures' is a list of lists of avals")
    avals: list[tuple[Aval, ...] | None] = (
        [None] if signatures is None else
        [tuple(_aval(a, f"{where}.signatures[{i}]") for a in sig)
         for i, sig in enumerate(signatures)])
    return [WarmItem(file, entry.get("format"), a, s, tuple(sorted(set(donate))), options)
            for a in avals for s in statics]


def load_manifest(path: Path) -> list[WarmItem]:
    """The items of manifest ``path`` (TOML, or JSON by its ``.json`` suffix), in order.

    ``ManifestError`` names the first thing wrong (a missing file, a bad aval...).
    """
    path = Path(path)
    doc = _read(path)
    items = []
    for i, entry in enumerate(doc["programs"]):
        items.extend(_items_of(entry, path.parent, f"{path}: programs[{i}]"))
    return items


@dataclasses.dataclass
class WarmResult:
    """How one item went: the tier that answered (``compiled``, ``disk``...) or an error."""

    item: WarmItem
    tier: str | None = None
    executable_id: str | None = None
    error: str | None = None


class Warming:
    """The compiles of one manifest, and how far they are (``/readyz`` shows it).

    Args:
      items: what to compile (``load_manifest``).
      on_progress: called after each item, with its result (a progress bar).
    """

    def __init__(self, items: Sequence[WarmItem],
                 on_progress: Callable[[WarmResult], None] | None = None) -> None:
        self.items = list(items)
        self.results: list[WarmResult] = []
        self.on_progress = on_progress
        self.finished = False
        self.seconds: float | None = None
        self.task: asyncio.Task[None] | None = None

    def start(self, programs: ProgramStore, calls: Calls, *, concurrency: int = 1) -> None:
        """``run`` in a task of the running loop (``wait`` for it, ``stop`` it)."""
        self.task = asyncio.get_running_loop().create_task(
            self.run(programs, calls, concurrency=concurrency))

    async def wait(self) -> None:
        """Until ``run`` (started by ``start``) is done."""
        if self.task is not None:
            await asyncio.shield(self.task)

    async def stop(self) -> None:
        """Cancel the warming task (shutdown)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    @property
    def failed(self) -> list[WarmResult]:
        """The results of the items that failed so far."""
        return [r for r in self.results if r.error is not None]

    def describe(self) -> dict[str, Any]:
        """``{"done", "total", "failed", "finished"}`` for ``/readyz``."""
        return {"done": len(self.results), "total": len(self.items),
                "failed": len(self.failed), "finished": self.finished}

    async def run(self, programs: ProgramStore, calls: Calls, *, concurrency: int = 1) -> None:
        """Decode each file once, then look up every item, ``concurrency`` at a time.

        A failure is recorded (and logged), never raised: warming is best effort,
        and a program that does not compile here fails its callers with the reason.
        """
        start = time.perf_counter()
        decoded: dict[tuple[Path, str | None], asyncio.Task[Any]] = {}
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(item: WarmItem) -> None:
            async with gate:
                result = await self._one(item, programs, calls, decoded)
            self.results.append(result)
            if self.on_progress is not None:
                self.on_progress(result)

        try:
            await asyncio.gather(*(one(item) for item in self.items))
        finally:
            self.finished = True
            self.seconds = time.perf_counter() - start
        compiled = sum(r.tier == "compiled" for r in self.results)
        log.info("warmed %d executables in %.1f s: %d compiled, %d from a cache, %d failed",
                 len(self.results), self.seconds, compiled,
                 len(self.results) - compiled - len(self.failed), len(self.failed),
                 extra={"fields": {**self.describe(), "seconds": round(self.seconds, 3)}})

    async def _one(self, item: WarmItem, programs: ProgramStore, calls: Calls,
                   decoded: dict[tuple[Path, str | None], asyncio.Task[Any]]) -> WarmResult:
        from .executables import CallOptions

        try:
            key = (item.file, item.format)
            if key not in decoded:  # the bytes go to a runtime; this process never parses them
                decoded[key] = asyncio.ensure_future(self._decode(item, programs))
            program = await decoded[key]
            lookup = await calls.compile(program, item.in_avals, CallOptions(
                item.static_key, item.donate, compiler_options=item.compiler_options))
        except Exception as e:  # noqa: BLE001 - every refusal is the item's result
            log.warning("warming %s failed: %s", item, e)
            return WarmResult(item, error=f"{type(e).__name__}: {e}")
        return WarmResult(item, str(lookup.tier), lookup.executable_id)

    @staticmethod
    async def _decode(item: WarmItem, programs: ProgramStore) -> Any:
        data = await asyncio.to_thread(item.file.read_bytes)
        program, _ = await programs.put(data, item.format)
        return program


def start_warming(settings: Settings, programs: ProgramStore, calls: Calls, concurrency: int,
                  on_progress: Callable[[WarmResult], None] | None = None) -> Warming | None:
    """The server's warming (``settings.warm``), started; ``None`` without a manifest.

    ``ManifestError`` when the manifest is bad: the server does not start.
    ``on_progress``: called with each item's result (``jitserve warm``'s progress bar).
    """
    if settings.warm is None:
        return None
    warming = Warming(load_manifest(settings.warm), on_progress)
    warming.start(programs, calls, concurrency=concurrency)
    return warming

