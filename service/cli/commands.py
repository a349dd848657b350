"""The ``jitserve`` command.

    jitserve --version
    jitserve serve --host 0.0.0.0 --port 8000 --cache-dir /var/cache/jitserve
    jitserve serve --config /etc/jitserve.toml --warm manifest.toml
    jitserve warm manifest.toml --cache-dir /var/cache/jitserve      # precompile, then exit
    jitserve bench http://127.0.0.1:8000 --json bench.json          # P1 latency, P4 GB/s
    jitserve cache ls | stats | prune --max-bytes 1G | clear   [--cache-dir DIR]

``serve`` and ``warm`` take a flag for every field of ``service.settings.Settings``
(made from the model, so a new setting gets its flag with no change here), except
secrets (API keys, admin keys, cache and peer secrets), which come only from the
environment or the config file. Precedence: flags, then ``--config FILE`` (TOML,
keys are the settings' names), then the ``JITSERVE_*`` environment, then defaults.

This module imports nothing beyond the standard library until a subcommand needs
it: a client-only install (``pip install jitserve``) still answers ``--version``,
and ``serve`` says which extra it lacks instead of failing on an import.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import cache as cache_cli

if TYPE_CHECKING:
    from pydantic import ValidationError

    from ..settings import Settings

__all__ = ["load_settings", "main", "read_config"]

# What `serve` needs beyond the base install; all come with the `server` extra.
_SERVER_MODULES = ("fastapi", "uvicorn", "pydantic_settings", "jax", "jaxlib", "zstandard",
                   "prometheus_client")
_SETTINGS_COMMANDS = ("serve", "warm")
# Settings that hold secrets: a flag would show them to every user of `ps`.
_SECRET_FIELDS = frozenset({"api_keys", "admin_keys"})


def version() -> str:
    """The installed distribution's version (``0+unknown`` when run from a bare tree)."""
    try:
        return importlib.metadata.version("jitserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command`` (the first word of argv) decides whether the settings'
    flags are made, which imports the settings (and jax)."""
    with_settings = command in _SETTINGS_COMMANDS and not _missing_server_modules()
    parser = argparse.ArgumentParser(prog="jitserve", description="JIT-as-a-service for JAX/XLA")
    parser.add_argument("--version", action="version", version=f"jitserve {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="run the HTTP server",
        description="Run the HTTP server. Precedence: flags > --config file > JITSERVE_* "
                    "environment > defaults; secrets come from the environment or the file.")
    warm = commands.add_parser(
        "warm", help="compile a manifest's programs into the shared cache tiers",
        description="Compile every program x signature of MANIFEST (TOML or JSON, see "
                    "docs/service.md) with runtimes as the server does, into the disk and/or "
                    "Redis tiers, then exit (1 if any failed).")
    warm.add_argument("manifest", type=Path, help="the manifest (.toml or .json)")
    for sub, skip in ((serve, frozenset()), (warm, frozenset({"warm"}))):
        sub.add_argument("--config", type=Path, metavar="FILE",
                         help="TOML file of settings (keys: the settings' names)")
        if with_settings:
            _add_settings_flags(sub, skip)
        else:  # parsed again once the extra is there; here only to say it is missing
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    from . import bench as bench_cli

    bench_cli.add_command(commands)
    cache_cli.add_commands(commands)
    return parser


# -- settings as flags and files -------------------------------------------------------


def _flag_fields(skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The settings that get a flag: every field but secrets (and ``skip``)."""
    from pydantic import SecretStr

    from ..settings import Settings

    out = {}
    for name, field in Settings.model_fields.items():
        if name in skip or name in _SECRET_FIELDS or SecretStr in _types(field.annotation):
            continue
        out[name] = field
    return out


def _types(annotation: Any) -> tuple[Any, ...]:
    """The types of ``annotation`` without ``None`` (``int | None`` -> ``(int,)``)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(t for t in typing.get_args(annotation) if t is not type(None))
    return (annotation,)


def _field_comments() -> dict[str, str]:
    """Each setting's comment in ``service/settings.py`` (the lines right above it): help text."""
    from ..settings import Settings

    out: dict[str, str] = {}
    comment: list[str] = []
    for line in inspect.getsource(Settings).splitlines():
        text = line.strip()
        if text.startswith("#"):
            comment.append(text.lstrip("# "))
            continue
        field = re.match(r"(\w+)\s*:", text)
        if field and comment:
            out[field.group(1)] = " ".join(comment)
        comment = []
    return out


def _add_settings_flags(parser: argparse.ArgumentParser, skip: frozenset[str]) -> None:
    comments = _field_comments()
    group = parser.add_argument_group("settings", "one flag per setting (JITSERVE_<NAME>)")
    for name, field in _flag_fields(skip).items():
        kinds = _types(field.annotation)
        about = field.description or comments.get(name, "")
        default = "" if field.default is None else f", default {field.default}"
        help_text = f"{about} (JITSERVE_{name.upper()}{default})".strip().replace("%", "%%")
        flag = "--" + name.replace("_", "-")
        if kinds == (bool,):
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        elif typing.get_origin(kinds[0]) is typing.Literal:
            group.add_argument(flag, dest=name, choices=typing.get_args(kinds[0]), help=help_text)
        else:
            kind = cache_cli.byte_count if name.endswith("_bytes") and int in kinds else str
            group.add_argument(flag, dest=name, type=kind, metavar=_metavar(name, kinds),
                               help=help_text)


def _metavar(name: str, kinds: tuple[Any, ...]) -> str:
    for suffix, metavar in (("_bytes", "BYTES"), ("_ms", "MS"), ("_s", "SECONDS"),
                            ("dir", "DIR")):
        if name.endswith(suffix):
            return metavar
    if Path in kinds:
        return "FILE"
    if int in kinds:
        return "N"
    return "X" if float in kinds else name.split("_")[-1].upper()


def read_config(path: Path) -> dict[str, Any]:
    """The settings in TOML file ``path``: ``{name: value}``.

    Keys are the settings' names (``cache_dir`` or ``cache-dir``); byte counts may be
    ``"10G"``; relative paths are taken from the file's directory. ``ValueError``
    names an unknown key and the closest known one.
    """
    from ..settings import Settings

    with path.open("rb") as f:
        doc = tomllib.load(f)
    fields = Settings.model_fields
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{path}: {key!r} is not a setting{hint}")
        kinds = _types(fields[name].annotation)
        if name.endswith("_bytes") and isinstance(value, str):
            value = cache_cli.byte_count(value)
        elif Path in kinds and isinstance(value, str):
            value = path.parent / Path(value).expanduser()
        out[name] = value
    return out


def load_settings(args: argparse.Namespace) -> Settings:
    """The settings of a ``serve`` or ``warm`` command line: its flags over its
    ``--config`` file over the environment (``ValidationError`` or ``ValueError``)."""
    from ..settings import Settings

    values = read_config(args.config) if getattr(args, "config", None) else {}
    values.update({name: getattr(args, name) for name in _flag_fields()
                   if getattr(args, name, None) is not None})
    return Settings(**values)


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


def _settings_or_exit(args: argparse.Namespace) -> Settings | int:
    """The command line's settings, or the exit status after saying what is wrong."""
    missing = _missing_server_modules()
    if missing:
        print(f"jitserve {args.command} needs the server extra: pip install 'jitserve[server]' "
              f"(missing: {', '.join(missing)})", file=sys.stderr)
        return 2
    from pydantic import ValidationError

    try:
        return load_settings(args)
    except ValidationError as e:
        print(f"jitserve: bad configuration:\n{_describe(e)}", file=sys.stderr)
    except (OSError, ValueError, tomllib.TOMLDecodeError, argparse.ArgumentTypeError) as e:
        print(f"jitserve: bad configuration: {e}", file=sys.stderr)
    return 2


def serve(args: argparse.Namespace) -> int:
    """Run uvicorn with the app until interrupted."""
    settings = _settings_or_exit(args)
    if isinstance(settings, int):
        return settings
    if settings.warm is not None:
        from ..calls.warming import ManifestError, load_manifest

        try:
            load_manifest(settings.warm)  # a bad manifest stops the start, not a later task
        except ManifestError as e:
            print(f"jitserve serve: {e}", file=sys.stderr)
            return 2
    from .. import logs
    from ..app import create_app
    from .serve import connection_options, retain_freed_memory, run_server

    logs.configure(settings.log_level, settings.log_format)
    if settings.retain_freed_memory:
        retain_freed_memory(settings.retain_freed_max_bytes)
    app = create_app(settings)
    log_config = logs.uvicorn_log_config(settings.log_format)
    run_server(app, host=settings.host, port=settings.port, log_level=settings.log_level,
               **({"log_config": log_config} if log_config else {}),
               timeout_graceful_shutdown=10, **connection_options(settings, app.metrics))
    return 0


def warm(args: argparse.Namespace) -> int:
    """Compile a manifest into the shared tiers with runtimes, as the server would."""
    settings = _settings_or_exit(args)
    if isinstance(settings, int):
        return settings
    chosen = (getattr(args, "log_level", None) is not None or "JITSERVE_LOG_LEVEL" in os.environ
              or (args.config is not None and "log_level" in read_config(args.config)))
    if not chosen:  # compile lines would break the progress bar
        settings = settings.model_copy(update={"log_level": "warning"})
    from .warm import run

    return run(settings, args.manifest)


def _describe(error: ValidationError) -> str:
    # Without the input values: they may hold API keys or a Redis password.
    return "\n".join(f"  {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
                     for e in error.errors(include_input=False))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jitserve`` console script; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = _parser(command).parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error
        return e.code if isinstance(e.code, int) else 2
    if args.command == "serve":
        return serve(args)
    if args.command == "warm":
        return warm(args)
    if args.command == "bench":
        from . import bench as bench_cli

        return bench_cli.run(args)
    if args.command == "cache":
        return cache_cli.run(args)
    return 2
