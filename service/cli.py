"""The ``jitserve`` command.

    jitserve --version
    jitserve serve --host 0.0.0.0 --port 8000 --cache-dir /var/cache/jitserve
    jitserve cache ls | stats | prune --max-bytes 1G | clear   [--cache-dir DIR]

Flags override the ``JITSERVE_*`` environment; everything else (limits, API keys)
comes from the environment. One process; Redis is optional (``--redis-url``, docs/redis.md).

This module imports nothing beyond the standard library until a subcommand needs
it: a client-only install (``pip install jitserve``) still answers ``--version``,
and ``serve`` says which extra it lacks instead of failing on an import.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jitserve.service import cache_cli

if TYPE_CHECKING:
    from pydantic import ValidationError

    from jitserve.service.metrics import Metrics
    from jitserve.service.settings import Settings

__all__ = ["main"]

# What `serve` needs beyond the base install; all come with the `server` extra.
_SERVER_MODULES = ("fastapi", "uvicorn", "pydantic_settings", "jax", "jaxlib", "zstandard",
                   "prometheus_client")


def version() -> str:
    """The installed distribution's version (``0+unknown`` when run from a bare tree)."""
    try:
        return importlib.metadata.version("jitserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jitserve", description="JIT-as-a-service for JAX/XLA")
    parser.add_argument("--version", action="version", version=f"jitserve {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP server")
    serve.add_argument("--host", help="interface to bind (JITSERVE_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (JITSERVE_PORT, default 8000)")
    serve.add_argument("--cache-dir", help="programs and executables (JITSERVE_CACHE_DIR)")
    serve.add_argument("--redis-url", help="Redis for shared caches (REDIS_URL); optional")
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                       help="JITSERVE_LOG_LEVEL, default info")
    serve.add_argument("--log-format", choices=["text", "json"],
                       help="JITSERVE_LOG_FORMAT: text, or one JSON object per line")
    cache_cli.add_commands(commands)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    given = {"host": args.host, "port": args.port, "cache_dir": args.cache_dir,
             "redis_url": args.redis_url, "log_level": args.log_level,
             "log_format": args.log_format}
    return {k: v for k, v in given.items() if v is not None}


def _missing_server_modules() -> list[str]:
    missing = []
    for name in _SERVER_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn with the app until interrupted."""
    missing = _missing_server_modules()
    if missing:
        print(f"jitserve serve needs the server extra: pip install 'jitserve[server]' "
              f"(missing: {', '.join(missing)})", file=sys.stderr)
        return 2
    import uvicorn
    from pydantic import ValidationError

    from jitserve.service.app import create_app
    from jitserve.service.settings import Settings

    try:
        settings = Settings(**_overrides(args))
    except ValidationError as e:
        print(f"jitserve: bad configuration:\n{_describe(e)}", file=sys.stderr)
        return 2
    from jitserve.service import logs

    logs.configure(settings.log_level, settings.log_format)
    if settings.retain_freed_memory:
        _retain_freed_memory(settings.retain_freed_max_bytes)
    app = create_app(settings)
    log_config = logs.uvicorn_log_config(settings.log_format)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                **({"log_config": log_config} if log_config else {}),
                timeout_graceful_shutdown=10, **_connection_options(settings, app.state.metrics))
    return 0


def _retain_freed_memory(max_bytes: int) -> None:
    from jitserve.service.memory import HeapTrimmer, retain_freed_memory

    if retain_freed_memory(max_bytes):
        HeapTrimmer(max_bytes).start()  # a daemon thread: it ends with the process


def _connection_options(settings: Settings, metrics: Metrics) -> dict[str, Any]:
    """uvicorn's options for slow, idle and big-headed connections (service/connections.py)."""
    from jitserve.service.connections import HeadLimits, guarded_protocol

    limits = HeadLimits(settings.header_timeout_s, settings.max_head_bytes,
                        metrics.connection_closed)
    # ws="none": no route speaks WebSocket, and an upgraded connection would outlive the guard.
    return {"http": guarded_protocol(limits), "ws": "none",
            "timeout_keep_alive": settings.keepalive_timeout_s,
            "h11_max_incomplete_event_size": settings.max_head_bytes,
            "limit_concurrency": settings.max_connections}


def _describe(error: ValidationError) -> str:
    # Without the input values: they may hold API keys or a Redis password.
    return "\n".join(f"  {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
                     for e in error.errors(include_input=False))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jitserve`` console script; the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error
        return e.code if isinstance(e.code, int) else 2
    if args.command == "serve":
        return serve(args)
    if args.command == "cache":
        return cache_cli.run(args)
    return 2
