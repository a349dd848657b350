"""jitserve's server: the FastAPI app, its settings, and the ``jitserve`` CLI.

    from jitserve.service import Settings, create_app
    app = create_app(Settings(cache_dir="/tmp/jitserve"))

``Settings`` and ``create_app`` load on first use, so ``jitserve.service.cli``
(the ``jitserve`` command) imports on a client-only install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .settings import Settings

__all__ = ["Settings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app
        return create_app
    if name == "Settings":
        from .settings import Settings
        return Settings
    raise AttributeError(f"module 'jitserve.service' has no attribute {name!r}")
