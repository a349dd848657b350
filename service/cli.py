"""The ``jitserve`` command.

    jitserve serve --host 0.0.0.0 --port 8000 --cache-dir /var/cache/jitserve

Flags override the ``JITSERVE_*`` environment; everything else (limits, API keys)
comes from the environment. One process; Redis is optional (``--redis-url``, docs/redis.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jitserve", description="JIT-as-a-service for JAX/XLA")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP server")
    serve.add_argument("--host", help="interface to bind (JITSERVE_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (JITSERVE_PORT, default 8000)")
    serve.add_argument("--cache-dir", help="programs and executables (JITSERVE_CACHE_DIR)")
    serve.add_argument("--redis-url", help="Redis for shared caches (REDIS_URL); optional")
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                       help="JITSERVE_LOG_LEVEL, default info")
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    given = {"host": args.host, "port": args.port, "cache_dir": args.cache_dir,
             "redis_url": args.redis_url, "log_level": args.log_level}
    return {k: v for k, v in given.items() if v is not None}


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn with the app until interrupted."""
    import uvicorn

    from service.app import create_app
    from service.memory import retain_freed_memory
    from service.settings import Settings

    try:
        settings = Settings(**_overrides(args))
    except ValidationError as e:
        print(f"jitserve: bad configuration:\n{_describe(e)}", file=sys.stderr)
        return 2
    # Our loggers at the chosen level; third parties (jax's backend probing) at warning.
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    logging.getLogger("jitserve").setLevel(level)
    if settings.retain_freed_memory:
        retain_freed_memory()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=settings.log_level, timeout_graceful_shutdown=10)
    return 0


def _describe(error: ValidationError) -> str:
    # Without the input values: they may hold API keys or a Redis password.
    return "\n".join(f"  {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
                     for e in error.errors(include_input=False))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jitserve`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2
