"""The ``jitserve`` command: ``serve``, ``warm``, ``cache``, ``bench`` (``main``).

    jitserve serve --host 127.0.0.1 --port 8000
    jitserve warm manifest.toml
    jitserve cache ls
    jitserve bench http://127.0.0.1:8000

Every module here imports nothing beyond the standard library until a subcommand
needs it, so ``jitserve --version`` answers on a client-only install.
"""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
