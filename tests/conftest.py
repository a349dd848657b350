"""Session-wide test setup: x64 on, as the server runs it."""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)
