"""``jitserve cache``: look at and trim a cache directory's disk tier, without a server.

    jitserve cache ls [--meta]              # kind, id, size, last used (--meta: program, avals)
    jitserve cache stats                    # blobs and bytes per kind
    jitserve cache prune --max-bytes 2G     # evict least recently used until under 2 GiB
    jitserve cache clear                    # every blob (the cache-secret file stays)

Each takes ``--cache-dir`` (default: ``JITSERVE_CACHE_DIR``, else the settings'
default). They only touch files (``compiler.disk``), never import jax, and are
safe while a server uses the directory: what they remove is a miss there, and
the server recompiles it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jitserve.compiler.disk import DiskEntry

__all__ = ["add_commands", "run"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_count(text: str) -> int:
    """``N``, or ``N`` with a binary suffix (``512M``, ``10G``, ``1.5GiB``) as bytes."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1:] if value[-1:] in _UNITS else ""
    try:
        count = float(value[:len(value) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 1073741824, 1G)") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"a byte count cannot be negative: {text!r}")
    return int(count)


def add_commands(commands: Any) -> None:
    """Add ``cache`` and its subcommands to the ``jitserve`` parser's ``commands``."""
    cache = commands.add_parser("cache", help="inspect or trim the disk cache")
    actions = cache.add_subparsers(dest="cache_command", required=True)
    parsers = {
        "ls": actions.add_parser("ls", help="list cached blobs, least recently used first"),
        "stats": actions.add_parser("stats", help="blobs and bytes per kind"),
        "prune": actions.add_parser("prune", help="evict least recently used blobs"),
        "clear": actions.add_parser("clear", help="remove every blob (not the cache secret)"),
    }
    for parser in parsers.values():
        parser.add_argument("--cache-dir", type=Path,
                            help="the cache directory (JITSERVE_CACHE_DIR, default ~/.cache/jitserve)")
    parsers["ls"].add_argument("--meta", action="store_true",
                               help="read each executable's program id, avals and compile "
                                    "seconds (checks and decompresses every entry)")
    parsers["prune"].add_argument("--max-bytes", type=byte_count, required=True,
                                  help="keep at most this many bytes (e.g. 1073741824, 1G)")


def run(args: argparse.Namespace) -> int:
    """Run ``jitserve cache <command>``; the exit status."""
    if importlib.util.find_spec("zstandard") is None:
        print("jitserve cache needs the server extra: pip install 'jitserve[server]' "
              "(missing: zstandard)", file=sys.stderr)
        return 2
    from jitserve.compiler.disk import DEFAULT_CACHE_DIR

    cache_dir = (args.cache_dir or Path(os.environ.get("JITSERVE_CACHE_DIR", DEFAULT_CACHE_DIR)))
    cache_dir = cache_dir.expanduser()
    if not cache_dir.is_dir():
        print(f"jitserve cache: {cache_dir} is not a directory (give --cache-dir, or set "
              "JITSERVE_CACHE_DIR)", file=sys.stderr)
        return 2
    command = {"ls": _ls, "stats": _stats, "prune": _prune, "clear": _clear}[args.cache_command]
    return command(cache_dir, args)


def _ls(cache_dir: Path, args: argparse.Namespace) -> int:
    from jitserve.compiler.disk import scan

    read_meta = _meta_reader(cache_dir) if args.meta else None
    print(f"{'KIND':<12} {'ID':<16} {'BYTES':>12}  {'LAST USED':<19}"
          + ("  PROGRAM          COMPILE_S  AVALS" if read_meta else ""))
    for entry in scan(cache_dir):
        line = (f"{entry.kind:<12} {entry.key[:16]:<16} {entry.size:>12}  "
                f"{_when(entry.last_used):<19}")
        if read_meta and entry.kind == "executables":
            line += "  " + read_meta(entry)
        print(line)
    return 0


def _stats(cache_dir: Path, args: argparse.Namespace) -> int:
    from jitserve.compiler.disk import BLOB_KINDS, scan

    entries = scan(cache_dir)
    print(f"{'KIND':<12} {'BLOBS':>8} {'BYTES':>14}")
    for kind in BLOB_KINDS:
        mine = [e for e in entries if e.kind == kind]
        print(f"{kind:<12} {len(mine):>8} {sum(e.size for e in mine):>14}")
    print(f"{'total':<12} {len(entries):>8} {sum(e.size for e in entries):>14}")
    return 0


def _prune(cache_dir: Path, args: argparse.Namespace) -> int:
    from jitserve.compiler.disk import prune

    remaining, removed = prune(cache_dir, args.max_bytes)
    print(f"removed {removed} blobs; {remaining} bytes remain in {cache_dir}")
    return 0


def _clear(cache_dir: Path, args: argparse.Namespace) -> int:
    from jitserve.compiler.disk import remove, scan

    removed = sum(remove(entry, if_unused=False) for entry in scan(cache_dir))
    print(f"removed {removed} blobs from {cache_dir}")
    return 0


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def _meta_reader(cache_dir: Path) -> Any:
    """A function from an executable's entry to its meta columns, or ``None`` without a secret.

    Entries are signed: the meta is read only from entries that check out with
    the server's secret (``JITSERVE_CACHE_SECRET``, else ``<cache_dir>/cache-secret``).
    """
    from jitserve.compiler.cache import CacheSecret, CorruptEntry, decode_entry
    from jitserve.wire import Aval

    configured = os.environ.get("JITSERVE_CACHE_SECRET")
    secret_file = cache_dir / "cache-secret"
    if configured:
        secret = CacheSecret.from_value(configured)
    elif secret_file.is_file():
        secret = CacheSecret.from_value(secret_file.read_bytes().strip())
    else:
        print(f"jitserve cache: no cache secret ({secret_file} or JITSERVE_CACHE_SECRET); "
              "listing without meta", file=sys.stderr)
        return None

    def read(entry: DiskEntry) -> str:
        try:
            meta = decode_entry(entry.key, entry.path.read_bytes(), secret).meta
            avals = ", ".join(str(Aval.from_json(a)) for a in meta.get("in_avals", []))
            return (f"{str(meta.get('program_id', '?'))[:16]:<16} "
                    f"{float(meta.get('compile_seconds', 0.0)):>9.3f}  ({avals})")
        except (OSError, CorruptEntry, ValueError, TypeError, KeyError) as e:
            return f"(unreadable: {type(e).__name__})"

    return read
