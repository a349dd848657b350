"""Show that a wait is a compile: a progress bar for a person watching, else one log line.

A first call of a big program may compile for minutes on the server. When a
``result()`` (or ``block_until_ready()``) has waited ``PROGRESS_AFTER`` seconds
on a future that is still compiling, the client says so: a ``tqdm.auto`` bar (a
widget in notebooks) when stderr is a terminal or in a notebook, otherwise one
INFO line on the ``jitserve.client`` logger. ``Client(progress=False)`` or
``JITSERVE_PROGRESS=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator

__all__ = ["PROGRESS_AFTER", "PROGRESS_ENV", "PROGRESS_TICK", "compile_progress", "progress_default"]

logger = logging.getLogger("jitserve.client")

PROGRESS_ENV = "JITSERVE_PROGRESS"
#: Seconds of waiting before the client looks whether the future is compiling.
PROGRESS_AFTER = 2.0
#: Seconds between updates of the bar (each one long-polls the future's status).
PROGRESS_TICK = 1.0


def progress_default() -> bool:
    """Whether progress is shown when ``Client(progress=...)`` is not given: ``$JITSERVE_PROGRESS``."""
    return os.environ.get(PROGRESS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _watched() -> bool:
    """Whether a person is likely watching: stderr is a terminal, or this is a notebook kernel."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if type(shell).__name__ == "ZMQInteractiveShell":
        return True
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except ValueError:  # a closed stderr
        return False


@contextlib.contextmanager
def compile_progress(what: str, server: str) -> Iterator[Callable[[float], None]]:
    """A function to call with the seconds compiled so far, while ``what`` compiles on ``server``."""
    if not _watched():
        said: list[bool] = []

        def log(seconds: float) -> None:
            if not said:
                logger.info("compiling %s on %s: %.0f s so far", what, server, seconds)
                said.append(True)

        yield log
        return
    from tqdm.auto import tqdm

    bar = tqdm(desc=f"compiling {what} on {server}", bar_format="{desc}", leave=False)
    try:
        yield lambda seconds: bar.set_description_str(
            f"compiling {what} on {server}: {seconds:.0f} s so far")
    finally:
        bar.close()
