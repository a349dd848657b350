"""jitserve's server: the FastAPI app, its settings, and the ``jitserve`` CLI.

    from service import Settings, create_app
    app = create_app(Settings(cache_dir="/tmp/jitserve"))
"""

from __future__ import annotations

from service.app import create_app
from service.settings import Settings

__all__ = ["Settings", "create_app"]
